"""Run a quantized checkpoint as exactly what its `quantization_config` says, on any device.

The evaluated drafter must behave like the served one, so its checkpoint is read back with
compressed-tensors' own lifecycle, the one transformers runs for `CompressedTensorsConfig(dequantize=True)`
(`pipeline.artifacts.checkpoint.load_into`, the reloader the quantize checks use too: apply the
scheme, compress to the packed layout, load the tensors, decompress).

In that state compressed-tensors' forward skips weight QDQ (the weights already are the dequantized
checkpoint values) but still quantizes every input activation its scheme lists. For NVFP4 W4A4
(`dynamic: local`, tensor_group 16) that is what vLLM's fp4 kernels do at run time: per token,
per group of 16, an FP8-E4M3 block scale `fp8(input_global_scale * amax / 6)`, values rounded to
E2M1 - with the calibrated `input_global_scale` read from the checkpoint.

Layers in `ignore` keep their dense checkpoint weights. Borrowed modules that a drafter checkpoint
never stores (the target's `embed_tokens`, `lm_head`) are kept dense as well.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts.checkpoint import BORROWED, load_into, read_quantization_config
from pipeline.core import quiet
from pipeline.core.errors import bad_value


def _args_summary(args) -> dict | None:
    if args is None:
        return None
    dumped = args.model_dump(mode="json")
    return {k: dumped.get(k) for k in ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")}


def describe(qconfig: dict | None) -> dict[str, Any]:
    """What a checkpoint quantizes, in a form for results.json: weights/activations per group, ignore."""
    if qconfig is None:
        return {"quantized": False}
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig.model_validate(qconfig)
    groups = {name: {"targets": list(s.targets), "weights": _args_summary(s.weights),
                     "input_activations": _args_summary(s.input_activations)}
              for name, s in sorted(q.config_groups.items())}
    return {"quantized": True, "format": q.format, "groups": groups, "ignore": list(q.ignore or []),
            "activations_quantized": any(g["input_activations"] for g in groups.values())}


def _validated(qconfig: dict, where: str):
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig.model_validate(qconfig)
    if q.kv_cache_scheme is not None:
        raise bad_value(f"{where}:quantization_config.kv_cache_scheme", q.kv_cache_scheme,
                        "KV-cache quantization is not evaluated by this stage",
                        "evaluate a checkpoint without kv_cache_scheme")
    if any(s.output_activations is not None for s in q.config_groups.values()):
        raise bad_value(f"{where}:quantization_config", "output_activations",
                        "output-activation quantization is not evaluated by this stage",
                        "evaluate a checkpoint that quantizes weights and input activations only")
    if getattr(q, "transform_config", None):
        raise bad_value(f"{where}:quantization_config.transform_config", "set",
                        "rotation transforms are not evaluated by this stage", "evaluate a checkpoint without them")
    # the borrowed target modules are dense in every drafter served by vLLM
    q.ignore = list(q.ignore or []) + [m for m in BORROWED if m not in (q.ignore or [])]
    return q


def quantized_modules(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"weights": bool, "input_activations": bool}} for every module with a scheme."""
    out = {}
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is not None:
            out[name] = {"weights": scheme.weights is not None,
                         "input_activations": scheme.input_activations is not None}
    return out


def load_checkpoint_into(model: torch.nn.Module, ckpt_dir: str | Path, allow_missing: tuple[str, ...] = BORROWED
                         ) -> dict[str, Any]:
    """Load a (possibly compressed-tensors) checkpoint into a dense `model` of the same architecture.

    The model's dense Linear weights are replaced by the checkpoint's dequantized ones and its
    quantized Linears quantize their inputs at run time as the checkpoint specifies
    (`pipeline.artifacts.checkpoint.load_into`, with `_validated` refusing what this stage cannot
    emulate). Returns a summary: which modules are quantized, which input activations are fake-quantized.
    """
    from pipeline.models.targets import carried

    raw = load_into(model, ckpt_dir, prepare=_validated, allow_missing=allow_missing, carried=carried)
    modules = quantized_modules(model)
    return {"quantization": describe(raw), "quantized_modules": sorted(modules),
            "activation_quantized_modules": sorted(n for n, v in modules.items() if v["input_activations"])}


def set_activation_quantization(model: torch.nn.Module, enabled: bool) -> None:
    """Switch run-time activation QDQ on or off (compressed-tensors' `quantization_enabled` flag).

    With the weights already dequantized, `enabled=False` leaves a weights-only model: tests use it
    to show that the W4A4 variant's activations really are quantized.
    """
    for m in model.modules():
        if getattr(m, "quantization_scheme", None) is not None:
            m.quantization_enabled = enabled


def _cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters to `dtype`, except the fp32 quantization scales vLLM keeps in fp32."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype or name.endswith(("_scale", "_zero_point")):
                continue
            module._parameters[name] = torch.nn.Parameter(p.data.to(dtype), requires_grad=False)


def load_target(path: str, dtype: torch.dtype, device: str, revision: str | None = None,
                trust_remote_code: bool = False, attn_implementation: str | None = None):
    """The target as served: dense, or a compressed-tensors checkpoint dequantized (with W4A4 inputs QDQ'd).
    Loaded through `pipeline.core.loading.load_target` (config, pickles, truncated files, missing shards:
    one sentence first; a quantized one is named as the run's target/<variant>)."""
    from transformers import CompressedTensorsConfig

    from pipeline.core.loading import load_target as load_checkpoint

    quantized = Path(path).is_dir() and read_quantization_config(path) is not None
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    # transformers warns that the checkpoint's own quantization_config wins over the one passed; only its
    # `dequantize` flag is wanted here (weights decompressed at load), so the warning describes the intent
    with quiet.warnings_ignored("You passed `quantization_config` or equivalent parameters"):
        model = load_checkpoint(path, dtype=dtype, revision=revision, trust_remote_code=trust_remote_code,
                                attn_implementation=attn_implementation,
                                field=f"target/{Path(path).name}" if quantized else "target.path", **extra)
    if quantized:
        from compressed_tensors.offload import remove_dispatch

        remove_dispatch(model, onload_tensors=True)
        _cast_weights(model, dtype)  # the NVFP4 decompressor yields bf16 weights
    return model.to(device).eval()


def load_drafter_variant(path: str | Path, target, dtype: torch.dtype, device: str) -> tuple[Any, dict]:
    """A drafter checkpoint (dense or compressed-tensors) as a `DFlashDrafter`, plus its quantization summary.

    Dense checkpoints go through `pipeline.models.formats.load_drafter`. Quantized ones are built
    from the same config, given the target's embedding and lm_head (the embedding only where the drafter has
    its own trimmed head), then loaded with `load_checkpoint_into`, so `spec_decode` runs them like any other
    drafter.
    """
    from pipeline.models import families
    from pipeline.models.formats import load_drafter, load_drafter_config

    if read_quantization_config(path) is None:
        dense = {"quantization": describe(None), "quantized_modules": [], "activation_quantized_modules": []}
        return load_drafter(path, target=target, dtype=dtype, device=device), dense
    cfg = load_drafter_config(path)
    drafter = families.family_of(cfg, str(path)).model_class()(cfg).to(dtype)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    drafter.attach_target_weights(embed, head)
    summary = load_checkpoint_into(drafter, path)
    if cfg.has_draft_vocab:  # its own trimmed head (dense, in `ignore`) and d2t, read from the checkpoint
        from pipeline.models.formats import check_d2t

        check_d2t(cfg, drafter.d2t, str(path))
    drafter = drafter.to(device)
    drafter.inv_freq = drafter.inv_freq.float()
    return drafter.eval(), summary
