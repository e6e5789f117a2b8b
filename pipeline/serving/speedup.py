"""serve-check's speed arithmetic (`serve.speed` on a GPU): the timed engines as rows with the speedup over the
same target alone, measured and estimated, and the fastest pair per target and batch. The timings are the
worker's (`pipeline.serving.worker_speed`); the words are `pipeline.serving.report`'s."""

from __future__ import annotations

from typing import Any

from pipeline.serving.launch import engine_words
from pipeline.serving.records import pair_key


def speed_summary(results: list[dict], summary: dict, user_tau: float | None = None) -> dict[str, Any]:
    """The timed engines as rows (target, drafter, batch): ms per step, decode tokens/s, tau of the same run,
    weight bytes, peak memory; for a pair, the same target alone's figures at the same batch and the speedup,
    measured (decode tokens/s over the target alone's) and estimated as tau x t(target alone) / t(pair) per
    step, with tau the user's (`serve.speed_tau`) or else the reference loop's for the pair (none: no estimate).
    `{"measured": false, "reason": ...}` where no engine was timed (the CPU build, or every timing failed)."""
    timed = [r for r in results if (r.get("speed") or {}).get("measured")]
    if not timed:
        reason = next(((r.get("speed") or {}).get("reason") for r in results if r.get("speed")), None)
        return {"measured": False, "reason": reason or "no engine was timed (each failed before its timing)"}
    alone = {r["job"]["target_variant"]: r for r in timed if r["job"].get("variant") is None}
    rows = []
    for r in timed:
        job, v = r["job"], r["job"].get("variant")
        key = pair_key(job["target_variant"], v, job.get("linear_backend", "auto"))
        pair = summary.get("pairs", {}).get(key) if v is not None else None
        ref = float(user_tau) if user_tau is not None else ((pair or {}).get("reference_tau") or {}).get("all")
        wb = r.get("weight_bytes") or {}
        for b, x in sorted(r["speed"]["batches"].items(), key=lambda kv: int(kv[0])):
            row = {"target": job["target_variant"], "drafter": v, "linear_backend": job.get("linear_backend", "auto"),
                   "batch": int(b), "ms_per_step": x["ms_per_step"], "ms_per_token": x["ms_per_token"],
                   "tok_s": x["tok_s"], "tau": x.get("tau"), "steps_per_seq": x.get("steps_per_seq"),
                   "weight_bytes_target": wb.get("target"), "weight_bytes_drafter": wb.get("drafter"),
                   "peak_gpu_bytes": r.get("peak_gpu_bytes"), "gpu_used_bytes": r.get("gpu_used_bytes")}
            base = ((alone.get(job["target_variant"]) or {}).get("speed") or {}).get("batches", {}).get(b)
            if v is not None and base:
                row.update(target_ms_per_step=base["ms_per_step"], target_tok_s=base["tok_s"],
                           step_overhead_ms=round(x["ms_per_step"] - base["ms_per_step"], 4),
                           speedup_measured=round(x["tok_s"] / base["tok_s"], 4))
                if ref:
                    row.update(speedup_estimated=round(float(ref) * base["ms_per_step"] / x["ms_per_step"], 4),
                               tau_estimate=round(float(ref), 4),
                               tau_estimate_source="serve.speed_tau" if user_tau is not None else "reference loop")
            rows.append(row)
    first = timed[0]
    versions = first.get("versions") or {}
    return {"measured": True, "date": first["speed"].get("date"), "versions": versions,
            "engine": engine_words(versions), "max_tokens": first["speed"].get("max_tokens"),
            "batches": sorted({row["batch"] for row in rows}), "rows": rows,
            "not_timed": sorted(r.get("name", "?") for r in results if r not in timed)}


def speed_advice(speed: dict | None) -> list[dict[str, Any]]:
    """From the timed rows: per target and batch, the drafter variant with the best speedup over the target
    alone (estimated tau x t(alone) / t(pair) where a tau is known - it weighs acceptance and step cost
    together -, else measured decode tok/s), the bf16 drafter's figures beside it, and the variants whose
    step costs more than the bf16 drafter's. Empty where nothing was timed."""
    if not (speed or {}).get("measured"):
        return []
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in speed["rows"]:
        if r["drafter"] is not None and r.get("step_overhead_ms") is not None:
            groups.setdefault((r["target"], r["batch"]), []).append(r)
    for (target, batch), rows in sorted(groups.items()):
        key = "speedup_estimated" if all(r.get("speedup_estimated") for r in rows) else "speedup_measured"
        best = max(rows, key=lambda r: (r[key], -r["ms_per_step"]))
        bf16 = next((r for r in rows if r["drafter"] == "bf16" and r["linear_backend"] == "auto"), None)
        slower = sorted(r["drafter"] for r in rows if bf16 and r is not bf16 and r["ms_per_step"] > bf16["ms_per_step"])
        out.append({"target": target, "batch": batch, "by": key, "best": best["drafter"],
                    "best_speedup": best[key], "best_overhead_ms": best["step_overhead_ms"],
                    "bf16_overhead_ms": bf16["step_overhead_ms"] if bf16 else None,
                    "bf16_speedup": bf16[key] if bf16 else None, "slower_than_bf16": slower,
                    "overheads": {r["drafter"] + ("" if r["linear_backend"] == "auto" else f" [{r['linear_backend']}]"):
                                  r["step_overhead_ms"] for r in rows}})
    return out
