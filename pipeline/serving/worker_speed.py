"""serve-check worker, speed (`job["speed"]`, GPU only): decode timing per batch size and, with `speed.profile`
(`{"dir", "batches", "tokens", "prefix"}`), one more run of a batch under torch's profiler after its timed runs,
with the runner's parts in named scopes (`profile_steps`). Runs inside vLLM's interpreter (standard library, vLLM
and torch only; see `pipeline.serving.worker`); `worker_engine.run_job` calls it.

After the correctness subsets, the same engine (served as configured: CUDA graphs unless `enforce_eager`)
generates `max_tokens` tokens (ignore_eos) for each batch size in `batches`, prompts taken in turn from the job's;
a batch is timed twice, with 1 token (prefill) and with `max_tokens`, after one untimed warm-up. Per batch: wall
times, decode seconds (vLLM's own per-request first/last token timestamps, and the difference of the two runs),
engine steps per sequence (spec-decode drafts per sequence for a pair, tokens - 1 alone), ms per step, decode
tokens/s, tau from the same run. The worker measures; the speedup over the target alone is the stage's arithmetic
(`pipeline.serving.speedup.speed_summary`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from pipeline.serving.worker_common import counter_diff, spec_counters


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
        before = spec_counters(llm)
        outs, total_s = run(tokens)
        spec_counts = counter_diff(spec_counters(llm), before)
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
