"""One call into llm-compressor's `oneshot`, seeded, with the calibration-free variant beside it."""

from __future__ import annotations

import contextlib

import torch

from pipeline.core import quiet
from pipeline.models.calibration import skip_logits
from pipeline.quant.act_scale import fixed_input_global_scale
from pipeline.quant.recipes import SCHEMES, build_modifier


class NullProcessor:
    """oneshot demands a processor whenever a dataset is given; ours never writes anything."""

    def save_pretrained(self, *args, **kwargs) -> None:
        return None


def run_oneshot(model, q, ignore: list[str], batches: list[dict] | None, seed: int, skip_head: bool = False):
    """Apply the recipe to `model` in place; returns the modifier (its yaml goes to recipe.yaml).

    batches: calibration batches (dicts of tensors passed as `model(**batch)`), or None for a
    data-free run (weight-only RTN, or the calibration-free NVFP4 baseline). skip_head: the calibration
    forward skips the model's output head (`skip_logits`; the drafter, whose head is the target's).
    """
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader

    modifier = build_modifier(q, ignore)
    recipe = modifier if isinstance(modifier, list) else [modifier]
    # llm-compressor seeds nothing itself; observers and GPTQ are deterministic once this is fixed
    torch.manual_seed(seed)
    # llm-compressor's get_main_device logs "No accelerator available! Compressing model on CPU instead"
    # on every CPU run, several times per call; specquant chose the device itself (quant.device /
    # target_quant.device, recorded in the stage record), so the line tells the user nothing they can act on
    muted = ["llmcompressor.utils.dev"]
    if batches:
        loader = DataLoader(batches, batch_size=None, shuffle=False)
        # the `basic` pipeline is chosen on purpose (quant.pipeline): the drafter's calibration forward is one
        # call over anchored blocks, not a stack of decoder layers that `sequential` could trace; and the
        # "Attempting to calibrate on CPU" notice repeats the device specquant chose (quant.device, recorded)
        if str(q.pipeline) == "basic":
            muted += ["llmcompressor.pipelines.registry", "llmcompressor.pipelines.basic.pipeline"]
        with (quiet.loguru_muted(*muted), _awq_skips(q.algorithm == "awq") as skipped,
              skip_logits(model) if skip_head else contextlib.nullcontext()):
            oneshot(model=model, dataset=loader, recipe=recipe, processor=NullProcessor(),
                    pipeline=q.pipeline, num_calibration_samples=len(batches))
        if skipped:
            from pipeline.core.errors import bad_value

            # measured on an H200 (docs/benchmarks.md): on the DFlash drafter every mapping is skipped,
            # and what would be written is byte-identical to the round-to-nearest w4a16 variant
            raise bad_value("quant.algorithm", q.algorithm, f"llm-compressor's AWQ skipped {len(skipped)} smoothing "
                            f"mapping(s) of this drafter ({', '.join(skipped[:4])}: NaN or inf in the parent "
                            "module's forward), so those weights would be plain round-to-nearest under an `awq` "
                            "name; nothing was written", "use quant=w4a16-gptq (GPTQ calibrates every layer)")
    else:
        # data-free by design (weight-only RTN, or the calibration-free NVFP4 baseline): llm-compressor
        # then recommends the `sequential` pipeline (which needs calibration data) and, for W4A4, warns
        # once per activation observer that it "attempted to calibrate a module input without statistics
        # ... bad calibration setup"; both describe what this variant is, so they are muted and the
        # one line below says what happens instead
        muted += ["llmcompressor.pipelines.registry", "llmcompressor.modifiers.quantization.calibration"]
        if SCHEMES[q.scheme].quantize_activations and SCHEMES[q.scheme].grouped:
            print(f"[specquant] {q.name}: calibration-free variant: no activation statistics by design; every "
                  f"input_global_scale is set from the fixed activation absmax {float(q.fixed_activation_amax):g} "
                  "(fixed_activation_amax)")
        with quiet.loguru_muted(*muted):
            oneshot(model=model, recipe=recipe, pipeline="datafree")
    return modifier


@contextlib.contextmanager
def _awq_skips(active: bool = True):
    """The smoothing layers llm-compressor's AWQ reports skipping (a loguru WARNING per mapping)."""
    from loguru import logger

    skipped: list[str] = []
    if not active:
        yield skipped
        return

    def sink(message):
        text = message.record["message"]
        if text.startswith("Skipping smooth_layer ") and "NaN or inf" in text:
            skipped.append(text.split()[2].rstrip(","))

    handle = logger.add(sink, level="WARNING", filter="llmcompressor.modifiers.transform.awq")
    try:
        yield skipped
    finally:
        with contextlib.suppress(ValueError):  # llm-compressor may reconfigure loguru (removing every sink)
            logger.remove(handle)


def set_fixed_activation_scales(model, amax: float) -> dict:
    """Calibration-free NVFP4: every quantized Linear gets the same input_global_scale, no data.

    This is NVIDIA Model-Optimizer's calibration-free drafter PTQ (examples/speculative_decoding/
    scripts/quantize_drafter.py, PR #2027): a fixed activation `input_scale` of 1.0 in its amax/2688
    convention, i.e. amax = 448*6 = 2688 and a compressed-tensors input_global_scale of 1.0. Only the
    per-16 FP8 block scales adapt at run time, so blocks whose absmax exceeds 2688 are clipped and
    blocks below ~2688/28672 fall into FP8 subnormals; calibration only helps outside that window.
    """
    value = fixed_input_global_scale(amax)
    n = 0
    for module in model.modules():
        scale = getattr(module, "input_global_scale", None)
        if isinstance(scale, torch.Tensor):
            with torch.no_grad():
                scale.fill_(value)
            n += 1
    return {"method": "fixed input_global_scale, no calibration data", "activation_amax": float(amax),
            "input_global_scale": value, "modules": n}


def activation_scales(model, q, batches) -> tuple[dict | None, dict | None, dict[str, float]]:
    """After oneshot: the activation global scales the variant ships.

    Returns (calibration-free record, search record, minmax scales). calibration=none fixes every
    scale (NVIDIA's calibration-free baseline); calibration=cache keeps static_minmax's scales for
    activation_scale=minmax, or replaces each by the error-minimizing candidate for mse
    (pipeline.quant.act_scale, over the same calibration batches).
    """
    from pipeline.quant import act_scale

    if not quantizes_activations(q):
        return None, None, {}
    scheme = SCHEMES[q.scheme]
    if not scheme.grouped:  # FP8: static per-tensor input_scale (fp8), or dynamic activations (nothing stored)
        act_scale.fp8_share_weight_scales(model)  # per-tensor weights: one scale per fused group, as vLLM serves it
        if not scheme.static_activations:
            return None, None, {}
        minmax = input_scales(model)
        if q.activation_scale == "mse":
            return None, act_scale.search_fp8(model, batches, q), minmax
        act_scale.fp8_share_fused(model)
        return None, None, minmax
    if q.calibration == "none":
        return set_fixed_activation_scales(model, float(q.fixed_activation_amax)), None, {}
    minmax = input_global_scales(model)
    if q.activation_scale == "mse":
        return None, act_scale.search(model, batches, q), minmax
    return None, None, minmax


def input_global_scales(model) -> dict[str, float]:
    """name -> input_global_scale of every activation-quantized Linear (for reports and tests)."""
    out = {}
    for name, module in model.named_modules():
        scale = getattr(module, "input_global_scale", None)
        if isinstance(scale, torch.Tensor):
            out[name] = float(scale.reshape(-1)[0])
    return out


def input_scales(model) -> dict[str, float]:
    """name -> static FP8 input_scale of every such Linear (fp8's minmax scales, for the record)."""
    from pipeline.quant import act_scale

    return {n: float(m.input_scale.reshape(-1)[0]) for n, m in act_scale.fp8_static_quantized(model).items()}


def stored_activation_scales(model) -> dict[str, float]:
    """What the checkpoint stores per activation-quantized Linear: NVFP4 input_global_scale, FP8 input_scale."""
    return input_global_scales(model) or input_scales(model)


def quantizes_activations(q) -> bool:
    return SCHEMES[q.scheme].quantize_activations
