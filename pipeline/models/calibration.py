"""Anchored-block batches for the drafter's calibration/training forward, and their losses.

A batch packs cached samples (from `pipeline.stages.cache.CacheReader`) into one sequence with
per-document positions, and draws anchors with a seeded `torch.Generator` where the loss mask
is 1 and a whole block fits in the document. Each anchor j becomes a block
`[input_ids[a_j], <mask> x (block_size-1)]` that sees the base rows of its own document before
a_j plus its own block (bidirectionally) - the same view the drafter has when serving.
Unused anchor slots are padded like speculators pads them: position 0, `anchor_valid=False`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from pipeline.core.errors import bad_value

BATCH_KEYS = ("input_ids", "hidden_states", "position_ids", "document_ids", "loss_mask",
              "anchor_positions", "anchor_valid")


def block_layout(input_ids: torch.Tensor, position_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids and positions [A*block_size] for 1-D input_ids/position_ids and anchors [A]."""
    offsets = torch.arange(block_size, device=anchors.device)
    ids = torch.full((anchors.numel(), block_size), int(mask_token_id), dtype=input_ids.dtype,
                     device=input_ids.device)
    ids[:, 0] = input_ids[anchors]
    pos = position_ids[anchors][:, None] + offsets[None]
    return ids.reshape(-1), pos.reshape(-1)


def block_attention_mask(document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [A*bs, T + A*bs] (True = may attend): same-document base rows before the anchor + own block."""
    t = document_ids.numel()
    a = anchors.numel()
    base_doc = document_ids[None, :]  # [1, T]
    anchor_doc = document_ids[anchors][:, None]  # [A, 1]
    rows = torch.arange(t, device=anchors.device)[None, :]
    base = (base_doc == anchor_doc) & (anchor_doc != -1) & (rows < anchors[:, None])  # [A, T]
    own = torch.eye(a, dtype=torch.bool, device=anchors.device)  # [A, A] block-diagonal
    blocks = own.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return torch.cat([base.repeat_interleave(block_size, 0), blocks], dim=1)


def anchored_indices(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    return (anchors[:, None] + torch.arange(block_size, device=anchors.device)[None]).reshape(-1)


def aligned_loss_mask(loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """[A*bs] float: loss_mask at a_j+k for valid anchors, slot 0 (the bonus token) always 0."""
    t = loss_mask.numel()
    idx = anchored_indices(anchors, block_size)
    m = loss_mask.reshape(-1)[idx.clamp(max=t - 1)].float() * (idx < t).float()
    m = m.view(-1, block_size) * anchor_valid.reshape(-1, 1).float()
    m[:, 0] = 0
    return m.reshape(-1)


def block_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Hard labels [A*bs]: slot k of block j predicts input_ids[a_j + k] (clamped at the end)."""
    ids = input_ids.reshape(-1)
    return ids[anchored_indices(anchors, block_size).clamp(max=ids.numel() - 1)]


def verifier_targets(verifier_last_hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                     anchors: torch.Tensor, block_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Target logits for each block row: lm_head(norm(h[(i-1) mod T])) with i = a_j + k."""
    h = verifier_last_hidden.reshape(-1, verifier_last_hidden.shape[-1]).float()
    t = h.shape[0]
    src = (anchored_indices(anchors, block_size) - 1) % t
    x = h[src]
    x = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return x @ lm_head_weight.T


def _doc_spans(samples: list[dict]) -> list[tuple[int, int]]:
    spans, start = [], 0
    for s in samples:
        spans.append((start, start + int(s["input_ids"].numel())))
        start = spans[-1][1]
    return spans


def candidate_anchors(loss_mask: torch.Tensor, spans: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """Positions with loss_mask==1 whose whole block lies inside their document."""
    ok = torch.zeros(loss_mask.numel(), dtype=torch.bool)
    for start, end in spans:
        last = end - block_size  # a + block_size <= end
        if last >= start:
            ok[start:last + 1] = loss_mask[start:last + 1] == 1
    return ok.nonzero().reshape(-1)


def build_calibration_batch(samples: list[dict], anchors_per_sequence: int, block_size: int, mask_token_id: int,
                            generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Pack `samples` into one sequence and draw anchors; tensors carry a leading batch dim of 1.

    samples: dicts with `input_ids` [T], `loss_mask` [T], `hidden_states` [T, n_aux, H] (the
    cache reader's items). Anchors are drawn without replacement, then sorted; unused slots up to
    `anchors_per_sequence` are padding anchors (position 0, invalid).
    """
    if block_size < 2:
        raise bad_value("block_size", block_size, "a DFlash block needs the bonus token plus at least one mask",
                        "use block_size >= 2")
    if anchors_per_sequence < 1:
        raise bad_value("anchors_per_sequence", anchors_per_sequence, "at least one anchor is needed",
                        "use a positive number")
    input_ids = torch.cat([s["input_ids"].reshape(-1).long() for s in samples])
    loss_mask = torch.cat([s["loss_mask"].reshape(-1).long() for s in samples])
    hidden = torch.cat([s["hidden_states"] for s in samples])
    spans = _doc_spans(samples)
    position_ids = torch.cat([torch.arange(e - s) for s, e in spans])
    document_ids = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(spans)])
    cand = candidate_anchors(loss_mask, spans, block_size)
    n = min(anchors_per_sequence, cand.numel())
    picked = cand[torch.randperm(cand.numel(), generator=generator)[:n]].sort().values
    anchors = torch.zeros(anchors_per_sequence, dtype=torch.long)
    valid = torch.zeros(anchors_per_sequence, dtype=torch.bool)
    anchors[:n], valid[:n] = picked, True
    batch = {"input_ids": input_ids, "hidden_states": hidden, "position_ids": position_ids,
             "document_ids": document_ids, "loss_mask": loss_mask, "anchor_positions": anchors,
             "anchor_valid": valid}
    return {k: v[None] for k, v in batch.items()}


# ---- losses and metrics (speculators' eager definitions, checked by fixture B) ----

def _per_row_kl(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(targets.float(), -1)
    return (logp.exp() * (logp - F.log_softmax(logits.float(), -1))).sum(-1)


def kl_fixed_exp_loss(logits, targets, mask, block_size: int, gamma: float = 4.0) -> torch.Tensor:
    """KL(p_target || q_drafter) per row, weight exp(-(k-1)/gamma) for slots k>=1, 0 for slot 0."""
    k = torch.arange(mask.numel(), device=mask.device) % block_size
    w = torch.where(k == 0, torch.zeros_like(mask), torch.exp(-(k - 1).clamp(min=0).float() / gamma))
    kl = _per_row_kl(logits.reshape(mask.numel(), -1), targets.reshape(mask.numel(), -1))
    return (kl * mask * w).sum() / (mask.sum() + 1e-5)


def ce_dpace_loss(logits, targets, mask, block_size: int, alpha: float = 0.5) -> torch.Tensor:
    """CE on argmax(targets), weighted by the expected-acceptance suffix sums (dpace)."""
    v = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, v).float(), targets.reshape(-1, v).argmax(-1), reduction="none")
    m = mask.view(-1, block_size)
    ce_b = ce.view(-1, block_size)
    qc = torch.exp(-ce_b * m)
    s = torch.where(m > 0, alpha * qc + (1 - alpha), torch.ones_like(qc))
    prefix = torch.cumprod(s, dim=1)
    suffix = (prefix * m).flip(1).cumsum(1).flip(1)
    w = (m * suffix).detach()
    return (ce_b * m * w).sum() / (m.sum() + 1e-5)


def block_metrics(logits, targets, mask, block_size: int) -> dict[str, float]:
    """Per-position accuracy counts and expected acceptance length (eal) over blocks."""
    v = logits.shape[-1]
    correct = (logits.reshape(-1, v).argmax(-1) == targets.reshape(-1, v).argmax(-1)).view(-1, block_size)
    m = mask.view(-1, block_size) > 0
    out: dict[str, float] = {}
    for k in range(1, block_size):
        out[f"position_{k}_acc_sum"] = float((correct[:, k] & m[:, k]).sum())
        out[f"position_{k}_acc_total"] = float(m[:, k].sum())
    out["full_acc_sum"] = float((correct & m)[:, 1:].sum())
    out["full_acc_total"] = float(m[:, 1:].sum())
    good = (correct & m)[:, 1:].long()
    run = torch.cumprod(good, dim=1).sum(1)
    has = m[:, 1:].any(1)
    out["eal_sum"] = float((1 + run)[has].sum())
    out["eal_total"] = float(has.sum())
    return out


@contextlib.contextmanager
def skip_logits(model):
    """Calibration forwards that read only the inputs of the drafter's Linear layers skip its output head.

    The head (the target's lm_head, vocab x hidden, never quantized: pipeline.quant.recipes.ALWAYS_IGNORE)
    is about a third of the drafter's forward at Qwen3-8B shape (151,936 x 4,096 per block row) and its
    logits are never read by oneshot's observers, GPTQ's Hessians, the scale search or the layer-error
    check; it returns an empty [..., 0] tensor instead, and every quantized layer sees the same inputs."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or getattr(head, "quantization_scheme", None) is not None:
        yield
        return
    head.forward = lambda x: x.new_empty((*x.shape[:-1], 0))  # shadows nn.Linear.forward on this instance
    try:
        yield
    finally:
        del head.forward
