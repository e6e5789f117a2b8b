"""serve-check in words: the report's section (`render`: the pair table, notes, the DFlash2 loads, the speed
table) and the card's sentences per drafter variant (`variant_status`, `status_for`, read through
`pipeline.artifacts.serve_results`). Decides nothing: every verdict is `pipeline.serving.verdict`'s."""

from __future__ import annotations

from typing import Any

from pipeline.serving.launch import engine_words
from pipeline.serving.records import ServeSummary
from pipeline.serving.speedup import speed_advice
from pipeline.serving.verdict import LOAD_PROBE_SCOPE

REPORT_BEGIN = "<!-- serve-check: begin -->"
REPORT_END = "<!-- serve-check: end -->"


def kernel_words(kernel: str | None) -> str:
    """What a vLLM linear kernel class means for the numbers measured with it."""
    if not kernel:
        return "dense"
    k = kernel.lower()
    if "emulation" in k and "wna16" in k:
        return f"{kernel} (int4 weight-only, emulated in torch: vLLM's AVX2 CPU build has no int4 GEMM)"
    if "emulation" in k:
        return f"{kernel} (emulated W4A4)"
    if "marlin" in k and "fp4" in k:
        return f"{kernel} (weight-only FP4)"
    if "marlin" in k or "machete" in k or "exllama" in k:
        return f"{kernel} (int4 weight-only)"
    if "cpuwna16" in k or "dynamic4bit" in k or "zentorch" in k:
        return f"{kernel} (int4 weight-only, CPU)"
    if "fp4" in k:
        return f"{kernel} (native FP4)"
    return kernel


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def _kv_words(summary: dict) -> str:
    """The KV cache dtype the engines ran with (serve.kv_cache_dtype), when it is not the model dtype."""
    kv = str((summary.get("settings") or {}).get("kv_cache_dtype") or "auto")
    return "" if kv == "auto" else (f" KV cache dtype `{kv}` (serve.kv_cache_dtype) for the target and the draft in "
                                    "every engine: tau and lossless above are measured under it.")


def render(summary: ServeSummary) -> str:
    """The report's serve-check section (`splice` puts it in eval/report.md)."""
    lines = _intro(summary) + _pair_table(summary) + _notes(summary) + _conclusion(summary)
    lines += render_load_probes(summary.get("load_probes") or {})
    speed = render_speed(summary.get("speed"))
    return "\n".join(lines) + "\n" + ("\n" + speed if speed else "")


def _intro(summary: ServeSummary) -> list[str]:
    v = summary.get("versions") or {}
    where = (f"vLLM {v.get('vllm')} CPU build, torch {v.get('torch')}, {v.get('cpu')} (loading, lossless decoding "
             "and the draft layers' numerics on CPU kernels; not GPU kernels or speed)" if v.get("platform") == "cpu"
             else f"vLLM {v.get('vllm')}, torch {v.get('torch')}, CUDA {v.get('cuda')}, GPU {v.get('gpu')} "
             f"(sm {v.get('capability')})")
    return ["## Served by vLLM (serve-check)", "",
            f"{where}; greedy, the evaluate stage's prompts; lossless = outputs equal the same "
            "target served alone; tau = 1 + accepted / drafts from vLLM's spec-decode counters. "
            "`ref` is the reference loop's tau (eval/results.json) for the same drafter and target."
            + _kv_words(summary), ""]


def _pair_table(summary: ServeSummary) -> list[str]:
    """The served-layout notes, one row per pair, one line per target alone."""
    lines = []
    subsets = sorted({s for p in summary["pairs"].values() for s in (p.get("tau") or {}) if s != "all"})
    head = ["target", "drafter", "drafter kernel", "loads", "lossless", "= bf16 drafter"] + [f"tau {s}" for s in subsets] + \
        ["tau all", "ref all", "vLLM - ref", "verdict"]
    for t, lay in (summary.get("served_layouts") or {}).items():
        lines += [f"Target {t}: {lay['reason']} (`pipeline/serving/layout.py`).", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in summary["pairs"].values():
        tau = p.get("tau") or {}
        ll = p.get("lossless") or {}
        diff = (p.get("tau_minus_reference") or {}).get("all")
        backend = "" if p["linear_backend"] == "auto" else f" [{p['linear_backend']}]"
        verdict = "ok" if p["ok"] else ("not loadable on this engine" if "unsupported" in p else "FAILED")
        row = [p["target"], p["variant"] + backend, kernel_words(p.get("drafter_kernel"))
               + (" [emulated on CPU]" if "drafter" in (p.get("emulated") or {}) else ""),
               "no" if p.get("error") else "yes",
               (f"{ll.get('equal')}/{ll.get('prompts')}"
                + (f" (+{len(ll['near_ties'])} near-tie)" if p.get("warnings") and ll.get("near_ties") else "")
                if ll else "-"),
               f"{ll['equal_to_bf16_drafter']}/{ll.get('prompts')}" if "equal_to_bf16_drafter" in ll else "-"] + \
            [_fmt(tau.get(s)) for s in subsets] + \
            [_fmt(tau.get("all")), _fmt((p.get("reference_tau") or {}).get("all")),
             "-" if diff is None else f"{diff:+.3f}", verdict]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for t, a in summary.get("targets_alone", {}).items():
        lines.append(f"- target `{t}` alone: {'loads' if a.get('ok') else 'does NOT load: ' + str(a.get('error'))}, "
                     f"kernel {kernel_words(a.get('kernel'))}")
    return lines


def _notes(summary: ServeSummary) -> list[str]:
    """Calibrated drafters against their base, what was emulated, what this engine cannot load, the near-ties."""
    lines = []
    comp = summary.get("pair_comparison") or []
    if comp:
        lines += ["", "Calibrated on the quantized target's hidden states vs on the bf16 target's (same recipe), "
                  "in vLLM:", "", "| drafter | calibrated on | vs | served with | tau | tau vs | difference |",
                  "|---|---|---|---|---|---|---|"]
        for r in comp:
            diff = "-" if r["difference"] is None else f"{r['difference']:+.3f}"
            lines.append(f"| {r['variant']} | {r['calibrated_on']} | {r['base']} | {r['served_with']} "
                         f"| {_fmt(r['tau'])} | {_fmt(r['tau_base'])} | {diff} |")
    said: dict[str, list[str]] = {}
    for k, p in summary["pairs"].items():
        for role, what in (p.get("emulated") or {}).items():
            said.setdefault(f"{role}: {what}", []).append(k)
    for t, a in summary.get("targets_alone", {}).items():
        for role, what in (a.get("emulated") or {}).items():
            said.setdefault(f"{role}: {what}", []).append(f"{t} alone")
    if said:
        lines += ["", "Emulated on this engine (numerics of the emulation kernel, not of a vLLM CPU kernel):", ""]
        lines += [f"- {what} - {', '.join(keys)}" for what, keys in said.items()]
    for k in summary.get("unsupported") or []:
        lines += ["", f"- `{k}`: {summary['pairs'][k]['unsupported']} - not checked here, neither passed nor failed."]
    tie_notes = _tie_notes(summary)
    if tie_notes:
        lines += ["", "Near-ties (the reference target's own fp32 logits, `serve.lossless_tie` = "
                  f"{summary.get('lossless_tie')}):", ""]
        lines += [f"- {', '.join(f'`{k}`' for k in keys)}: {w}" for w, keys in tie_notes.items()]
    if summary.get("pairing_warnings"):
        lines += ["", "Pairing warnings:", ""] + [f"- {w}" for w in summary["pairing_warnings"]]
    return lines


def _tie_notes(summary: ServeSummary) -> dict[str, list[str]]:
    """{near-tie warning: the pairs it was said of}."""
    tie_notes: dict[str, list[str]] = {}
    for k, p in summary["pairs"].items():
        for w in p.get("warnings") or []:
            tie_notes.setdefault(w, []).append(k)
    return tie_notes


def _conclusion(summary: ServeSummary) -> list[str]:
    """The failures, or the sentence saying every pair passed."""
    if summary["failures"]:
        return ["", "**Failures:**", ""] + [f"- {f}" for f in summary["failures"]]
    lossless = ("is lossless" if summary.get("require_lossless", True)
                else "runs (losslessness reported, not required: serve.require_lossless=false)")
    some = " that this engine can load" if summary.get("unsupported") else ""
    if _tie_notes(summary) and summary.get("require_lossless", True):
        lossless += " (up to the near-ties above)"
    return ["", f"Every pair{some} loads, {lossless} and keeps tau >= {summary['min_tau_ratio']} x bf16's "
            f"and >= {summary['min_tau']}."]


def render_load_probes(entries: dict[str, dict]) -> list[str]:
    """The report's DFlash2 lines: loaded by vLLM's class, no engine run (no lossless count, no tau)."""
    if not entries:
        return []
    said = next(iter(entries.values()))["said"]
    lines = ["", f"DFlash2 drafters, {said} (what this proves and what it does not: docs/serving.md):", "",
             "| drafter | modules quantized | draft block vs reference loop | verdict |", "|---|---|---|---|"]
    for v, e in entries.items():
        quantized = sorted({s for s in e["modules"].values() if s not in ("dense", "parameter")})
        fwd = e.get("forward")
        block = (f"path {'equal' if fwd['path_equal'] else 'DIFFERS'}, argmax {fwd['argmax_equal']}/{fwd['slots']}, "
                 f"logits {fwd['logits_max_rel_diff']}" if isinstance(fwd, dict) else (fwd or "-"))
        lines.append(f"| {v} | {sum(s not in ('dense', 'parameter') for s in e['modules'].values())} "
                     f"({', '.join(quantized) or 'none'}) | {block} | {'ok' if e['ok'] else 'FAILED'} |")
    return lines


def status_for(run_dir, variant: str) -> dict[str, Any]:
    """What the serve check says about one drafter variant of the run in `run_dir` (for manifests, cards and
    publish), read from `eval/serve_check.json` through its one reader (`pipeline.artifacts.serve_results`)."""
    from pathlib import Path

    from pipeline.artifacts import serve_results

    summary = serve_results.read(Path(run_dir) / serve_results.PATH)
    if summary is None:
        return {"checked": False, "summary": "not checked in vLLM (run `make vllm-cpu serve-check`, or `make serve-check` on a GPU machine)"}
    return variant_status(summary, variant)


def variant_status(summary: dict, variant: str) -> dict[str, Any]:
    """One drafter variant across the checked targets, in one sentence plus the figures."""
    v = summary.get("versions") or {}
    mine = {k: p for k, p in summary["pairs"].items() if p["variant"] == variant}
    d2 = (summary.get("load_probes") or {}).get(variant)
    if d2 is not None:
        fwd = d2.get("forward")
        words = (f"{d2['said']}; " + ("every tensor consumed, every module built as the checkpoint calls for"
                                      if d2["ok"] or not d2.get("error") else f"does not load ({d2.get('error')})"))
        if isinstance(fwd, dict):
            words += (f"; one draft block through its modules: selector path {'equal to' if fwd['path_equal'] else 'NOT equal to'}"
                      f" the reference loop's, logits within {fwd['logits_max_rel_diff']} of the largest")
        elif fwd:
            words += f"; draft block {fwd}"
        if d2.get("emulated"):
            words += f" ({d2['emulated']})"
        if not d2["ok"]:
            words += " - FAILED: " + "; ".join(d2["problems"])
        return {"checked": True, "ok": d2["ok"], "scope": LOAD_PROBE_SCOPE, "pairs": [],
                "engine": engine_words(d2.get("versions") or v), "summary": words}
    if not mine:
        return {"checked": False, "ok": None, "summary": "not checked in vLLM (not in this run's serve check)"}
    parts = []
    for p in mine.values():
        if "unsupported" in p:
            parts.append(f"with target {p['target']}: {p['unsupported']}")
            continue
        if p.get("error"):
            parts.append(f"with target {p['target']}: does not load ({p['error']})")
            continue
        ll = p.get("lossless") or {}
        parts.append(f"with target {p['target']}{'' if p['linear_backend'] == 'auto' else ' [' + p['linear_backend'] + ']'}: "
                     f"loads, lossless {ll.get('equal')}/{ll.get('prompts')}"
                     + (f" (+{len(ll['near_ties'])} near-tie of the target's logits)"
                        if p.get("warnings") and ll.get("near_ties") else "")
                     + f", tau {_fmt((p.get('tau') or {}).get('all'))}, "
                     f"{kernel_words(p.get('drafter_kernel'))}"
                     + (" (emulated on CPU)" if "drafter" in (p.get("emulated") or {}) else "")
                     + ("" if p["ok"] else " - FAILED: " + "; ".join(p["problems"])))
    run = [p for p in mine.values() if "unsupported" not in p]
    return {"checked": bool(run), "ok": all(p["ok"] for p in run) if run else None, "pairs": sorted(mine),
            "engine": engine_words(v), "summary": f"{engine_words(v)}: " + "; ".join(parts),
            **({"speed": w} if (w := variant_speed_words(summary.get("speed"), variant)) else {})}


def advice_words(a: dict) -> str:
    """One recommendation in one sentence."""
    how = "estimated speedup" if a["by"] == "speedup_estimated" else "measured speedup"
    s = (f"beside the `{a['target']}` target at batch {a['batch']}: `{a['best']}` ({how} {a['best_speedup']:.2f}x "
         f"over the target alone; step {a['best_overhead_ms']:+.2f} ms")
    if a["bf16_overhead_ms"] is not None and a["best"] != "bf16":
        s += f" vs the bf16 drafter's {a['bf16_overhead_ms']:+.2f} ms, {a['bf16_speedup']:.2f}x"
    s += ")"
    if a["slower_than_bf16"]:
        s += "; slower per step than the bf16 drafter: " + ", ".join(f"`{v}`" for v in a["slower_than_bf16"])
    return s


def variant_speed_words(speed: dict | None, variant: str) -> str | None:
    """The card's speed line for one drafter variant: its step cost and speedup per timed target and batch,
    with the fastest variant measured beside it; None where the run's serve check timed nothing."""
    if not speed:
        return None
    if not speed.get("measured"):
        return f"Speed: not measured ({speed.get('reason')})."
    v = speed.get("versions") or {}
    parts = []
    for a in speed_advice(speed):
        mine = a["overheads"].get(variant)
        if mine is None:
            continue
        row = next(r for r in speed["rows"] if r["target"] == a["target"] and r["batch"] == a["batch"]
                   and r["drafter"] == variant and r["linear_backend"] == "auto")
        words = (f"with `{a['target']}` at batch {a['batch']}: step {mine:+.2f} ms over the target alone"
                 + (f" (bf16 drafter {a['bf16_overhead_ms']:+.2f} ms)" if a["bf16_overhead_ms"] is not None
                    and variant != "bf16" else "")
                 + f", {'estimated' if a['by'] == 'speedup_estimated' else 'measured'} speedup {row[a['by']]:.2f}x")
        words += ", the fastest measured" if a["best"] == variant else f"; fastest measured: `{a['best']}` ({a['best_speedup']:.2f}x)"
        parts.append(words)
    if not parts:
        return "Speed: this variant was not timed in this run's serve check."
    return (f"Speed as served ({speed.get('date')}, {v.get('gpu')}, vLLM {v.get('vllm')}, CUDA graphs; timings of "
            f"this run's models on that GPU, nothing more): " + "; ".join(parts) + ".")


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def render_speed(speed: dict | None) -> str:
    """The report's speed section: one line where nothing was timed, else the table with its provenance."""
    if not speed:
        return ""
    lines = ["### Speed as served", ""]
    if not speed.get("measured"):
        return "\n".join(lines + [f"Not measured: {speed.get('reason')}. No figure is given.", ""])
    v = speed.get("versions") or {}
    lines += [f"Measured {speed.get('date')} on {v.get('gpu')} (sm {v.get('capability')}), vLLM {v.get('vllm')}, "
              f"torch {v.get('torch')}, CUDA {v.get('cuda')}; CUDA graphs (enforce_eager off), one engine at a time, "
              f"greedy, {speed.get('max_tokens')} tokens per sequence (ignore_eos), the run's prompts. ms/step = decode "
              "time per engine step; tok/s = decode tokens per second over the batch; tau from the same run; "
              "speedup = decode tok/s over the same target alone at the same batch; estimated = tau x "
              "t(target alone) / t(pair) per step, tau from the reference loop or serve.speed_tau. "
              "Timings of this run's models on this GPU, nothing more.", "",
              "| target | drafter | batch | ms/step | +ms vs alone | tok/s | tau | speedup | est. speedup (tau) "
              "| weights GB (target + drafter) | peak GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in speed["rows"]:
        drafter = "-" if r["drafter"] is None else r["drafter"] + ("" if r["linear_backend"] == "auto"
                                                                    else f" [{r['linear_backend']}]")
        est = "-" if r.get("speedup_estimated") is None else f"{r['speedup_estimated']:.2f}x ({r['tau_estimate']:.2f})"
        lines.append(f"| {r['target']} | {drafter} | {r['batch']} | {r['ms_per_step']:.2f} | "
                     + ("-" if r.get("step_overhead_ms") is None else f"{r['step_overhead_ms']:+.2f}") + " | "
                     f"{r['tok_s']:.1f} | {_fmt(r.get('tau'))} | "
                     + ("-" if r.get("speedup_measured") is None else f"{r['speedup_measured']:.2f}x") + f" | {est} | "
                     f"{_gb(r.get('weight_bytes_target'))} + {_gb(r.get('weight_bytes_drafter'))} | "
                     f"{_gb(r.get('peak_gpu_bytes'))} |")
    if speed.get("not_timed"):
        lines += ["", "Not timed (failed before the timing): " + ", ".join(speed["not_timed"])]
    advice = speed_advice(speed)
    if advice:
        lines += ["", f"Recommendation on {v.get('gpu')} (fastest served pair per target and batch; "
                  + ("the estimate weighs the reference loop's tau against the step cost" if all(
                      a["by"] == "speedup_estimated" for a in advice) else "measured decode tok/s")
                  + "):", ""] + [f"- {advice_words(a)}" for a in advice]
    return "\n".join(lines) + "\n"


def splice(text: str | None, section: str) -> str:
    """`text` (eval/report.md, None where there is none yet) with its serve-check section replaced by `section`."""
    text = "# Evaluation\n" if text is None else text
    if REPORT_BEGIN in text:
        head, rest = text.split(REPORT_BEGIN, 1)
        tail = rest.split(REPORT_END, 1)[1] if REPORT_END in rest else ""
        text = head.rstrip("\n") + "\n\n" + tail.lstrip("\n")
    return text.rstrip("\n") + "\n\n" + REPORT_BEGIN + "\n" + section.rstrip("\n") + "\n" + REPORT_END + "\n"
