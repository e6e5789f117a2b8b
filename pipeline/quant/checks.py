"""Reload a written compressed-tensors checkpoint, dequantize it and measure what quantization cost.

Dequantization goes through compressed-tensors' own per-module decompressors (the loader
transformers uses), applied to a dense copy of the model by `pipeline.artifacts.checkpoint.load_into`:
apply the checkpoint's quantization_config, compress to get the on-disk parameter layout, load the
file's tensors, decompress. The module keeps its quantization scheme, so a forward with quantization enabled
emulates the served numerics (NVFP4 activations quantized with the stored input_global_scale);
with it disabled the forward is weight-only dequantized.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.artifacts import check_report
from pipeline.core.errors import bad_value


def load_dequantized(model: torch.nn.Module, ckpt_dir: str | Path) -> torch.nn.Module:
    """Turn a dense `model` (same architecture) into the checkpoint's dequantized weights, in place
    (`pipeline.artifacts.checkpoint.load_into`, the reloader evaluate uses too)."""
    from pipeline.artifacts.checkpoint import load_into
    from pipeline.models.targets import carried

    if load_into(model, ckpt_dir, carried=carried) is None:
        raise bad_value("checkpoint", str(ckpt_dir), "its config.json has no quantization_config",
                        "check a checkpoint written by quantize-drafter / quantize-target")
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


def write_report(checks_dir: Path, report: check_report.Report) -> Path:
    """The report (`pipeline.artifacts.check_report`, its format) and, when it has layers, its weight-error plot."""
    path = check_report.write(checks_dir, report)
    if report.weight_error:
        kind, variant = report.kind, report.variant
        plot_errors(report.weight_error, f"{kind} {variant}: per-layer relative weight error",
                    Path(checks_dir) / f"{kind}-{variant}-weight-error.png")
    return path


def summarize(errors: dict[str, float]) -> dict[str, float]:
    vals = list(errors.values())
    return {"mean": sum(vals) / len(vals), "max": max(vals), "layers": len(vals)} if vals else {}
