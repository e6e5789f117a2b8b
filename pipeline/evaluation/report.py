"""The human side of the evaluation: report.md (tables) and vllm_commands.sh (reproduce on GPUs).

Both are pure functions of results.json, so the same results give the same bytes.
"""

from __future__ import annotations

import shlex

from pipeline.serving import command

REFERENCE = "bf16"


def rel_change(value: float, ref: float) -> float | None:
    return None if not ref else (value - ref) / ref


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def calibration_pairs(results: dict) -> list[tuple[str, str]]:
    """(calibrated, calibration-free) variant pairs of the same scheme."""
    info = {v: results["variants"][v] for v in results["variant_order"]}
    pairs = []
    for v, d in info.items():
        if d.get("calibration") != "none" or d.get("scheme") is None:
            continue
        for w, e in info.items():
            if e.get("scheme") == d["scheme"] and e.get("calibration") == "cache":
                pairs.append((w, v))
    return sorted(pairs + fp8_pairs(info))


# FP8 (issue 45): static per-tensor activation scales are calibrated (fp8: the search, fp8-minmax: plain minmax);
# the data-free twin is fp8-dynamic (per-token scales at run time), a scheme of its own
FP8_STATIC, FP8_DYNAMIC = "fp8", "fp8-dynamic"


def fp8_pairs(info: dict) -> list[tuple[str, str]]:
    """(calibrated, baseline) FP8 pairs on the bf16 target's states: each static variant vs the data-free dynamic
    one, and the searched scales vs plain minmax (`activation_scale` mse vs minmax)."""
    own = {v: d for v, d in info.items() if "-on-" not in v}  # drafters calibrated on another target: not paired
    static = [v for v, d in own.items() if d.get("scheme") == FP8_STATIC and d.get("calibration") == "cache"]
    dynamic = [v for v, d in own.items() if d.get("scheme") == FP8_DYNAMIC and d.get("calibration") == "none"]
    pairs = [(v, w) for v in static for w in dynamic]
    pairs += [(v, w) for v in static for w in static
              if own[v].get("activation_scale") == "mse" and own[w].get("activation_scale") == "minmax"]
    return pairs


def _tau_table(results: dict) -> list[str]:
    variants, ref = results["variant_order"], results.get("reference_variant")
    rows = [s["name"] for s in results["subsets"]] + ["all"]
    head = "| subset | " + " | ".join(f"`{v}`" for v in variants) + " |"
    lines = [head, "|" + "---|" * (len(variants) + 1)]
    for s in rows:
        cells = []
        for v in variants:
            tau = _stats(results, v, s)["tau"]
            ref_tau = _stats(results, ref, s)["tau"] if ref else None
            cells.append(f"{tau:.3f}" if v == ref or ref_tau is None else f"{tau:.3f} ({_pct(rel_change(tau, ref_tau))})")
        lines.append(f"| {'**all**' if s == 'all' else s} | " + " | ".join(cells) + " |")
    return lines


def _stats(results: dict, variant: str, subset: str) -> dict:
    d = results["variants"][variant]
    return d["overall"] if subset == "all" else d["subsets"][subset]


def _calibration_label(d: dict) -> str:
    cal = d.get("calibration") or "n/a"
    return f"{cal} ({d['activation_scale']} activation scales)" if d.get("activation_scale") else cal


def _p(x: float) -> str:
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.1e}"


def _paired_section(rows: list[dict]) -> list[str]:
    """Calibrated vs calibration-free with their uncertainty: paired top-1 (McNemar) and tau (bootstrap)."""
    if not rows:
        return []
    out = ["## Calibrated vs calibration-free, paired (is the difference more than noise?)", "",
           "Top-1 agreement with the bf16 drafter on the same held-apart rows of the quantize-drafter checks "
           "(served numerics): rows where only one variant agrees decide, exact two-sided McNemar p-value. "
           "τ: the same evaluation prompts for both, 95% paired-bootstrap interval of the difference "
           "(resampling prompts). Rounding band: the calibration-free drafter's top-1 with all its activation "
           "global scales times non-power-of-two factors, which only changes how FP8 block scales round "
           "while the data stays inside the scale's range (where it exceeds it, as massive activations exceed "
           "the fixed scale's 2688, the factors also move the clip point, so the band then also holds part of "
           "what calibration changes); "
           "the verdict is better / worse only when McNemar p < 0.05 and the calibrated top-1 lies outside "
           "that band. The calibrated drafter's own band (the same factors on its scales) is shown beside it. "
           "Weight-only schemes have no activation scale and so no band: McNemar alone decides. "
           "Layer-output error: mean over the quantized layers of ||x W_q - x W|| / ||x W|| on the held-apart "
           "rows, x = each layer's real input in the bf16 drafter (weights only; what GPTQ minimizes on its "
           "calibration rows).", "",
           "| calibrated | what is calibrated | calibration-free | rows | top-1 calibrated | top-1 calibration-free "
           "| only calibrated | only calibration-free | McNemar p | layer-output error calibrated / free "
           "| τ calibrated | τ calibration-free | Δτ [95% CI] "
           "| Δτ vs bf16: calibrated, calibration-free [95% CI] | rounding band (top-1) "
           "| calibrated's own band (top-1) | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, tau = r.get("top1_heldout"), r["tau"]
        b = tau["paired_bootstrap"]
        top = (f"{t['rows']} | {t['top1_a']:.4f} | {t['top1_b']:.4f} | {t['only_a']} | {t['only_b']} "
               f"| {_p(t['mcnemar_p'])}") if t else "n/a | n/a | n/a | n/a | n/a | n/a"
        ref = tau.get("vs_bf16_paired_bootstrap") or {}
        noise = ", ".join(_interval(ref[v]) for v in (r["calibrated"], r["calibration_free"]) if v in ref) or "n/a"
        band_txt = [f"{band['min']:.4f} - {band['max']:.4f}" if band else "n/a"
                    for band in (r.get("top1_rounding_band"), r.get("top1_rounding_band_calibrated"))]
        errs = r.get("layer_output_error_heldout") or {}
        e_cal, e_free = ((errs.get(v) or {}).get("mean") for v in (r["calibrated"], r["calibration_free"]))
        err_txt = f"{e_cal:.4f} / {e_free:.4f}" if e_cal is not None and e_free is not None else "n/a"
        top = top.replace(f"| {_p(t['mcnemar_p'])}", f"| {_p(t['mcnemar_p'])} | {err_txt}") if t else top + " | n/a"
        out.append(f"| `{r['calibrated']}` | {r.get('what_is_calibrated') or 'n/a'} | `{r['calibration_free']}` | {top} "
                   f"| {tau['calibrated']:.3f} "
                   f"| {tau['calibration_free']:.3f} | {_interval(b)} | {noise} | {band_txt[0]} | {band_txt[1]} "
                   f"| **{r.get('verdict', 'n/a')}** |")
    return out + [""]


def pair_matrix_section(results: dict) -> list[str]:
    """Each target x the drafters paired with it (`eval.pairs`; τ per subset, lossless), the pairing warnings, and
    the paired result of calibrating on a quantized target's states vs the bf16 target's."""
    pairs = results.get("pairs") or {}
    matrix = pairs.get("matrix") or {}
    if len(matrix) < 2:
        return []
    targets = list(matrix)
    subsets = [x["name"] for x in results["subsets"]] + ["all"]
    every = all(v in matrix[t] for t in targets for v in matrix[targets[0]])
    out = [f"## The served pair: {'every target x every drafter' if every else 'each target x the drafters paired with it'}",
           "",
           "τ of each drafter variant with each target variant of the run (the target greedy-decodes as it is "
           "served: quantized targets dequantized, W4A4 inputs fake-quantized), per subset; `calibrated on` is the "
           "target whose cached hidden states calibrated the drafter (`data-free`: none did; `-`: no record, as for "
           "the bf16 reference). lossless = the "
           "speculative output equals that target's own greedy output on every prompt. Heatmap: "
           "`pair_matrix.png`.", "",
           "| drafter | calibrated on | " + " | ".join(f"{t}: {s}" for t in targets for s in subsets)
           + " | lossless |", "|" + "---|" * (2 + len(targets) * len(subsets) + 1)]
    for v in matrix[targets[0]]:
        cells = []
        for t in targets:
            d = matrix[t].get(v)
            cells += [f"{(d['overall'] if s == 'all' else d['subsets'][s])['tau']:.3f}" if d else "n/a" for s in subsets]
        ok = all(n == 0 for t in targets for n in (matrix[t].get(v) or {}).get("lossless_mismatches", {}).values())
        out.append(f"| `{v}` | {matrix[targets[0]][v].get('calibration_target') or '-'} | " + " | ".join(cells)
                   + f" | {'yes' if ok else '**no**'} |")
    if not every:
        out += ["", "`n/a`: not evaluated. With `eval.pairs=calibrated` a quantized target is evaluated with the "
                "drafters calibrated on it, their bf16-calibrated recipes, bf16 and the `eval.pairs_every_target` "
                "drafters; `eval.pairs=all` evaluates every pair."]
    out.append("")
    comp = pairs.get("comparison") or []
    if comp:
        out += ["### Calibrated on the quantized target's hidden states vs on the bf16 target's", "",
                "The same recipe, calibrated on each target's cached states; τ over the same prompts, 95% paired "
                "bootstrap interval of the difference (resampling prompts); better / worse only when the interval "
                "excludes 0.", "",
                "| drafter | calibrated on | vs (calibrated on bf16) | served with | τ | τ vs | Δτ [95% CI] | verdict |",
                "|---|---|---|---|---|---|---|---|"]
        for r in comp:
            out.append(f"| `{r['variant']}` | {r['calibrated_on']} | `{r['base']}` | {r['served_with']} "
                       f"| {r['tau']:.3f} | {r['tau_base']:.3f} | {_interval(r['paired_bootstrap'])} "
                       f"| **{r['verdict']}** |")
        out.append("")
    warned = pairs.get("warnings") or {}
    if warned:
        out += ["### Pairing warnings", ""] + [f"- {w}" for t in targets for w in (warned.get(t) or {}).values()] + [""]
    return out


# "which variant should I ship?": a rule a user can read, applied to this run's numbers
SHIP_MIN_TAU_RATIO = 0.95  # a candidate keeps at least this share of the bf16 drafter's tau with the same target
SHIP_TIE = 0.01  # candidates within 1% of the best tau are named together (60-prompt runs resolve ~1-2%)
FP8_SCHEMES = ("fp8", "fp8-dynamic", "fp8-block")  # W8A8 E4M3 (vLLM CompressedTensorsW8A8Fp8, sm 89+)
# (GPU generation, candidate schemes, why, FP8 first: an FP8 candidate within SHIP_TIE of the best is shipped)
GPU_GENERATIONS = (
    ("Blackwell (sm 100+, FP4 and FP8 tensor cores)", ("nvfp4", "nvfp4a16", "w4a16") + FP8_SCHEMES,
     "NVFP4 runs natively there, W4A4 included, and FP8 W8A8 too", False),
    ("Hopper / Ada (sm 89-90, FP8 tensor cores)", ("nvfp4a16", "w4a16") + FP8_SCHEMES,
     "FP8 W8A8 is the format their tensor cores run, so an FP8 variant within 1% of the best is shipped first; "
     "vLLM serves every NVFP4 checkpoint weight-only there (Marlin), so a W4A4 variant's calibrated activation "
     "scales never reach it: of the 4-bit variants only weight-only ones are candidates", True),
    ("Ampere (sm 80-86)", ("nvfp4a16", "w4a16"),
     "no FP8 or FP4 tensor cores: vLLM serves FP8 and NVFP4 checkpoints weight-only there (Marlin), so only the "
     "weight-only 4-bit variants are candidates", False),
)


def ship_rule() -> str:
    return (f"A variant is a candidate on a GPU generation when that GPU runs its format as measured here, it is "
            f"lossless with the target (the speculative output equals the target's own greedy output on every "
            f"prompt), and it keeps at least {SHIP_MIN_TAU_RATIO:.0%} of the `bf16` drafter's τ (all prompts) with "
            f"that target. Ship the candidate with the highest τ; candidates within {SHIP_TIE:.0%} of it are named "
            f"too (a tie at this run's prompt count: choose the data-free one, which needs no calibration run, or "
            f"the one your serving stack already uses). On Hopper / Ada, whose tensor cores run FP8, an FP8 "
            f"candidate (fp8, fp8-dynamic, fp8-block) within {SHIP_TIE:.0%} of the best τ is shipped instead "
            f"(the best such one); FP8 is no candidate on Ampere, which serves it weight-only.")


def recommend(results: dict) -> list[dict]:
    """Per GPU generation x target variant of the run: {gpu, target, ship, ties, tau, ratio, why} (ship None when
    no variant qualifies). Pure: the same results give the same answer."""
    matrix = (results.get("pairs") or {}).get("matrix") or {}
    if not matrix:
        matrix = {results["target"]["variant"]: results["variants"]}
    out = []
    for gpu, schemes, note, fp8_first in GPU_GENERATIONS:
        for t, row in matrix.items():
            ref = (row.get(REFERENCE) or {}).get("overall", {}).get("tau")
            cands = []
            for v, d in row.items():
                info = results["variants"].get(v) or {}
                if v in (REFERENCE, "source", "baseline") or info.get("scheme") not in schemes:
                    continue
                tau = d["overall"]["tau"]
                lossless = all(n == 0 for n in (d.get("lossless_mismatches") or {}).values())
                if lossless and (not ref or tau >= SHIP_MIN_TAU_RATIO * ref):
                    cands.append((tau, v))
            cands.sort(key=lambda x: (-x[0], x[1]))
            if not cands:
                out.append({"gpu": gpu, "target": t, "ship": None, "ties": [], "tau": None, "ratio": None,
                            "why": note})
                continue
            best_tau, best = cands[0]
            if fp8_first:  # the best FP8 candidate within the tie band of the best one goes first
                fp8 = [(tau, v) for tau, v in cands if (results["variants"].get(v) or {}).get("scheme") in FP8_SCHEMES
                       and tau >= (1 - SHIP_TIE) * best_tau]
                if fp8:
                    cands = fp8[:1] + [c for c in cands if c != fp8[0]]
                    best_tau, best = cands[0]
            top = max(tau for tau, _ in cands)
            ties = [v for tau, v in cands[1:] if tau >= (1 - SHIP_TIE) * top]
            out.append({"gpu": gpu, "target": t, "ship": best, "ties": ties, "tau": best_tau,
                        "ratio": best_tau / ref if ref else None, "why": note})
    return out


def recommendation_section(results: dict) -> list[str]:
    rows = recommend(results)
    if not rows:
        return []
    out = ["## Which variant to ship", "", ship_rule(), "",
           "| GPU generation | served with target | ship | τ (all) | vs `bf16` drafter | also within 1% | why these "
           "candidates |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["ship"] is None:
            out.append(f"| {r['gpu']} | {r['target']} | none qualifies: keep the `bf16` drafter | - | - | - "
                       f"| {r['why']} |")
            continue
        ratio = "n/a" if r["ratio"] is None else _pct(r["ratio"] - 1)
        ties = ", ".join(f"`{v}`" for v in r["ties"]) or "-"
        out.append(f"| {r['gpu']} | {r['target']} | **`{r['ship']}`** | {r['tau']:.3f} | {ratio} | {ties} "
                   f"| {r['why']} |")
    out += ["", "Caveats: τ is measured here by the reference loop (`serve-check`, when run, appends vLLM's own τ "
            "below; a variant it fails is not shippable whatever this table says); speed is not part of the rule "
            "(where serve-check timed the engines on a GPU, `serve.speed=true`, its speed section below names the "
            "fastest pair per target and batch; the H200 figures at 8B shapes are in docs/benchmarks.md); on the "
            "tiny world the differences are a few percent and depend on the CPU the run was made on.", ""]
    return out


def _interval(b: dict) -> str:
    return f"{b['difference']:+.3f} [{b['ci95'][0]:+.3f}, {b['ci95'][1]:+.3f}]"


def render_report(results: dict) -> str:
    ref = results.get("reference_variant")
    t, dr = results["target"], results["drafter"]
    out = [f"# Acceptance length: {dr['name']} drafter variants", "",
           f"Target `{t['name']}` as **{t['variant']}** (`{t['path']}`); greedy decoding (temperature 0), "
           f"block size {results['block_size']} ({results['block_size'] - 1} draft tokens per step), "
           f"at most {results['max_new_tokens']} new tokens per prompt. "
           "τ = mean over verification steps of (accepted draft tokens + 1).", ""]
    out += ["## τ per subset (relative change vs `bf16`)" if ref else "## τ per subset", ""]
    out += _tau_table(results) + [""]
    out += recommendation_section(results)
    pairs = calibration_pairs(results)
    if pairs:
        out += ["## Calibrated vs calibration-free", "",
                "| scheme | calibrated | calibration-free | subset | τ calibrated | τ calibration-free | change |",
                "|---|---|---|---|---|---|---|"]
        for cal, free in pairs:
            for s in [x["name"] for x in results["subsets"]] + ["all"]:
                a, b = _stats(results, cal, s)["tau"], _stats(results, free, s)["tau"]
                out.append(f"| {results['variants'][cal]['scheme']} | `{cal}` | `{free}` | {s} | {a:.3f} | {b:.3f} "
                           f"| {_pct(rel_change(a, b))} |")
        out.append("")
    out += _paired_section(results.get("calibration_comparison") or [])
    out += pair_matrix_section(results)
    out += ["## Tokens and per-position acceptance", "",
            "| variant | subset | steps | drafted | accepted | acceptance rate | P(accept) by position 1.."
            f"{results['block_size'] - 1} |", "|---|---|---|---|---|---|---|"]
    for v in results["variant_order"]:
        for s in [x["name"] for x in results["subsets"]]:
            st = _stats(results, v, s)
            pos = " ".join(f"{p:.2f}" for p in st["position_acceptance"])
            out.append(f"| `{v}` | {s} | {st['steps']} | {st['drafted_tokens']} | {st['accepted_tokens']} "
                       f"| {st['acceptance_rate']:.3f} | {pos} |")
    out += ["", "## What each variant is", "", "| variant | scheme | calibration | activations quantized | "
            "dense (ignored) layers |", "|---|---|---|---|---|"]
    for v in results["variant_order"]:
        d = results["variants"][v]
        q = d["quantization"]
        out.append(f"| `{v}` | {d.get('scheme') or ('none' if not q.get('quantized') else 'unknown')} "
                   f"| {_calibration_label(d)} | {'yes' if q.get('activations_quantized') else 'no'} "
                   f"| {', '.join(f'`{i}`' for i in q.get('ignore', [])) or '-'} |")
    if "source" in results["variants"]:
        out += ["", f"`source` is the drafter as configured (`{results['variants']['source']['path']}`), before the "
                "bf16 rounding of the `bf16` reference checkpoint."]
    if "baseline" in results["variants"]:
        out += ["", f"`baseline` is another drafter of the same target, evaluated beside this run's on the same prompts "
                f"(`{results['variants']['baseline']['path']}`, `eval.baseline_drafter`)."]
    out += ["", "Quantized drafters run as their checkpoints specify: weights dequantized from the "
            "compressed-tensors tensors, and for W4A4 schemes every quantized Linear's input fake-quantized "
            "at run time (per token, groups of 16, FP8 block scales from the calibrated global scale), as vLLM does.",
            "", "Files: `results.json` (all numbers, config, checkpoint hashes), `tau_per_subset.png`, "
            "`acceptance_per_position.png`, `calibration_vs_datafree.png`, `pair_matrix.png`, `vllm_commands.sh` (reproduce with vLLM on GPUs). Wall times of "
            "this machine are in `timings.json` (they vary run to run, so they are kept out of this report).", ""]
    return "\n".join(out)


def _fn(prefix: str, name: str) -> str:
    return f"{prefix}_{name.replace('-', '_').replace('.', '_')}"


def render_vllm_commands(results: dict, prompt_files: dict[str, str]) -> str:
    """Serve command per drafter variant and one `vllm bench serve` per subset, as a runnable script."""
    t = results["target"]
    k = results["block_size"] - 1
    variants, subsets = results["variant_order"], [s["name"] for s in results["subsets"]]
    lines = ["#!/usr/bin/env bash",
             "# Reproduce this evaluation with vLLM on GPUs (greedy, temperature 0):",
             "#   ./vllm_commands.sh serve <variant>     # in one shell: the target with that drafter",
             "#   ./vllm_commands.sh bench <subset>      # in another: one benchmark per subset",
             "# vLLM reports the acceptance length (accepted tokens / drafts + 1) per benchmark.",
             "# Paths are those of this run; use Hub ids instead once the variants are published.",
             "set -euo pipefail", "", f"TARGET={shlex.quote(t['serve_path'])}", "PORT=${PORT:-8000}", ""]
    for v in variants:
        d = results["variants"][v]
        # the run's one serving command (pipeline.serving.command), then the port the benchmarks use
        serve = command.serve_command("$TARGET", d["path"], k, bool(d["quantization"].get("quantized")),
                                      t.get("revision"), variables=("TARGET",))
        lines += [f"{_fn('serve', v)}() {{  # drafter variant {v}", f"  {serve} \\", '    --port "$PORT"', "}", ""]
    for s in results["subsets"]:
        lines += [f"{_fn('bench', s['name'])}() {{  # subset {s['name']}, {s['num_prompts']} prompts",
                  "  vllm bench serve --model \"$TARGET\" --port \"$PORT\" --backend openai-chat "
                  "--endpoint /v1/chat/completions \\",
                  f"    --dataset-name custom --dataset-path {shlex.quote(prompt_files[s['name']])} "
                  f"--num-prompts {s['num_prompts']} --disable-shuffle \\",
                  f"    --custom-output-len {results['max_new_tokens']} --temperature 0 --max-concurrency 1 "
                  f"--label {shlex.quote(s['name'])}",
                  "}", ""]
    lines += ['case "${1:-}:${2:-}" in']
    lines += [f"  serve:{v}) {_fn('serve', v)} ;;" for v in variants]
    lines += [f"  bench:{s}) {_fn('bench', s)} ;;" for s in subsets]
    lines += [f'  *) echo "usage: $0 serve <{"|".join(variants)}> | bench <{"|".join(subsets)}>" >&2; exit 2 ;;',
              "esac", ""]
    return "\n".join(lines)


def with_vllm_ranges(text: str, ranges: dict[str, dict | None]) -> str:
    """vllm_commands.sh with a comment, above its first command, naming the vLLM range each drafter variant was
    written for (quant.vllm) or saying that none is recorded."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if i and not line.startswith("#")), len(lines))
    note = ["# The vLLM range each drafter was written and checked for (quant.vllm, pipeline/serving/contract.py):"]
    note += [f"#   {v}: " + (f"vLLM {r['versions']} (profile {r['profile']})" if r and r.get("versions") else
                              "not recorded (no quantize-drafter record names one)")
             for v, r in ranges.items()]
    return "\n".join(lines[:at] + note + lines[at:])


def tau_table(results: dict, reference: str = REFERENCE) -> list[dict]:
    """Flat rows {variant, subset, tau, relative_to_bf16} (what the model card reads); subset "all" included."""
    ref = results["variants"].get(reference)
    rows = []
    for v in results["variant_order"]:
        d = results["variants"][v]
        for s, st in [*d["subsets"].items(), ("all", d["overall"])]:
            base = (ref["overall"] if s == "all" else ref["subsets"][s])["tau"] if ref else None
            change = rel_change(st["tau"], base) if base is not None and v != reference else None
            rows.append({"variant": v, "subset": s, "tau": st["tau"],
                         "relative_to_bf16": None if change is None else round(change, 6)})
    return rows
