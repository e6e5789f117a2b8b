"""Reload a written compressed-tensors checkpoint, dequantize it and measure what quantization cost.

Dequantization goes through compressed-tensors' own per-module decompressors (the loader
transformers uses), applied to a dense copy of the model: apply the checkpoint's
quantization_config, compress to get the on-disk parameter layout, load the file's tensors,
decompress. The module keeps its quantization scheme, so a forward with quantization enabled
emulates the served numerics (NVFP4 activations quantized with the stored input_global_scale);
with it disabled the forward is weight-only dequantized.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.core.io import atomic_write_json


def load_dequantized(model: torch.nn.Module, ckpt_dir: str | Path) -> torch.nn.Module:
    """Turn a dense `model` (same architecture) into the checkpoint's dequantized weights, in place."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    config = json.loads((ckpt_dir / "config.json").read_text(encoding="utf-8"))
    qconfig = QuantizationConfig.model_validate(config["quantization_config"])
    dtype = next(model.parameters()).dtype
    apply_quantization_config(model, qconfig, show_progress=False)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    # straight to the model's device (the same bytes; the host holds no copy of the checkpoint)
    device = next(model.parameters()).device
    state = load_file(str(ckpt_dir / "model.safetensors"), device=str(device))
    result = model.load_state_dict(state, strict=False)
    stray = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if not k.endswith(("embed_tokens.weight", "lm_head.weight"))]
    if stray or missing:
        raise RuntimeError(f"checkpoint {ckpt_dir} does not match the model: missing {missing[:3]}, "
                           f"unexpected {stray[:3]}")
    compressor.decompress_model(model)
    for module in quantized_modules(model).values():
        module.weight.data = module.weight.data.to(dtype)
    return model


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if getattr(m, "quantization_scheme", None) is not None and hasattr(m, "weight")}


def weight_errors(model: torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """Per quantized layer: ||W_deq - W_ref||_F / ||W_ref||_F."""
    ref = dict(reference.named_modules())
    out = {}
    for name, module in quantized_modules(model).items():
        w, r = module.weight.detach().float(), ref[name].weight.detach().float()
        out[name] = float((w - r).norm() / r.norm().clamp_min(1e-12))
    return out


def plot_errors(errors: dict[str, float], title: str, path: Path) -> None:
    """Horizontal bar plot of per-layer relative weight error (PNG, deterministic metadata)."""
    from pipeline.core.plotting import pyplot, save_png

    plt = pyplot()
    names = list(errors)
    fig, ax = plt.subplots(figsize=(7, 0.25 * len(names) + 1.2))
    ax.barh(range(len(names)), [errors[n] for n in names], color="#4c72b0")
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("relative weight error ||W_q - W|| / ||W||")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=100)


def write_report(checks_dir: Path, kind: str, variant: str, report: dict) -> Path:
    checks_dir = Path(checks_dir)
    path = checks_dir / f"{kind}-{variant}.json"
    atomic_write_json(path, report)
    if report.get("weight_error"):
        plot_errors(report["weight_error"], f"{kind} {variant}: per-layer relative weight error",
                    checks_dir / f"{kind}-{variant}-weight-error.png")
    return path


def summarize(errors: dict[str, float]) -> dict[str, float]:
    vals = list(errors.values())
    return {"mean": sum(vals) / len(vals), "max": max(vals), "layers": len(vals)} if vals else {}
