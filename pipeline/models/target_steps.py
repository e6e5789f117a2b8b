"""The target's side of a greedy speculative decode, with its forwards reused across drafters.

A speculative decode feeds the target the prompt (prefill), then one block per step; what the target returns
(the argmax tokens, the aux hidden states of the kept rows) and the K/V rows it keeps depend only on the prompt
and the blocks fed so far. Drafter variants of one drafter mostly draft the same blocks, so evaluate runs the
same target forwards again and again. `StepMemo` keeps, per prompt, a tree of the blocks fed: each node holds the
forward's outputs and the K/V rows it kept. A decode that feeds a block the tree already has takes the node's
outputs instead of running the forward; when it feeds a new block, its cache is rebuilt from the rows along its
path (the same values the forwards wrote, concatenated) and the forward runs. Every token, tau and hidden state is
therefore exactly what a decode without the memo computes: the memo only skips forwards whose result it holds.

Only caches that are rows per token can be rebuilt this way (`DecodeCache.reusable`); a hybrid target's
recurrent states are not, so its decodes run every forward. The memo stops growing at `max_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def aux_hidden(hidden_states: tuple[torch.Tensor, ...], aux_layer_ids: list[int]) -> torch.Tensor:
    """Concatenate HF hidden_states[m] for m in aux_layer_ids along features -> [B, S, n_aux*H]."""
    return torch.cat([hidden_states[m] for m in aux_layer_ids], dim=-1)


def target_step(target, ids: torch.Tensor, cache, want_hidden: bool):
    out = target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=want_hidden)
    return out.logits, out.hidden_states


@dataclass(eq=False)
class _Node:
    """One forward of a path: its outputs (`posterior`: the argmax per fed row, `acc`: accepted drafts, `ctx`: the
    aux hidden states of the kept rows) and the K/V rows it kept, per layer."""
    parent: _Node | None
    posterior: torch.Tensor
    acc: int
    ctx: torch.Tensor
    rows: list[tuple[torch.Tensor, torch.Tensor]]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)

    def path(self) -> list[_Node]:
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class StepMemo:
    """Target forwards of earlier decodes with one target, per prompt (see the module doc). `run` / `reused`
    count the forwards run and taken from the memo."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.run = 0
        self.reused = 0
        self._roots: dict[tuple[int, ...], _Node] = {}

    def counts(self) -> dict[str, int]:
        return {"run": self.run, "reused": self.reused}

    def _add(self, parent: _Node | None, key: tuple[int, ...], node: _Node) -> bool:
        size = node.ctx.numel() * node.ctx.element_size() + sum(t.numel() * t.element_size()
                                                                for kv in node.rows for t in kv)
        if self.bytes + size > self.max_bytes:
            return False
        self.bytes += size
        (self._roots if parent is None else parent.children)[key] = node
        return True


class TargetSteps:
    """The target's forwards for one decode: `prefill(prompt)`, then `verify(block, draft)` per step; each
    is taken from `memo` when it holds it (and the target's cache can be rebuilt from rows), else run here."""

    def __init__(self, target, decode_state, aux_ids: list[int], memo: StepMemo | None = None) -> None:
        self.target, self.state, self.aux_ids = target, decode_state, list(aux_ids)
        self.memo = memo if memo is not None and getattr(decode_state, "reusable", False) else None
        self.node: _Node | None = None  # the memo node this decode stands at
        self.live: _Node | None = None  # the node the target's cache holds (None: empty, or not a memo node)

    def prefill(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        """(the target's first token, the aux hidden states of the prompt rows)."""
        key = tuple(prompt)
        if self.memo is not None and (root := self.memo._roots.get(key)) is not None:
            self.memo.reused += 1
            self.node = root
            return int(root.posterior), root.ctx
        logits, hs = target_step(self.target, torch.tensor([list(prompt)], device=self.target.device),
                                 self.state.cache, True)
        first, ctx = logits[0, -1].argmax(), aux_hidden(hs, self.aux_ids)
        self._remember(None, key, first, 0, ctx, len(prompt))
        return int(first), ctx

    def verify(self, block: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The target on `block` [1, B] (its first token, then `draft`): (argmax per row, accepted drafts, aux
        hidden states of the kept rows); its cache keeps the block's first token and the accepted draft."""
        key = tuple(block[0].tolist()) if self.memo is not None else ()  # no host copy of the block without a memo
        if self.memo is not None and (child := self.node.children.get(key)) is not None:
            self.memo.reused += 1
            self.node = child
            return child.posterior, child.acc, child.ctx
        if self.memo is not None and self.live is not self.node:
            self._rebuild()
        self.state.checkpoint()
        tlogits, hs = target_step(self.target, block, self.state.cache, True)
        posterior = tlogits[0].argmax(-1)
        acc = int(torch.cumprod((draft == posterior[:-1]).long(), 0).sum())
        self.state.keep(acc + 1, block, self.target)  # the block's first token and the accepted draft stay
        ctx = aux_hidden(hs, self.aux_ids)[:, : acc + 1]
        self._remember(self.node, key, posterior, acc, ctx, acc + 1)
        return posterior, acc, ctx

    def _remember(self, parent: _Node | None, key: tuple[int, ...], posterior, acc: int, ctx, kept: int) -> None:
        if self.memo is None:
            return
        self.memo.run += 1
        node = _Node(parent, posterior, acc, ctx.clone(), self.state.tail(kept))
        if self.memo._add(parent, key, node):
            self.node = self.live = node
        else:  # the memo is full: this decode goes on without it (its cache is the one just computed)
            self.memo = None

    def _rebuild(self) -> None:
        """The target's cache as it stood at `self.node`: each layer's rows along the path, concatenated."""
        path = self.node.path()
        layers = [(torch.cat([n.rows[i][0] for n in path], dim=-2), torch.cat([n.rows[i][1] for n in path], dim=-2))
                  for i in range(len(path[0].rows))]
        self.state.load_rows(layers)
        self.live = self.node
