"""DFlash2's own layers: the grouped dynamic convolution and the candidate selector.

What DFlash2 adds to the DFlash drafter, built by `pipeline.models.dflash` only where the config sets
`layout.DFLASH2_FIELDS`: `GroupedDynamicConv` around every attention and MLP sublayer (causal within each
block), and `CandidateSelector` (its result: `SelectorPath`), which rescores the target head's top-K candidates
per draft slot and walks the greedy path. Kept apart so that `dflash.py` holds the config, the shared layers and
the two forward paths; `pipeline.models.dflash` imports these names (they stay importable from it), and the
model, its state dict keys and its checkpoints are what they were. Nothing of `pipeline.models.dflash` is
imported here (no cycle): a selector's `config` is a `DFlashConfig` with the selector fields set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig


class GroupedDynamicConv(nn.Module):
    """DFlash2's grouped dynamic depthwise convolution around one sublayer (causal inside each block).

    `base_kernel` [2, taps, H] holds a static per-channel kernel for each side (0: the sublayer's input,
    1: its output); `kernel_projection` (a Linear H -> 2 * taps * G, G = H / group_size) turns the
    sublayer's normed input into per-row, per-group coefficients for both sides. Row t of a block is
    sum over taps j of (base[side, j] + dynamic[t, side, j, group]) * x[t - j], rows before the block's
    first being zero: a block never sees another block's rows.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, H] -> dynamic coefficients [B, L, 2 (side), taps, G]."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, side: int, block: int | None = None) -> torch.Tensor:
        """x [B, L, H], dynamic [B, L, taps, G]; the rows are consecutive blocks of `block` rows (default L)."""
        b, length, h = x.shape
        block = block or length
        rows = x.reshape(b, length // block, block, self.groups, self.group_size)
        coef = dynamic.reshape(b, length // block, block, self.taps, self.groups, 1)
        base = self.base_kernel[side].to(x.dtype).view(self.taps, self.groups, self.group_size)
        out = torch.zeros_like(rows)
        for j in range(min(self.taps, block)):
            # row t takes row t - j of its own block; the first j rows of every block take zeros
            shifted = rows if j == 0 else F.pad(rows[:, :, :-j], (0, 0, 0, 0, j, 0))
            out = out + (base[j] + coef[:, :, :, j]) * shifted
        return out.reshape(b, length, h)

    def prepare(self, x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input and the output side's coefficients (both from the same rows)."""
        dynamic = self.coefficients(x)
        return self.convolve(x, dynamic[..., 0, :, :], 0, block), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor, block: int | None = None) -> torch.Tensor:
        return self.convolve(y, dynamic, 1, block)


@dataclass
class SelectorPath:
    """What `CandidateSelector.select` chose for each draft slot (B rows, n slots, K candidates)."""

    tokens: torch.Tensor  # [B, n] the chosen path
    candidates: torch.Tensor  # [B, n, K] top-K of the slot's logits, highest first
    unary: torch.Tensor  # [B, n, K] their logits
    scores: torch.Tensor  # [B, n, K] unary + pairwise score given the path's previous token


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: per draft slot the top-K tokens of the target head's logits are rescored
    with <predecessor_codebook[previous token] * hidden_projection(hidden), successor_codebook[candidate]>
    and the best one is taken, left to right from the block's bonus token (greedy path).

    The codebooks are bare Parameters (checkpoint keys `candidate_selector.{predecessor,successor}_codebook`,
    no `.weight`, as vLLM reads them); `hidden_projection` is a Linear.
    """

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        rank = int(config.selector_rank)
        self.top_k = int(config.selector_top_k)
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def pairwise(self, projected: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """projected [..., rank], previous [...] ids, candidates [..., K] ids -> pairwise scores [..., K]."""
        context = self.predecessor_codebook[previous] * projected.to(self.predecessor_codebook.dtype)
        return (self.successor_codebook[candidates] * context.unsqueeze(-2)).sum(-1)

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> SelectorPath:
        """hidden [B, n, H] and logits [B, n, V] of the draft slots, anchor_ids [B] (the bonus tokens)."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        projected = self.hidden_projection(hidden)
        previous, tokens, scores = anchor_ids, [], []
        for slot in range(hidden.shape[1]):
            score = unary[:, slot] + self.pairwise(projected[:, slot], previous, candidates[:, slot]).to(unary.dtype)
            previous = candidates[:, slot].gather(-1, score.argmax(-1, keepdim=True))[:, 0]
            tokens.append(previous)
            scores.append(score)
        return SelectorPath(torch.stack(tokens, 1), candidates, unary, torch.stack(scores, 1))
