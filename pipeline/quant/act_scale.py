"""Calibrated NVFP4 activation global scales: a per-layer search that can only beat the fixed scale.

NVFP4 activations are local-dynamic: every 16 values get an FP8-E4M3 block scale computed at run
time, relative to the per-tensor `input_global_scale`. That global scale only matters through the
FP8 rounding of block scales, their subnormals (small blocks) and their saturation at 448 (clipped
blocks). llm-compressor's static_minmax sets it to 448*6 / absmax of the calibration data, which
leaves no headroom for outliers the calibration set did not see and otherwise differs from the
calibration-free fixed scale (1.0 = absmax 2688) by noise.

`activation_scale: mse` therefore re-runs the calibration batches once more after oneshot, with
quantization disabled (the inputs each Linear saw while its observer ran: llm-compressor's basic
and sequential pipelines calibrate under DisableQuantization), and for every activation-quantized
Linear accumulates, per candidate global scale g, the layer-output error of activation QDQ:

    E(g) = sum over rows of || (Q_g(x) - x) W^T ||^2      (W = the layer's dense weight)

with Q_g exactly compressed-tensors' run-time QDQ (compute_dynamic_scales_and_zp + fake_quantize
with the module's input_activations args). The candidates always include the calibration-free
fixed scale and the minmax scale, so on the calibration data the chosen scale is never worse than
either: per layer, or for layers vLLM fuses (q/k/v, gate/up: one scale per fused Linear) on the sum
of the group's errors. Ties go to the fixed scale, then minmax, then the grid order. Activations
are streamed in row chunks; nothing is kept across batches but one float64 sum per candidate.
"""

from __future__ import annotations

import contextlib
import math

import torch

from pipeline.core.errors import bad_value

METHODS = ("minmax", "mse")
CHUNK_ELEMENTS = 1 << 25  # activation values quantized at once (128 MiB in fp32), whatever the width
# activation values x candidates quantized in one call (a chunk's QDQ for several global scales at once):
# 512 MiB of fp32 per intermediate on a GPU (~2.5 GiB transient at the widest layer), 128 MiB on the host
CANDIDATE_ELEMENTS = {"cuda": 1 << 27}
CANDIDATE_ELEMENTS_DEFAULT = 1 << 25


def validate_settings(q, field: str) -> None:
    """activation_scale and its multipliers; checked with the other settings, before any weights load."""
    method = q.activation_scale
    if method not in METHODS:
        raise bad_value(f"{field}.activation_scale", method, "it is not a known activation-scale method",
                        f"use one of {', '.join(METHODS)}")
    mults = list(q.activation_scale_multipliers or [])
    if method == "mse" and not mults:
        raise bad_value(f"{field}.activation_scale_multipliers", mults, "the mse search needs candidate multipliers",
                        "give a list of positive multipliers of the minmax scale, e.g. [0.25, 0.5, 1.0, 2.0, 4.0]")
    bad = [m for m in mults if not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0]
    if bad:
        raise bad_value(f"{field}.activation_scale_multipliers", mults, f"{bad[0]} is not a positive finite number",
                        "use positive multipliers of the minmax scale, e.g. [0.25, 0.5, 1.0, 2.0, 4.0]")
    band = list(q.rounding_band_factors or [])
    off = [f for f in band if not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0
           or math.log2(f) == round(math.log2(f))]
    if off:
        raise bad_value(f"{field}.rounding_band_factors", band, f"{off[0]} is not a positive non-power-of-two factor "
                        "(inside the data's range a power of two only shifts FP8 exponents and rounds as 1.0 does)",
                        "use factors such as [0.794, 0.891, 1.122, 1.26], or [] to skip the band")
    n = q.activation_scale_samples
    if not isinstance(n, int) or n < 0:
        raise bad_value(f"{field}.activation_scale_samples", n, "it must be a whole number >= 0",
                        "use e.g. 64 (the first 64 calibration samples) or 0 for all of them")
    amax = float(q.fixed_activation_amax)
    if not math.isfinite(amax) or amax <= 0:
        raise bad_value(f"{field}.fixed_activation_amax", q.fixed_activation_amax, "an absmax must be positive",
                        "use 2688.0 (input_global_scale 1.0, the calibration-free value)")


def fixed_input_global_scale(amax: float) -> float:
    """The calibration-free activation global scale for a fixed absmax (what static_minmax would give):
    the largest FP8-E4M3 block scale (448) times the largest E2M1 magnitude (6) over the absmax."""
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA, FP8_E4M3_DATA

    return FP8_E4M3_DATA.max * FP4_E2M1_DATA.max / float(amax)


def _f32(x: float) -> float:
    """The value as the float32 that input_global_scale will hold."""
    return float(torch.tensor(x, dtype=torch.float32))


def candidates(minmax: float, fixed: float, multipliers) -> list[tuple[str, float]]:
    """(label, global scale): fixed first, then minmax (both always, even when equal), then minmax *
    each multiplier where that gives a new value."""
    out = [("fixed", _f32(fixed)), ("minmax", _f32(minmax))]
    seen = {v for _, v in out}
    for m in multipliers:
        v = _f32(minmax * float(m))
        if v not in seen and v > 0 and math.isfinite(v):
            seen.add(v)
            out.append((f"minmax*{float(m):g}", v))
    return out


def qdq(x: torch.Tensor, args, global_scale: torch.Tensor, module=None) -> torch.Tensor:
    """compressed-tensors' run-time NVFP4 activation quantize-dequantize at a given global scale
    (the two calls forward_quantize makes for dynamic='local' inputs)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=module, global_scale=global_scale)
    return fake_quantize(x, scale, zp, args, global_scale=global_scale)


def qdq_many(x: torch.Tensor, args, global_scales: torch.Tensor) -> torch.Tensor:
    """`qdq` of one tensor at several global scales in one call: [C, *x.shape] for C scales.

    The same compressed-tensors calls on x broadcast over a leading candidate dimension; every step of
    NVFP4 QDQ is elementwise or a max over a 16-value group, so row c equals `qdq(x, args, scale c)` bit
    for bit, with C times fewer kernel launches."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    c = global_scales.numel()
    xs = x.unsqueeze(0).expand(c, *x.shape)
    g = global_scales.reshape(c, *([1] * x.dim()))  # against the [C, rows, groups] block scales
    scale, zp = compute_dynamic_scales_and_zp(value=xs, args=args, module=None, global_scale=g)
    return fake_quantize(xs, scale, zp, args, global_scale=g.unsqueeze(-1))  # against [C, rows, groups, 1]


@contextlib.contextmanager
def _tf32_products(x: torch.Tensor):
    """float32 error products on a CUDA GPU run in TF32 (~8x the float32 rate on H100/H200): the search
    compares sums of millions of squared products, whose relative change (~1e-4) can only flip a
    near-tie between candidates. On the CPU (the tiny world's reference outputs) nothing changes."""
    if x.device.type != "cuda" or x.dtype != torch.float32:
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


class LayerError:
    """Streaming sum over rows of ||(Q_g(x) - x) W^T||^2 for each candidate g of one Linear.

    The sums stay float64 tensors on the activations' device (no host sync per chunk); `errors`
    and `energy` read them back once the forward is done.
    """

    def __init__(self, weight: torch.Tensor, args, scales: list[tuple[str, float]], many=None):
        self.weight, self.args = weight.detach(), args
        self.many = many or qdq_many  # candidates' QDQ in one call: NVFP4 global scales, or FP8 static scales
        self.labels = [label for label, _ in scales]
        self.scales = [value for _, value in scales]
        self._sums: torch.Tensor | None = None  # [energy, error of each candidate]
        self._gs: torch.Tensor | None = None  # the candidates' global scales, on the activations' device
        self.rows = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        w = self.weight.to(device=x.device, dtype=x.dtype)
        if self._sums is None:
            self._sums = torch.zeros(1 + len(self.scales), dtype=torch.float64, device=x.device)
        step = max(1, CHUNK_ELEMENTS // x.shape[-1])
        if self._gs is None or self._gs.device != x.device:  # once: a host->device copy syncs
            self._gs = torch.tensor(self.scales, dtype=torch.float32, device=x.device)
        gs = self._gs
        budget = CANDIDATE_ELEMENTS.get(x.device.type, CANDIDATE_ELEMENTS_DEFAULT)
        with _tf32_products(x):
            self._accumulate(x, w, gs, step, budget)
        self.rows += x.shape[0]

    def _accumulate(self, x, w, gs, step: int, budget: int) -> None:
        for start in range(0, x.shape[0], step):
            chunk = x[start:start + step]
            self._sums[0] += (chunk @ w.T).double().square().sum()
            per = max(1, budget // max(1, chunk.numel()))
            for lo in range(0, len(self.scales), per):
                hi = min(len(self.scales), lo + per)
                # all candidates' QDQ in one call; each candidate's error is then the same product and sum
                # as one at a time (same shapes, same order), so the sums are the same floats
                diff = self.many(chunk, self.args, gs[lo:hi]) - chunk
                self._sums[1 + lo:1 + hi] += torch.stack([(diff[i] @ w.T).double().square().sum()
                                                          for i in range(hi - lo)])
                del diff

    def hook(self, module, args) -> None:
        self.add(args[0])  # returns None: the forward is left untouched

    @property
    def energy(self) -> float:
        """Sum of ||x W^T||^2, the scale of relative errors."""
        return float(self._sums[0]) if self._sums is not None else 0.0

    @property
    def errors(self) -> list[float]:
        return self._sums[1:].tolist() if self._sums is not None else [0.0] * len(self.scales)

    def relative(self, i: int) -> float:
        return self.errors[i] / self.energy if self.energy > 0 else 0.0


def activation_quantized(model) -> dict[str, torch.nn.Module]:
    """name -> Linear whose scheme quantizes its input activations (module order)."""
    return {name: m for name, m in model.named_modules()
            if getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None
            and isinstance(getattr(m, "input_global_scale", None), torch.Tensor)}


def run_hooked(model, modules: dict[str, torch.nn.Module], layers: dict[str, LayerError], batches, desc: str
               ) -> None:
    """One forward over `batches` with every layer's pre-hook attached, quantization disabled."""
    from compressed_tensors.offload import get_execution_device
    from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context
    from tqdm import tqdm

    from pipeline.models.calibration import skip_logits

    device = get_execution_device(model)  # where oneshot's basic pipeline sends the batches
    handles = [modules[name].register_forward_pre_hook(layer.hook) for name, layer in layers.items()]
    try:
        # only the Linear inputs are read: the output head is skipped
        with calibration_forward_context(model), DisableQuantization(model), skip_logits(model):
            for batch in tqdm(batches, desc=desc, unit="sample"):
                model(**{k: v.to(device) for k, v in batch.items()})
    finally:
        for h in handles:
            h.remove()


def fused_groups(model, names: list[str], extra: tuple = ()) -> list[list[str]]:
    """The layers that must share one input_global_scale, in module order.

    vLLM serves q/k/v and gate/up as one fused Linear with one activation global scale (it keeps
    the max() of the shards' scales and warns), so a fused group gets one scale, chosen on the sum
    of its members' errors; llm-compressor's FUSED_LAYER_NAMES says which layers fuse.
    """
    from llmcompressor.observers.helpers import FUSED_LAYER_NAMES

    wanted, group_of = set(names), {}
    for parent, module in model.named_modules():
        for fusion in list(FUSED_LAYER_NAMES) + list(extra):
            if all(hasattr(module, n) for n in fusion):
                members = [f"{parent}.{n}" if parent else n for n in fusion]
                members = [m for m in members if m in wanted]
                for m in members:
                    group_of[m] = members
    groups, seen = [], set()
    for name in names:
        if name not in seen:
            group = group_of.get(name, [name])
            seen.update(group)
            groups.append(group)
    return groups


def search(model, batches, q) -> dict:
    """Pick each activation-quantized Linear's input_global_scale by the search; write it in place.

    Returns the record for the stage result and the check report: per layer the minmax, fixed and
    chosen scale with the error of each on the calibration batches.
    """
    from compressed_tensors.offload import update_offload_parameter

    fixed = _f32(fixed_input_global_scale(float(q.fixed_activation_amax)))
    mults = [float(m) for m in q.activation_scale_multipliers]
    modules = activation_quantized(model)
    groups = fused_groups(model, list(modules))
    layers = {}
    for group in groups:
        # gate/up read the same input; q and k/v do not (k/v also read the context), so a fused
        # group starts from its smallest minmax scale (the largest absmax: no member clips)
        minmax = min(float(modules[n].input_global_scale.reshape(-1)[0]) for n in group)
        for n in group:
            layers[n] = LayerError(modules[n].weight, modules[n].quantization_scheme.input_activations,
                                   candidates(minmax, fixed, mults))
    limit = int(q.activation_scale_samples)
    used = len(batches) if limit == 0 else min(limit, len(batches))
    run_hooked(model, modules, layers, _Head(batches, used), "activation scale search")
    record = {}
    for group in groups:
        errors = [layers[n].errors for n in group]
        i = min(range(len(errors[0])), key=lambda c: (sum(e[c] for e in errors), c))  # ties: fixed, then minmax
        for n in group:
            old = modules[n].input_global_scale
            # through compressed-tensors, so an offloaded module's stored copy changes too
            update_offload_parameter(modules[n], "input_global_scale",
                                     torch.full_like(old, layers[n].scales[i]))
            record[n] = layer_record(layers[n], i) | ({"fused_with": [m for m in group if m != n]}
                                                      if len(group) > 1 else {})
    return {"method": "mse", "multipliers": mults, "fixed_input_global_scale": fixed, "samples": used,
            "objective": "sum over calibration rows of ||(Q_g(x) - x) W^T||^2, inputs with quantization "
                         "disabled; one scale per fused group (q/k/v, gate/up) on the sum of its errors",
            "groups": [g for g in groups if len(g) > 1], "layers": record}


class _Head:
    """The first n batches of a lazy batch sequence, still built one at a time."""

    def __init__(self, batches, n: int):
        self.batches, self.n = batches, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return (self.batches[i] for i in range(self.n))


def layer_record(layer: LayerError, chosen: int) -> dict:
    """Scales and errors of one layer; relative error = E(g) / sum ||x W^T||^2."""
    minmax = layer.labels.index("minmax")
    fixed = layer.labels.index("fixed")
    return {"chosen": layer.labels[chosen], "chosen_scale": layer.scales[chosen],
            "chosen_multiplier": layer.scales[chosen] / layer.scales[minmax],
            "minmax_scale": layer.scales[minmax], "fixed_scale": layer.scales[fixed], "rows": layer.rows,
            "error": {"minmax": layer.errors[minmax], "fixed": layer.errors[fixed], "chosen": layer.errors[chosen]},
            "relative_error": {"minmax": layer.relative(minmax), "fixed": layer.relative(fixed),
                               "chosen": layer.relative(chosen)}}


# --- FP8 static per-tensor activations (quant.scheme=fp8) ----------------------------------------------------
# FP8 W8A8 with a static activation scale stores `input_scale` = absmax / 448 per Linear (llm-compressor's
# static_minmax over every calibration batch): values are divided by it, clamped to +-448 and rounded to E4M3
# (compressed-tensors' _quantize; vLLM's static fp8 quant does the same). `activation_scale: mse` picks, per
# Linear (per fused group: vLLM serves q/k/v and gate/up at the max() of their shards' input_scale,
# 0.26.0 / 0.32.0 layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py
# process_weights_after_loading), the candidate with the least E(s) = sum ||(Q_s(x) - x) W^T||^2 among the
# minmax scale and minmax / m for each multiplier m (m > 1: a tighter range that clips the rarest outliers, as
# a larger NVFP4 global scale does); ties go to minmax. `activation_scale: minmax` writes each fused group's
# largest minmax scale to every member (what vLLM would serve anyway), so the stored scales are the served ones.


def fp8_static_quantized(model) -> dict[str, torch.nn.Module]:
    """name -> Linear whose scheme quantizes its input with a static per-tensor FP8 scale (`input_scale`)."""
    out = {}
    for name, m in model.named_modules():
        acts = getattr(getattr(m, "quantization_scheme", None), "input_activations", None)
        if (acts is not None and not acts.dynamic and str(getattr(acts.type, "value", acts.type)) == "float"
                and int(acts.num_bits) == 8 and isinstance(getattr(m, "input_scale", None), torch.Tensor)):
            out[name] = m
    return out


def fp8_qdq_many(x: torch.Tensor, args, scales: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' static per-tensor FP8 quantize-dequantize of `x` at each of C scales: [C, *x.shape]
    (elementwise, so row c equals fake_quantize(x, scale c) bit for bit)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    c = scales.numel()
    xs = x.unsqueeze(0).expand(c, *x.shape)
    s = scales.reshape(c, *([1] * x.dim())).to(x.dtype)
    return fake_quantize(xs, s, torch.zeros_like(s), args)


def fp8_candidates(minmax: float, multipliers) -> list[tuple[str, float]]:
    """(label, input_scale): minmax first, then minmax / m for each multiplier where that gives a new value."""
    out = [("minmax", _f32(minmax))]
    seen = {out[0][1]}
    for m in multipliers:
        v = _f32(minmax / float(m))
        if v not in seen and v > 0 and math.isfinite(v):
            seen.add(v)
            out.append((f"minmax*{float(m):g}", v))
    return out


# a hybrid (Gated DeltaNet) target's projections vLLM fuses beyond llm-compressor's list: in_proj_qkv + in_proj_z
# -> in_proj_qkvz, in_proj_b + in_proj_a -> in_proj_ba (docs/hybrid.md; the gates stay dense in every preset)
FP8_EXTRA_FUSED = (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))


def _fp8_groups(model, modules) -> list[list[str]]:
    return fused_groups(model, list(modules), FP8_EXTRA_FUSED)


def _set_input_scale(module, value: float) -> None:
    from compressed_tensors.offload import update_offload_parameter

    old = module.input_scale
    update_offload_parameter(module, "input_scale", torch.full_like(old, value))


def fp8_share_fused(model) -> dict:
    """activation_scale=minmax for FP8: each fused group (q/k/v, gate/up) gets its members' largest minmax
    input_scale, the one vLLM serves the fused Linear at; returns the record (groups and scales)."""
    modules = fp8_static_quantized(model)
    groups = _fp8_groups(model, modules)
    for group in groups:
        if len(group) > 1:
            top = max(float(modules[n].input_scale.reshape(-1)[0]) for n in group)
            for n in group:
                _set_input_scale(modules[n], top)
    return {"method": "minmax", "groups": [g for g in groups if len(g) > 1],
            "input_scales": {n: float(m.input_scale.reshape(-1)[0]) for n, m in modules.items()}}


def search_fp8(model, batches, q) -> dict:
    """Pick each static-FP8 Linear's input_scale by the search (module comment above); write it in place."""
    mults = [float(m) for m in q.activation_scale_multipliers]
    modules = fp8_static_quantized(model)
    groups = _fp8_groups(model, modules)
    layers = {}
    for group in groups:
        minmax = max(float(modules[n].input_scale.reshape(-1)[0]) for n in group)  # no member clips
        for n in group:
            layers[n] = LayerError(modules[n].weight, modules[n].quantization_scheme.input_activations,
                                   fp8_candidates(minmax, mults), many=fp8_qdq_many)
    limit = int(q.activation_scale_samples)
    used = len(batches) if limit == 0 else min(limit, len(batches))
    run_hooked(model, modules, layers, _Head(batches, used), "fp8 activation scale search")
    record = {}
    for group in groups:
        errors = [layers[n].errors for n in group]
        i = min(range(len(errors[0])), key=lambda c: (sum(e[c] for e in errors), c))  # ties: minmax
        for n in group:
            _set_input_scale(modules[n], layers[n].scales[i])
            lay = layers[n]
            rec = {"chosen": lay.labels[i], "chosen_scale": lay.scales[i], "minmax_scale": lay.scales[0],
                   "chosen_multiplier": lay.scales[0] / lay.scales[i], "rows": lay.rows,
                   "error": {"minmax": lay.errors[0], "chosen": lay.errors[i]},
                   "relative_error": {"minmax": lay.relative(0), "chosen": lay.relative(i)}}
            record[n] = rec | ({"fused_with": [m for m in group if m != n]} if len(group) > 1 else {})
    return {"method": "mse", "format": "fp8 static per-tensor input_scale", "multipliers": mults, "samples": used,
            "objective": "sum over calibration rows of ||(Q_s(x) - x) W^T||^2, inputs with quantization disabled; "
                         "candidates minmax / m; one scale per fused group (q/k/v, gate/up) on the sum of its errors",
            "groups": [g for g in groups if len(g) > 1], "layers": record}


def fp8_share_weight_scales(model) -> list[list[str]]:
    """Per-tensor FP8 weights: each fused group (q/k/v, gate/up) gets its members' largest weight_scale before the
    weights are compressed, so that vLLM's load-time requantization of the fused Linear to the max() of its
    shards' scales (0.32.0 layers/quantization/utils/w8a8_utils.py:88-103, `requantize_with_max_scale`) finds
    every shard already at that scale: the stored FP8 weights are exactly the served ones (no second rounding).
    Returns the groups changed."""
    from compressed_tensors.offload import update_offload_parameter

    mods = {}
    for name, m in model.named_modules():
        w = getattr(getattr(m, "quantization_scheme", None), "weights", None)
        if (w is not None and str(getattr(w.strategy, "value", w.strategy)) == "tensor" and int(w.num_bits) == 8
                and str(getattr(w.type, "value", w.type)) == "float" and isinstance(getattr(m, "weight_scale", None),
                                                                                   torch.Tensor)):
            mods[name] = m
    changed = []
    for group in _fp8_groups(model, mods):
        if len(group) > 1:
            top = max(float(mods[n].weight_scale.reshape(-1)[0]) for n in group)
            for n in group:
                update_offload_parameter(mods[n], "weight_scale", torch.full_like(mods[n].weight_scale, top))
            changed.append(group)
    return changed
