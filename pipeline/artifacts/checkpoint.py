"""A written checkpoint (`drafter/<variant>/`, `target/<variant>/`) read back into a dense model: the one reloader.

quantize-drafter and quantize-target write compressed-tensors checkpoints (`config.json` with
`quantization_config`, `*.safetensors` in the packed layout); their checks (`pipeline.quant.checks`)
and evaluate (`pipeline.evaluation.fakequant`) read them back through `load_into`, which runs
compressed-tensors' own lifecycle on a dense model of the same architecture (the one transformers
runs for `CompressedTensorsConfig(dequantize=True)`):

1. `apply_quantization_config` attaches each Linear's scheme (targets minus `ignore`) and wraps its
   forward with `set_forward_quantized`;
2. `ModelCompressor.compress_model` gives those modules the packed layout (`weight_packed`,
   `weight_scale`, `weight_global_scale`, `input_global_scale`, ...) so the checkpoint's tensors load;
3. `decompress_model` turns the packed weights back into dense ones (status DECOMPRESSED); the
   offload dispatch it installs is removed again, and each decompressed weight is cast back to the
   dtype the model had (the NVFP4 decompressor yields bf16; the fp32 scales stay fp32, as in vLLM).

The modules keep their schemes: a forward with quantization enabled quantizes every input activation
the scheme lists (the served numerics); with it disabled the forward is weight-only dequantized. A
checkpoint without `quantization_config` is loaded as it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.core.errors import bad_value

# submodules a drafter takes from its target; never in a drafter checkpoint, never quantized
BORROWED = ("embed_tokens", "lm_head")


def read_quantization_config(ckpt_dir: str | Path) -> dict | None:
    """The raw `quantization_config` of a checkpoint's config.json, or None for a dense one. Read here, not through
    `pipeline.models.checkpoint_info.CheckpointInfo`: artifacts/ sits a floor below models/, and `load_into` needs
    the dict compressed-tensors applies, not a checkpoint's facts."""
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text(encoding="utf-8"))
    return cfg.get("quantization_config")


def load_tensors(ckpt_dir: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's `*.safetensors` files, read straight to `device`."""
    from safetensors.torch import load_file

    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise bad_value("checkpoint", str(ckpt_dir), "it holds no .safetensors file",
                        "re-run the stage that writes this checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    return state


def _may_be_missing(key: str, allow_missing: tuple[str, ...]) -> bool:
    """A parameter of a module the checkpoint never stores (a borrowed embedding / head), at any depth."""
    return any(part in allow_missing for part in key.split(".")[:-1])


def _restore_dtypes(model: torch.nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Cast each `weight` whose dtype decompression changed back to the model's; scales keep theirs."""
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        key = f"{name}.weight" if name else "weight"
        if isinstance(w, torch.nn.Parameter) and key in dtypes and w.dtype != dtypes[key]:
            module.weight = torch.nn.Parameter(w.data.to(dtypes[key]), requires_grad=False)


@torch.no_grad()
def load_into(model: torch.nn.Module, ckpt_dir: str | Path, *, prepare: Callable | None = None,
              allow_missing: tuple[str, ...] = BORROWED,
              carried: Callable[[str, object], bool] | None = None) -> dict | None:
    """Load the checkpoint in `ckpt_dir` into the dense `model` (same architecture), in place, as its
    dequantized weights; returns the raw `quantization_config` (None for a dense checkpoint).

    `prepare(raw, where) -> QuantizationConfig` may check or adjust the config first (evaluate refuses
    what it cannot emulate and adds the borrowed modules to `ignore`); by default it is validated as
    it is. The tensors are read to the model's device (the host holds no copy of the checkpoint).
    `carried(name, config) -> bool` names the tensors of parts no transformers class loads (a Qwen3.5
    checkpoint's MTP head), which are left out; the caller passes the target families' rule
    (`pipeline.models.targets.carried`: this floor does not import the models).
    Parameters of the modules named in `allow_missing` may be absent from the checkpoint; any other
    missing or unexpected tensor is refused naming the checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    ckpt_dir = Path(ckpt_dir)
    raw = read_quantization_config(ckpt_dir)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    compressor = None
    if raw is not None:
        where = str(ckpt_dir / "config.json")
        q = prepare(raw, where) if prepare is not None else QuantizationConfig.model_validate(raw)
        apply_quantization_config(model, q, show_progress=False)
        compressor = ModelCompressor(quantization_config=q)
        compressor.compress_model(model)  # the packed layout, to receive the checkpoint's tensors
    state = load_tensors(ckpt_dir, next(model.parameters()).device)
    if carried is not None and getattr(model, "config", None) is not None:
        # tensors of parts no transformers class loads (a Qwen3.5 checkpoint's MTP head), carried unchanged
        state = {k: v for k, v in state.items() if not carried(k, model.config)}
    result = model.load_state_dict(state, strict=False)
    del state
    missing = [k for k in result.missing_keys if not _may_be_missing(k, allow_missing)]
    if result.unexpected_keys or missing:
        raise bad_value("checkpoint", str(ckpt_dir),
                        f"its tensors do not fit the model (unexpected {result.unexpected_keys[:4]}, "
                        f"missing {missing[:4]})", "check that the checkpoint belongs to this drafter/target")
    if compressor is not None:
        from compressed_tensors.offload import remove_dispatch

        compressor.decompress_model(model)
        # decompress_model dispatches the model through compressed-tensors' offload cache; the model is
        # held whole on one device, so plain modules are returned (the QDQ forward stays)
        remove_dispatch(model, onload_tensors=True)
        _restore_dtypes(model, dtypes)
    return raw


__all__ = ["BORROWED", "read_quantization_config", "load_tensors", "load_into"]
