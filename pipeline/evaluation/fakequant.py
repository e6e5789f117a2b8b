"""Run a quantized checkpoint as exactly what its `quantization_config` says, on any device.

The evaluated drafter must behave like the served one, so this uses compressed-tensors' own
lifecycle, the same one transformers runs for `CompressedTensorsConfig(dequantize=True)`:

1. `apply_quantization_config` attaches each Linear's scheme (targets minus `ignore`) and wraps its
   forward with `set_forward_quantized`;
2. `ModelCompressor.compress_model` gives those modules the packed layout (`weight_packed`,
   `weight_scale`, `weight_global_scale`, `input_global_scale`, ...) so the checkpoint loads into it;
3. `decompress_model` turns the packed weights back into dense ones (status DECOMPRESSED).

In that state compressed-tensors' forward skips weight QDQ (the weights already are the dequantized
checkpoint values) but still quantizes every input activation its scheme lists. For NVFP4 W4A4
(`dynamic: local`, tensor_group 16) that is what vLLM's fp4 kernels do at run time: per token,
per group of 16, an FP8-E4M3 block scale `fp8(input_global_scale * amax / 6)`, values rounded to
E2M1 - with the calibrated `input_global_scale` read from the checkpoint.

Layers in `ignore` keep their dense checkpoint weights. Borrowed modules that a drafter checkpoint
never stores (the target's `embed_tokens`, `lm_head`) are kept dense as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pipeline.core import quiet
from pipeline.core.errors import bad_value

# submodules a drafter takes from its target; never in a drafter checkpoint, never quantized
BORROWED = ("embed_tokens", "lm_head")


def read_quantization_config(ckpt_dir: str | Path) -> dict | None:
    """The raw `quantization_config` of a checkpoint's config.json, or None for a dense one."""
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("quantization_config")


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


def _load_state_dict(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise bad_value("checkpoint", str(ckpt_dir), "it holds no .safetensors file",
                        "re-run the stage that writes this checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def quantized_modules(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"weights": bool, "input_activations": bool}} for every module with a scheme."""
    out = {}
    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is not None:
            out[name] = {"weights": scheme.weights is not None,
                         "input_activations": scheme.input_activations is not None}
    return out


@torch.no_grad()
def load_checkpoint_into(model: torch.nn.Module, ckpt_dir: str | Path, allow_missing: tuple[str, ...] = BORROWED
                         ) -> dict[str, Any]:
    """Load a (possibly compressed-tensors) checkpoint into a dense `model` of the same architecture.

    The model's dense Linear weights are replaced by the checkpoint's dequantized ones and its
    quantized Linears quantize their inputs at run time as the checkpoint specifies. Returns a
    summary: which modules are quantized, which input activations are fake-quantized.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    ckpt_dir = Path(ckpt_dir)
    raw = read_quantization_config(ckpt_dir)
    state = _load_state_dict(ckpt_dir)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    q = None
    if raw is not None:
        q = _validated(raw, str(ckpt_dir / "config.json"))
        apply_quantization_config(model, q, show_progress=False)
        ModelCompressor(quantization_config=q).compress_model(model)  # packed layout to receive the tensors
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k.split(".")[0] not in allow_missing]
    if result.unexpected_keys or missing:
        raise bad_value("checkpoint", str(ckpt_dir),
                        f"its tensors do not fit the model (unexpected {result.unexpected_keys[:4]}, "
                        f"missing {missing[:4]})", "check that the checkpoint belongs to this drafter/target")
    if q is not None:
        from compressed_tensors.offload import remove_dispatch

        ModelCompressor(quantization_config=q).decompress_model(model)
        # decompress_model dispatches the model through compressed-tensors' offload cache; evaluation
        # holds the whole drafter on one device, so return plain modules (the QDQ forward stays)
        remove_dispatch(model, onload_tensors=True)
        _restore_dtypes(model, dtypes)
    modules = quantized_modules(model)
    return {"quantization": describe(raw), "quantized_modules": sorted(modules),
            "activation_quantized_modules": sorted(n for n, v in modules.items() if v["input_activations"])}


def _restore_dtypes(model: torch.nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """compressed-tensors' NVFP4 decompressor returns bf16 weights; run them in the model's dtype.

    Only `weight` is cast: the fp32 global scales must stay fp32, as vLLM keeps them.
    """
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        key = f"{name}.weight" if name else "weight"
        if isinstance(w, torch.nn.Parameter) and key in dtypes and w.dtype != dtypes[key]:
            module.weight = torch.nn.Parameter(w.data.to(dtypes[key]), requires_grad=False)


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
    """The target as served: dense, or a compressed-tensors checkpoint dequantized (with W4A4 inputs QDQ'd)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kwargs = {"dtype": dtype, "revision": revision, "trust_remote_code": trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    from pipeline.core.loading import check_safetensors_dir

    quantized = Path(path).is_dir() and read_quantization_config(path) is not None
    # pickles, truncated files, missing shards: one sentence first (a quantized one is the run's target/<variant>)
    check_safetensors_dir(path, f"target/{Path(path).name}" if quantized else "target.path")
    if quantized:
        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    # transformers warns that the checkpoint's own quantization_config wins over the one passed; only its
    # `dequantize` flag is wanted here (weights decompressed at load), so the warning describes the intent
    with quiet.warnings_ignored("You passed `quantization_config` or equivalent parameters"):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if quantized:
        from compressed_tensors.offload import remove_dispatch

        remove_dispatch(model, onload_tensors=True)
        _cast_weights(model, dtype)  # the NVFP4 decompressor yields bf16 weights
    return model.to(device).eval()


def load_drafter_variant(path: str | Path, target, dtype: torch.dtype, device: str) -> tuple[Any, dict]:
    """A drafter checkpoint (dense or compressed-tensors) as a `DFlashDrafter`, plus its quantization summary.

    Dense checkpoints go through `pipeline.models.formats.load_drafter`. Quantized ones are built
    from the same config, given the target's embedding and lm_head, then loaded with
    `load_checkpoint_into`, so `spec_decode` runs them like any other drafter.
    """
    from pipeline.models.dflash import DFlashDrafter
    from pipeline.models.formats import load_drafter, load_drafter_config

    if read_quantization_config(path) is None:
        dense = {"quantization": describe(None), "quantized_modules": [], "activation_quantized_modules": []}
        return load_drafter(path, target=target, dtype=dtype, device=device), dense
    cfg = load_drafter_config(path)
    drafter = DFlashDrafter(cfg).to(dtype)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    drafter.attach_target_weights(embed, head)
    summary = load_checkpoint_into(drafter, path)
    drafter = drafter.to(device)
    drafter.inv_freq = drafter.inv_freq.float()
    return drafter.eval(), summary
