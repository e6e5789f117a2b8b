"""serve-check worker, engine mode: one vLLM engine for one job (a target alone, or a target with a DFlash
drafter), run inside vLLM's interpreter (standard library, vLLM and torch only; see `pipeline.serving.worker`).

The job names a target, an optional DFlash drafter and the prompts as token ids, already rendered by the evaluate
stage's code; the result holds the greedy outputs, vLLM's spec-decode counters per subset (differences of
`llm.get_metrics()` around each subset's `generate`), the linear kernel vLLM built for every quantized layer (read
off the loaded model, plus vLLM's own "Using/Selected ... kernel" log lines), versions, the platform, load time and
peak memory; with `job["speed"]` on a GPU, the timings of `worker_speed.measure_speed`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from pipeline.serving.worker_common import (
    LogLines,
    counter_diff,
    cpu_runtime,
    finish,
    peak_rss_bytes,
    platform_name,
    record_error,
    register_cpu_emulation,
    reset_peak_rss,
    settle_logging,
    spec_counters,
)
from pipeline.serving.worker_speed import measure_speed


def _roots(worker) -> list[tuple[str, object]]:
    """(path, module) of every model the worker's runner holds: the target and the drafter."""
    import torch

    worker = getattr(worker, "worker", None) or worker  # a WorkerWrapperBase holds the real worker
    runner = getattr(worker, "model_runner", worker)
    roots: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def add(path: str, obj) -> None:
        if isinstance(obj, torch.nn.Module) and id(obj) not in seen:
            seen.add(id(obj))
            roots.append((path, obj))

    for attr, value in sorted(vars(runner).items()):
        add(attr, value)
        for sub in ("model", "drafter", "speculator"):
            inner = getattr(value, sub, None) if attr in ("drafter", "speculator", "proposer") else None
            add(f"{attr}.{sub}", inner)
            add(f"{attr}.{sub}.model", getattr(inner, "model", None))
    return roots


def _draft_attention(worker) -> list[dict]:
    """How vLLM built each draft attention layer: causal or not (DFlash drafts its block non-causally), read
    off the loaded drafter (`causal` of the DFlash attention modules, 0.26-0.34)."""
    out, seen = [], set()
    for root, mod in _roots(worker):
        if root == "model":
            continue
        for name, m in mod.named_modules():
            if isinstance(getattr(m, "causal", None), bool) and hasattr(m, "attn") and id(m) not in seen:
                seen.add(id(m))
                out.append({"root": root, "name": name, "causal": m.causal})
    return out


def _layer_kernels(worker) -> list[dict]:
    """Every layer with a quantization scheme in the worker's models: (root, name, scheme, kernel)."""
    out, layers_seen = [], set()
    for root, mod in _roots(worker):
        for name, m in mod.named_modules():
            scheme = getattr(m, "scheme", None)
            if scheme is None or id(m) in layers_seen:  # a root nested in another is walked once
                continue
            layers_seen.add(id(m))
            # FP8 W8A8 (CompressedTensorsW8A8Fp8) keeps its kernel as `fp8_linear`
            kernel = getattr(scheme, "kernel", None) or getattr(scheme, "fp8_linear", None)
            out.append({"root": root, "name": name, "scheme": type(scheme).__name__,
                        "kernel": type(kernel).__name__ if kernel is not None else None})
    return out


def _weight_bytes(worker) -> dict:
    """Bytes of parameters and buffers each model holds on the GPU: the target (`model`) and the drafter
    (`drafter.model` or `speculator.model`), the drafter counting only tensors the target does not share with it (DFlash reuses
    the target's embedding and LM head)."""
    import torch

    worker = getattr(worker, "worker", None) or worker
    runner = getattr(worker, "model_runner", worker)

    def tensors(mod) -> dict[int, int]:
        if not isinstance(mod, torch.nn.Module):
            return {}
        out = {}
        for t in [*mod.parameters(), *mod.buffers()]:
            if t.device.type != "cpu" and t.numel():
                out[t.data_ptr()] = t.numel() * t.element_size()
        return out

    target = tensors(getattr(runner, "model", None))
    # the V1 runner holds the drafter as `drafter`, vLLM 0.26's V2 runner (DFlash) as `speculator`
    proposer = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    drafter = tensors(getattr(proposer, "model", None))
    return {"target": sum(target.values()),
            "drafter": sum(b for ptr, b in drafter.items() if ptr not in target) if drafter else 0,
            "drafter_shared_with_target": sum(b for ptr, b in drafter.items() if ptr in target)}


def _engine_settings(llm, kwargs: dict) -> dict:
    """What the engine was asked for (`requested`: the LLM arguments, prompts aside) and what vLLM resolved:
    the target model, its quantization, and the drafter's speculative config (method, model, tokens, the
    draft's quantization). Compared with the serving commands a run writes (pipeline/serving/command.py)."""
    out: dict = {"requested": {k: v for k, v in kwargs.items() if k != "compilation_config"}}
    try:
        conf = llm.llm_engine.vllm_config
        out.update(model=conf.model_config.model, quantization=conf.model_config.quantization,
                   attention_backend=kwargs.get("attention_backend"))
        spec = conf.speculative_config
        out["speculative_config"] = None if spec is None else {
            "method": spec.method, "model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens,
            "quantization": spec.draft_model_config.quantization if spec.draft_model_config else spec.quantization}
    except Exception as exc:  # noqa: BLE001 - a report of the settings, not the check
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def engine_kwargs(job: dict, platform: str) -> dict:
    """The `vllm.LLM` arguments for a job on this platform."""
    kwargs = dict(model=job["target"], tokenizer=job.get("tokenizer") or job["target"],
                  enforce_eager=bool(job.get("enforce_eager", True)), max_model_len=int(job["max_model_len"]),
                  kv_cache_memory_bytes=int(job.get("kv_cache_memory_bytes", 1 << 30)), disable_log_stats=False,
                  seed=int(job.get("seed", 0)), dtype=job.get("dtype", "auto"), enable_prefix_caching=False)
    if job.get("kv_cache_dtype", "auto") != "auto":  # serve.kv_cache_dtype (fp8: E4M3 target and draft KV)
        kwargs["kv_cache_dtype"] = str(job["kv_cache_dtype"])
    if platform != "cpu":  # the CPU build picks its own attention backend and has no GPU memory to share
        kwargs["attention_backend"] = job.get("attention_backend", "FLASH_ATTN")
        if job.get("gpu_memory_utilization"):
            kwargs["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    if job.get("compilation_config"):  # e.g. cudagraph_capture_sizes for a speed run
        kwargs["compilation_config"] = dict(job["compilation_config"])
    if job.get("additional_config"):  # e.g. {"gdn_prefill_backend": "triton"}
        kwargs["additional_config"] = dict(job["additional_config"])
    if job.get("language_model_only"):  # a text-only checkpoint served in its family's wrapper layout
        kwargs["language_model_only"] = True
    if job.get("linear_backend", "auto") != "auto":
        kwargs["linear_backend"] = job["linear_backend"]
    if job.get("drafter"):
        kwargs["speculative_config"] = {"method": "dflash", "model": job["drafter"],
                                        "num_speculative_tokens": int(job["num_speculative_tokens"])}
    return kwargs


def _inspect(llm, job: dict, result: dict) -> None:
    """The kernel of every quantized layer and, for a pair, how the draft attention was built (reports)."""
    try:
        result["layers"] = [r for rs in llm.collective_rpc(_layer_kernels) for r in rs]
    except Exception as exc:  # noqa: BLE001 - the kernel table is a report, not the check
        result["layers_error"] = f"{type(exc).__name__}: {exc}"
    if job.get("drafter"):
        try:
            result["draft_attention"] = [r for rs in llm.collective_rpc(_draft_attention) for r in rs]
        except Exception as exc:  # noqa: BLE001 - reported; the verdict says it is unknown
            result["draft_attention_error"] = f"{type(exc).__name__}: {exc}"


def _generate(llm, job: dict, result: dict) -> None:
    """Greedy outputs and the spec-decode counters of each prompt subset."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]),
                            stop_token_ids=list(job.get("stop_token_ids") or []), seed=int(job.get("seed", 0)))
    result["subsets"] = {}
    t1 = time.perf_counter()
    for subset, prompts in job["prompts"].items():
        before = spec_counters(llm)
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        after = spec_counters(llm)
        result["subsets"][subset] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                     **counter_diff(after, before)}
    result["generate_s"] = round(time.perf_counter() - t1, 3)


def _speed(llm, job: dict, result: dict, platform: str) -> None:
    """`job["speed"]`: the engine timed on a GPU (`worker_speed`), or said not measured."""
    import torch

    if platform == "cpu" or not torch.cuda.is_available():
        result["speed"] = {"measured": False, "reason": f"not measured on the {platform} platform"}
        return
    try:
        result["weight_bytes"] = llm.collective_rpc(_weight_bytes)[0]
    except Exception as exc:  # noqa: BLE001 - a report, not the check
        result["weight_bytes_error"] = f"{type(exc).__name__}: {exc}"
    prompts = job["speed"].get("prompts") or [p for ps in job["prompts"].values() for p in ps]
    with speed_gate(result):
        result["speed"] = measure_speed(llm, prompts, job["speed"], bool(job.get("drafter")))


@contextlib.contextmanager
def speed_gate(result: dict):
    """With `SPECQUANT_SPEED_GATE=<dir>` (bench/speed.py --parallel: engines of one wave load at once), say
    this engine is loaded (`ready-<pid>`), wait for the launcher's `go` (every engine of the wave loaded or
    gone), then time under an exclusive lock: no other engine loads or runs while one is timed."""
    import fcntl

    gate = os.environ.get("SPECQUANT_SPEED_GATE")
    if not gate:
        yield
        return
    d = Path(gate)
    (d / f"ready-{os.getpid()}").write_text("")
    t0 = time.perf_counter()
    while not (d / "go").exists():
        if time.perf_counter() - t0 > 1800:
            raise TimeoutError(f"speed gate {d}: no 'go' from the launcher within 1800 s")
        time.sleep(0.2)
    with open(d / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result["speed_gate_wait_s"] = round(time.perf_counter() - t0, 3)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _memory(result: dict) -> None:
    """Peak GPU memory and the device's use, or on the CPU build the process's peak resident set."""
    import torch

    if torch.cuda.is_available():
        result["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
        free, total = torch.cuda.mem_get_info()
        if os.environ.get("SPECQUANT_SPEED_GATE"):  # other engines hold the device too: not this engine's use
            result["gpu_used_bytes"] = None
            result["gpu_used_note"] = "not measured: the device was shared by the engines of a --parallel wave"
        else:
            result["gpu_used_bytes"] = int(total - free)  # the whole device: KV cache, graphs, context too
    else:  # the engine runs in this process on the CPU build: the peak resident set since the job began
        result["peak_rss_bytes"] = peak_rss_bytes()


def run_job(job: dict) -> dict:
    """One engine for one job (module docstring); every failure becomes `{"ok": false, "error": ...}`."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the model can be inspected
    from vllm import LLM

    settle_logging()
    lines = LogLines()
    logging.getLogger("vllm").addHandler(lines)
    result: dict = {"ok": False, "name": job["name"], "job": {k: v for k, v in job.items() if k != "prompts"}}
    if isinstance(job.get("speed"), dict):  # its prompts are token ids, not a setting
        result["job"]["speed"] = {k: v for k, v in job["speed"].items() if k != "prompts"}
    t0 = time.perf_counter()
    try:
        platform = result["platform"] = platform_name()
        if platform == "cpu":
            reset_peak_rss()
            result["cpu_runtime"] = {**cpu_runtime(), "preloaded": os.environ.get("LD_PRELOAD", "")}
            register_cpu_emulation(result, job)
        kwargs = engine_kwargs(job, platform)
        llm = LLM(**kwargs)
        result["load_s"] = round(time.perf_counter() - t0, 3)
        result["engine"] = _engine_settings(llm, kwargs)
        _inspect(llm, job, result)
        _generate(llm, job, result)
        if job.get("speed"):
            _speed(llm, job, result, platform)
        _memory(result)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the result file
        record_error(result, exc)
    finally:
        logging.getLogger("vllm").removeHandler(lines)
    return finish(result, lines, t0)
