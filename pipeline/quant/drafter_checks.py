"""Drafter check: reload the written checkpoint, dequantize it, compare with the bf16 drafter.

`served` runs the quantized drafter with compressed-tensors' emulation enabled (NVFP4 W4A4
activations quantized per 16 values with the stored input_global_scale), the numerics vLLM
serves; `weights_only` disables activation quantization. Rows are the draft slots (1..block-1)
of held-apart anchored blocks where the loss mask is 1.
"""

from __future__ import annotations

import torch

from pipeline.quant import cache_batches, checks

HELD_ANCHORS_MIN = 1


@torch.no_grad()
def _logits(model, batches: list[dict]) -> list[torch.Tensor]:
    return [model(**b).logits.float() for b in batches]


def _rows_mask(batch: dict, block_size: int) -> torch.Tensor:
    from pipeline.models.calibration import aligned_loss_mask

    return aligned_loss_mask(batch["loss_mask"][0], batch["anchor_positions"][0], batch["anchor_valid"][0],
                             block_size)


def compare(reference, quantized, batches: list[dict], block_size: int) -> dict[str, dict]:
    """KL(bf16 || quantized) and top-1 agreement, served (W4A4 emulated) and weights-only."""
    from compressed_tensors.quantization import disable_quantization, enable_quantization

    ref = torch.cat([x.reshape(-1, x.shape[-1]) for x in _logits(reference, batches)])
    mask = torch.cat([_rows_mask(b, block_size) for b in batches])
    served = torch.cat([x.reshape(-1, x.shape[-1]) for x in _logits(quantized, batches)])
    quantized.apply(disable_quantization)
    try:
        weights_only = torch.cat([x.reshape(-1, x.shape[-1]) for x in _logits(quantized, batches)])
    finally:
        quantized.apply(enable_quantization)
    return {"served": checks.logits_agreement(ref, served, mask),
            "weights_only": checks.logits_agreement(ref, weights_only, mask)}


def check_drafter(cfg, rd, q, reader, held_idx: list[int], dconf) -> dict:
    from pipeline.models.formats import load_drafter

    ref_dir, out = rd.drafter("bf16"), rd.drafter(q.name)
    reference = load_drafter(ref_dir, target=cfg.target.path, dtype=torch.float32)
    quantized = checks.load_dequantized(load_drafter(ref_dir, target=cfg.target.path, dtype=torch.float32), out)
    errors = checks.weight_errors(quantized, reference)
    held = cache_batches.drafter_batches(reader, held_idx, int(q.anchors_per_sequence), dconf.block_size,
                                         int(dconf.mask_token_id), int(q.max_seq_len),
                                         int(cfg.seed) + cache_batches.HELDOUT_SEED_OFFSET)
    metrics = compare(reference, quantized, held, dconf.block_size) if held else {}
    report = {"kind": "drafter", "variant": q.name, "checkpoint": str(out), "reference": str(ref_dir),
              "scheme": q.scheme, "observer": q.observer, "calibration": q.calibration, "reloaded": True,
              "heldout_samples": len(held_idx), "heldout_anchors": cache_batches.count_anchors(held),
              "weight_error": errors, "weight_error_summary": checks.summarize(errors), **metrics}
    checks.write_report(rd.checks, "drafter", q.name, report)
    return report
