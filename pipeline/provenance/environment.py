"""What a stage record and the quant run manifest say about where a stage ran: package versions, the
checkout's commit and dirty flag, the machine and its devices (`pipeline.stages.runner` records them for every
stage; the manifest stage writes them into `quant_run_manifest.json`)."""

from __future__ import annotations

import os
import platform
from typing import Any


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("specquant", "torch", "transformers", "llmcompressor", "compressed-tensors", "datasets",
                "huggingface-hub", "hydra-core", "safetensors", "tokenizers", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def git_state() -> dict[str, Any]:
    """{"commit", "dirty"} of this checkout; the rule for "dirty" is `pipeline.provenance.record.git_state`'s."""
    from pipeline.provenance.record import git_state as _state

    state = _state()
    return {"commit": state["commit"], "dirty": state["dirty"]}


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(),
                            "cpu_count": os.cpu_count()}
    try:
        import torch

        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cuda_version"] = torch.version.cuda
    except ImportError:
        pass
    return info
