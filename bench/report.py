"""Environment capture, cache summaries and the markdown table of a bench run."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from pathlib import Path

CONTENT_KEYS = ("content_sha256", "content_hash", "content_digest")
RATE_KEYS = ("tokens_per_s", "tok_s", "tokens_per_second", "throughput_tok_s")


def environment(work: Path) -> dict:
    import datetime as dt

    from pipeline.provenance.environment import package_versions

    env = {"date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "python": platform.python_version(),
           "platform": platform.platform(), "versions": package_versions(),
           "work_dir": str(work), "disk_free_gib": round(shutil.disk_usage(work).free / 2**30, 1)}
    try:
        import torch

        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    root = Path(__file__).resolve().parent.parent / "pipeline"
    env["code_sha256"] = {p.relative_to(root.parent).as_posix(): _sha12(p) for p in sorted(root.rglob("*.py"))
                          if p.name.startswith(("cache", "quantize", "manifest")) or p.parent.name in ("quant", "models")}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def _sha12(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def _find(d: dict, keys: tuple[str, ...]):
    """First value under any of `keys`, searched depth-first through nested dicts."""
    for k in keys:
        if k in d:
            return d[k]
    for v in d.values():
        if isinstance(v, dict):
            found = _find(v, keys)
            if found is not None:
                return found
    return None


def cache_summary(run_dir: Path, bench_rec: dict | None = None, target: str = "bf16") -> dict:
    """Bytes, tokens, bytes/token, content hash and tokens/s of a finished cache stage.

    tok_s is the stage's own figure (its clock includes loading the target); tok_s_steady takes the
    probe's timing of `load_target` out (the slowest rank's, under torchrun)."""
    out: dict = {}
    cache = run_dir / ("cache" if target == "bf16" else f"cache-{target}")
    from pipeline.artifacts import samples as samples_file

    meta_p = run_dir / "data" / samples_file.META
    tokens = samples_file.load_meta(meta_p.parent).num_tokens if meta_p.is_file() else None
    out["tokens"] = tokens
    if cache.is_dir():
        nbytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
        out["cache_bytes"] = nbytes
        out["cache_files"] = sum(1 for p in cache.rglob("*") if p.is_file())
        if tokens:
            out["cache_bytes_per_token"] = round(nbytes / tokens, 1)
    index = cache / "index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        out["content_sha256"] = _find(idx, CONTENT_KEYS)
    stage = run_dir / "stages" / ("cache.json" if target == "bf16" else f"cache-{target}.json")
    if stage.is_file():
        rec = json.loads(stage.read_text())
        result = rec.get("result") or {}
        out["stage_wall_s"] = rec.get("wall_time_s")
        out["stage_result"] = {k: v for k, v in result.items() if not isinstance(v, list | dict) or k in ("timing",)}
        out["content_sha256"] = out.get("content_sha256") or _find(result, CONTENT_KEYS)
        rate = _find(result, RATE_KEYS)
        out["tok_s"] = round(float(rate)) if rate else None
        if tokens and rec.get("wall_time_s"):
            out["tok_s_end_to_end"] = round(tokens / rec["wall_time_s"])
        if not out["tok_s"]:
            out["tok_s"] = out.get("tok_s_end_to_end")
        loads = [p.get("load_target_s") for p in (bench_rec or {}).get("probe") or [] if p.get("load_target_s")]
        secs, written = result.get("seconds"), result.get("tokens_written")
        if loads and secs and written and secs > max(loads):
            out["load_target_s"] = max(loads)
            out["tok_s_steady"] = round(written / (secs - max(loads)))
    return out


def _mib(v) -> str:
    return "-" if v is None else f"{v / 1024:.1f} GiB"


def _probe_peaks(rec: dict) -> tuple[int | None, int | None, int | None]:
    probes = rec.get("probe") or []
    if not probes:
        return None, None, None
    gpu = max((p.get("gpu_peak_alloc_mib") or 0) for p in probes) or None
    anon = max((p.get("host_peak_anon_mib") or 0) for p in probes) or None
    rss = max((p.get("host_maxrss_mib") or 0) for p in probes) or None
    return gpu, anon, rss


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [f"Date (UTC): {env.get('date_utc')}; GPUs: {env.get('gpus') or 'none'}; "
             f"driver: {env.get('nvidia_smi', '-')}",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted((env.get("versions") or {}).items())),
             "", "| step | wall (s) | tokens | tok/s | peak GPU | peak host (anon / maxrss) | notes |",
             "|---|---|---|---|---|---|---|"]
    for key, rec in results.get("phases", {}).items():
        if key.startswith("error"):
            lines.append(f"| {key} | | | | | | {rec.get('error', '')[:200]} |")
            continue
        if key in ("build", "profile", "cache_bench") or key.startswith("data"):
            continue
        if "speedup_oneshot" in rec:  # the 1-vs-N GPTQ summary row
            lines.append(f"| {key} | {rec.get('speedup_wall')}x wall | | | | | oneshot {rec.get('speedup_oneshot')}x; "
                         f"identical outputs: {rec.get('identical_outputs')}; mean weight error "
                         + " vs ".join(f"{(v or {}).get('mean')}" for k, v in sorted(rec.items())
                                       if k.startswith("weight_error_")) + " |")
            continue
        gpu, anon, rss = _probe_peaks(rec)
        wall = (rec.get("stage_record") or {}).get("wall_time_s") or rec.get("wall_s") or rec.get("process_wall_s")
        notes = []
        if rec.get("cache_bytes_per_token"):
            notes.append(f"{rec['cache_bytes_per_token'] / 1024:.1f} KiB/token, {rec['cache_bytes'] / 1e9:.1f} GB")
        if rec.get("tok_s_end_to_end"):
            notes.append(f"end-to-end {rec['tok_s_end_to_end']} tok/s incl. load")
        if rec.get("tok_s_steady"):
            notes.append(f"steady {rec['tok_s_steady']} tok/s without the {rec.get('load_target_s', rec.get('engine_load_s'))} s "
                         "target load")
        if "content_hash_equal" in rec:
            notes.append(f"hash equal to 1 GPU: {rec['content_hash_equal']}; speedup {rec.get('speedup')} "
                         f"(efficiency {rec.get('scaling_efficiency')})")
        if any(p.get("gpu_shim_applied") for p in rec.get("probe") or []):
            notes.append("drafter moved to GPU by the bench shim")
        if rec.get("output_bytes"):
            notes.append(f"output {rec['output_bytes'] / 1e9:.2f} GB")
        if rec.get("rc"):
            notes.append(f"rc={rec['rc']}")
        lines.append(f"| {key} | {wall} | {rec.get('tokens') or '-'} | {rec.get('tok_s') or '-'} | {_mib(gpu)} | "
                     f"{_mib(anon)} / {_mib(rss)} | {'; '.join(notes)} |")
    prof = results.get("phases", {}).get("profile")
    if prof:
        lines += ["", f"Cache profile (batch {prof['batch']} x {prof['seq']} tokens, {prof.get('device')}):", "",
                  "| variant | s/step | tok/s |", "|---|---|---|"]
        for k in ("stock_ohs", "hooks_stop", "hooks_stop_sync", "hooks_stop_pinned"):
            if k in prof:
                lines.append(f"| {k} | {prof[k]['s_per_step']} | {prof[k]['tok_s']} |")
        lines += ["", f"D2H pageable {prof.get('d2h_pageable_GBs')} GB/s, pinned {prof.get('d2h_pinned_GBs')} GB/s; "
                  f"write+sha256+fsync {prof.get('write_sha_GBs')} GB/s; {prof.get('bytes_per_step')} bytes/step; "
                  f"bound serial {prof.get('bound_serial_tok_s')} tok/s, overlapped {prof.get('bound_overlapped_tok_s')} tok/s"]
    cb = (results.get("phases", {}).get("cache_bench") or {}).get("result")
    if cb:
        st = cb.get("setup", {})
        lines += ["", f"bench/cache_bench.py (batch {st.get('batch_size')} x {st.get('seq_len')}, "
                  f"{st.get('batches')} timed batches, {st.get('dtype')}):", "",
                  "| mode | storage | tok/s | GPU peak GiB | host RSS GiB | write GB/s |", "|---|---|---|---|---|---|"]
        for r in cb.get("results", []):
            lines.append(f"| {r.get('mode')} | {r.get('storage_dtype', '-')} | {r.get('tokens_per_s')} | "
                         f"{r.get('gpu_peak_gib', '-')} | {r.get('host_max_rss_gib')} | {r.get('write_gb_per_s', '-')} |")
    return "\n".join(lines) + "\n"


def flop_limit(shapes, seq_len: int, aux_layer_ids: list[int], peak_tflops: float = 989.0) -> int:
    """Tokens/s at the GPU's dense bf16 peak (H200: 989 TFLOP/s) for a forward that stops after the deepest
    aux layer: 2 FLOPs per weight per token for the layers run, plus causal attention (QK^T and AV over
    seq_len / 2 keys on average)."""
    h, i = shapes.hidden_size, shapes.intermediate_size
    qd, kvd = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    layers = max(aux_layer_ids)  # hidden state m is the output of decoder layer m-1
    per_layer = 2 * (h * qd + 2 * h * kvd + qd * h + 3 * h * i) + 2 * 2 * (seq_len / 2) * qd
    return round(peak_tflops * 1e12 / (layers * per_layer))
