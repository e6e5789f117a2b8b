"""Drafter check: reload the written checkpoint, dequantize it, compare with the bf16 drafter.

`served` runs the quantized drafter with compressed-tensors' emulation enabled (NVFP4 W4A4
activations quantized per 16 values with the stored input_global_scale), the numerics vLLM
serves; `weights_only` disables activation quantization. Rows are the draft slots (1..block-1)
of held-apart anchored blocks where the loss mask is 1. `agreement_length` is tau measured against
the bf16 drafter instead of the target: 1 + the leading run of draft slots whose argmax matches.

A DFlash2 drafter with a candidate selector drafts the selector's greedy path, not the head's argmax, so its
top-1 agreement, agreement length and match bits compare the tokens each drafter's selector chooses
(`DFlashDrafter.select_blocks`: the quantized drafter's hidden states and logits through its own dense
selector) with the bf16 drafter's; KL stays on the head's logits.
"""

from __future__ import annotations

import torch

from pipeline.artifacts import check_report
from pipeline.quant import act_scale, act_scale_report, cache_batches, checks, paired, recipes


def _rows_mask(batch: dict, block_size: int) -> torch.Tensor:
    from pipeline.models.calibration import aligned_loss_mask

    return aligned_loss_mask(batch["loss_mask"][0], batch["anchor_positions"][0], batch["anchor_valid"][0],
                             block_size)


class _Agreement:
    """Running KL sum and top-1 matches, so no vocabulary-wide logits are kept across batches."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kl, self.top1, self.rows = 0.0, 0, 0
        self.run_sum, self.blocks = 0.0, 0.0
        # per row, in order: does the argmax match bf16's (for paired comparisons of two variants on the
        # same held-apart rows), and bf16's own argmax (to check that two reports share those rows)
        self.matches: list[torch.Tensor] = []
        self.ref_ids: list[torch.Tensor] = []

    def add(self, ref: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor,
            ref_selected: torch.Tensor | None = None, selected: torch.Tensor | None = None) -> None:
        """Logits [1, rows, V]; with `ref_selected` / `selected` (DFlash2's selector path per row, [1, rows]) the
        top-1 numbers compare those tokens instead of the argmax."""
        from pipeline.models.calibration import block_metrics

        m = mask.reshape(-1) > 0
        v = ref.shape[-1]
        r, q = ref.reshape(-1, v)[m].float(), logits.reshape(-1, v)[m].float()
        if ref_selected is None:
            # leading run of draft slots that match the bf16 drafter's argmax, +1 (tau against bf16)
            blocks = block_metrics(logits, ref, mask.float(), self.block_size)
            self.run_sum += blocks["eal_sum"]
            self.blocks += blocks["eal_total"]
            ref_ids, match = r.argmax(-1), r.argmax(-1) == q.argmax(-1)
        else:
            self._add_runs(ref_selected.reshape(-1) == selected.reshape(-1), mask)
            ref_ids = ref_selected.reshape(-1)[m]
            match = ref_ids == selected.reshape(-1)[m]
        logp = torch.log_softmax(r, -1)
        self.kl += float((logp.exp() * (logp - torch.log_softmax(q, -1))).sum())
        self.top1 += int(match.sum())
        self.rows += int(m.sum())
        self.matches.append(match.cpu())
        self.ref_ids.append(ref_ids.to(torch.int64).cpu())

    def _add_runs(self, correct: torch.Tensor, mask: torch.Tensor) -> None:
        """`block_metrics`' agreement length over per-row matches: 1 + the leading run of matching draft slots
        of every block with at least one counted slot."""
        m = mask.reshape(-1, self.block_size) > 0
        good = (correct.reshape(-1, self.block_size) & m)[:, 1:].long()
        has = m[:, 1:].any(1)
        self.run_sum += float((1 + torch.cumprod(good, dim=1).sum(1))[has].sum())
        self.blocks += float(has.sum())

    def result(self) -> dict:
        n = self.rows
        return {"kl": self.kl / n if n else float("nan"), "top1_agreement": self.top1 / n if n else float("nan"),
                "rows": n, "agreement_length": self.run_sum / self.blocks if self.blocks else float("nan"),
                "blocks": int(self.blocks), "top1_match_bits": paired.pack_bits(self.matches),
                "reference_top1_sha256": paired.ids_sha256(self.ref_ids)}


@torch.no_grad()
def compare(reference, quantized, batches, block_size: int, band_factors=(), observers=()) -> dict[str, dict]:
    """KL(bf16 || quantized) and top-1 agreement, served (W4A4 emulated) and weights-only, plus the
    rounding band: served again with every activation global scale times each of `band_factors`.
    `observers` (`attach() -> hook handles`) watch the bf16 drafter's one forward per batch, so the
    per-layer checks read its layers' inputs without a forward of their own.

    Within the range the data occupies, multiplying a global scale by a non-power-of-two factor
    changes nothing but how the FP8 block scales round, so the band's spread is the rounding lottery
    any choice of scales draws from: the yardstick for calling two calibrations different (see
    pipeline/stages/evaluate.py calibration_comparison). Where the data exceeds a scale's range (massive
    activations under the fixed scale) the factors also move the clip point, so the band is then
    wider than rounding alone: a conservative yardstick. The bf16 logits of each batch serve every pass.
    """
    from compressed_tensors.quantization import disable_quantization, enable_quantization
    from tqdm import tqdm

    device = next(reference.parameters()).device
    modules = act_scale.activation_quantized(quantized)
    factors = [float(f) for f in band_factors or []] if modules else []
    kept = {n: m.input_global_scale.detach().clone() for n, m in modules.items()}
    served, weights_only = _Agreement(block_size), _Agreement(block_size)
    band = [_Agreement(block_size) for _ in factors]
    handles = [h for o in observers for h in o.attach()]
    try:
        for batch in tqdm(batches, desc="held-apart checks", unit="sample"):
            mask = _rows_mask(batch, block_size).to(device)
            batch = {k: v.to(device) for k, v in batch.items()}
            # the only forward of `reference`: what the observers see (select: DFlash2's selector path as well)
            ref = reference(**batch, select=True)
            _add(served, ref, quantized(**batch, select=True), mask)
            for f, agree in zip(factors, band):
                _set_scales(modules, kept, f)
                _add(agree, ref, quantized(**batch, select=True), mask)
            _set_scales(modules, kept, 1.0)
            quantized.apply(disable_quantization)
            try:
                _add(weights_only, ref, quantized(**batch, select=True), mask)
            finally:
                quantized.apply(enable_quantization)
    finally:
        for h in handles:
            h.remove()
        _set_scales(modules, kept, 1.0)
    out = {"served": served.result(), "weights_only": weights_only.result()}
    if band and served.rows:
        top1 = [a.result()["top1_agreement"] for a in band]
        out["served_rounding_band"] = {"factors": factors, "top1_agreement": top1,
                                       "agreement_length": [a.result()["agreement_length"] for a in band],
                                       "top1_min": min(top1), "top1_max": max(top1)}
    return out


def _add(agreement: _Agreement, ref, out, mask: torch.Tensor) -> None:
    """One batch of the two drafters' outputs: their logits, and both selector paths where the drafters have a
    candidate selector (DFlash2)."""
    ref_selected = getattr(ref, "selected", None)
    if ref_selected is None:
        agreement.add(ref.logits, out.logits, mask)
    else:
        agreement.add(ref.logits, out.logits, mask, ref_selected, out.selected)


def _set_scales(modules: dict, kept: dict, factor: float) -> None:
    for n, m in modules.items():
        m.input_global_scale.data.copy_(kept[n] * factor)


class LayerOutputErrors:
    """Per quantized Linear, on the held-apart batches: ||x W_q^T - x W^T|| / ||x W^T||, x = the layer's real
    input in the bf16 drafter's forward (for `fc`, the target's concatenated hidden states). This is the
    error GPTQ minimizes on its calibration inputs, measured on rows it never saw; weights only (the
    activation-QDQ error is `act_scale_report.HeldoutErrors`'). An observer for `compare`."""

    def __init__(self, reference, quantized):
        self.qmods = checks.quantized_modules(quantized)
        self.ref_mods = dict(reference.named_modules())
        self.num = {n: 0.0 for n in self.qmods}
        self.den = {n: 0.0 for n in self.qmods}

    def _hook(self, name):
        def fn(module, args, output):
            x = args[0].float()
            w_q = self.qmods[name].weight.float()
            y = output.float()
            err = torch.nn.functional.linear(x, w_q, None if module.bias is None else module.bias.float()) - y
            self.num[name] += float(err.pow(2).sum())
            self.den[name] += float(y.pow(2).sum())
        return fn

    def attach(self) -> list:
        return [self.ref_mods[n].register_forward_hook(self._hook(n)) for n in self.qmods]

    def result(self) -> dict[str, float]:
        return {n: (self.num[n] / self.den[n]) ** 0.5 if self.den[n] else float("nan") for n in self.qmods}


def activation_error_report(heldout: dict | None, search: dict | None) -> dict:
    """Per-layer activation-QDQ error: the search's calibration-data record and, on the held-apart
    batches (`heldout`: `act_scale_report.HeldoutErrors.result()`), the checkpoint's scale against the
    calibration-free fixed one."""
    if not heldout:
        return {}
    out = {"activation_error_heldout": heldout,
           "activation_error_summary": {"heldout": act_scale_report.summarize(heldout, ("calibrated", "fixed"))}}
    if search is not None:
        out["activation_scale_search"] = search
        out["activation_error_summary"]["calibration"] = act_scale_report.summarize(
            search["layers"], ("minmax", "fixed", "chosen"))
    return out


def check_drafter(cfg, rd, q, reader, held_idx: list[int], dconf, search: dict | None = None,
                  verifier: cache_batches.ShardVerifier | None = None) -> check_report.DrafterCheck:
    import copy

    from pipeline.models.formats import load_drafter

    ref_dir, out = rd.drafter("bf16"), rd.drafter(q.name)
    device = recipes.resolve_device(q.device)
    reference = load_drafter(ref_dir, target=cfg.target.path, dtype=torch.float32, device=device)
    dense = copy.deepcopy(reference)  # the same weights, read once
    quantized = checks.load_dequantized(dense, out)
    errors = checks.weight_errors(quantized, reference)
    held = cache_batches.Prefetched(
        cache_batches.drafter_batches(reader, held_idx, int(q.anchors_per_sequence), dconf.block_size,
                                      int(dconf.mask_token_id), int(q.max_seq_len),
                                      int(cfg.seed) + cache_batches.HELDOUT_SEED_OFFSET),
        next(reference.parameters()).device, verifier)
    try:
        return _check(cfg, rd, q, reader, held_idx, reference, quantized, errors, held, dconf, search, out)
    finally:
        held.close()


def _check(cfg, rd, q, reader, held_idx, reference, quantized, errors, held, dconf, search,
           out) -> check_report.DrafterCheck:
    # one pass over the held-apart batches: the agreement metrics, and the per-layer errors read off the
    # bf16 drafter's forward by the observers
    # (a weight-only checkpoint has no activation-quantized layer: act_obs then hooks none, reports {})
    out_obs = LayerOutputErrors(reference, quantized)
    act_obs = act_scale_report.HeldoutErrors(reference, quantized,
                                             act_scale.fixed_input_global_scale(float(q.fixed_activation_amax)))
    metrics = compare(reference, quantized, held, dconf.block_size, q.rounding_band_factors,
                      [act_obs, out_obs]) if len(held) else {}
    act = activation_error_report(act_obs.result() if len(held) else None, search)
    out_err = out_obs.result() if len(held) else {}
    # paths relative to the run directory, so the report is byte-identical wherever the run lives
    served, weights_only, band = (metrics.get(k) for k in ("served", "weights_only", "served_rounding_band"))
    report = check_report.DrafterCheck(
        kind="drafter", variant=q.name, checkpoint=f"drafter/{q.name}", reference="drafter/bf16", scheme=q.scheme,
        observer=q.observer, calibration=q.calibration, reloaded=True, heldout_samples=len(held_idx),
        heldout_anchors=cache_batches.count_anchors(held),
        heldout_sample_ids=[reader.index["samples"][i]["id"] for i in held_idx],
        weight_error=errors, weight_error_summary=checks.summarize(errors),
        layer_output_error_heldout=out_err, layer_output_error_summary=checks.summarize(out_err),
        served=check_report.Agreement(**served) if served else None,
        weights_only=check_report.Agreement(**weights_only) if weights_only else None,
        served_rounding_band=check_report.RoundingBand(**band) if band else None,
        activation_error_heldout=act.get("activation_error_heldout"),
        activation_error_summary=act.get("activation_error_summary"),
        activation_scale_search=act.get("activation_scale_search"))
    checks.write_report(rd.checks, report)
    if act:
        act_scale_report.plot(search, act["activation_error_heldout"],
                              f"drafter {q.name}: per-layer activation-QDQ error vs the calibration-free scale",
                              rd.checks / f"drafter-{q.name}-activation-error.png")
    return report
