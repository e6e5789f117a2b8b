"""Stage `evaluate`: acceptance length per subset for the bf16 drafter and every quantized variant.

Recipe: check the request (variants, target, prompt sets) -> load the target as served (dense or
dequantized) -> per drafter variant, run the greedy speculative loop over every prompt of every
subset -> write eval/results.json, timings.json, report.md, the plots, vllm_commands.sh and the
prompts the vLLM benchmark commands read. Quantized drafters run as their checkpoints specify
(pipeline.evaluation.fakequant).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import check_report, eval_results
from pipeline.artifacts.rundir import RunDir
from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, dumps_json, hash_tree, sha256_text
from pipeline.quant import pairing

REFERENCE = "bf16"
SOURCE = "source"
BASELINE = "baseline"  # eval.baseline_drafter: another drafter of the same target, in the main table beside the run's


def _drafter_dirs(cfg, rd: RunDir) -> dict[str, Path]:
    """{variant: checkpoint dir}: the run's drafters, the bf16 reference falling back to drafter.path."""
    found = {v: rd.drafter(v) for v in rd.drafter_variants()}
    source = Path(cfg.drafter.path)
    if REFERENCE not in found and source.is_dir():  # no quantize-drafter run yet: the given drafter is the reference
        found[REFERENCE] = source
    elif cfg.eval.include_source and source.is_dir() and source.resolve() != found[REFERENCE].resolve():
        found[SOURCE] = source  # the drafter as given, to compare with its own tau measurement
    if cfg.eval.baseline_drafter:
        base = Path(cfg.eval.baseline_drafter)
        if not (base / "config.json").is_file():
            raise bad_value("eval.baseline_drafter", str(base), "it is not a drafter checkpoint directory (no config.json)",
                            "name a local drafter folder, e.g. assets/tiny/drafter, or set it to null")
        found[BASELINE] = base
    wanted = list(cfg.eval.variants or [])
    unknown = [v for v in wanted if v not in found]
    if unknown:
        raise bad_value("eval.variants", wanted, f"{unknown} not found in {rd.root / 'drafter'} (have {sorted(found)})",
                        "run quantize-drafter for them first or drop them from the list")
    chosen = wanted or sorted(found)
    if not chosen:
        raise bad_value("run_dir", str(rd.root), "it holds no drafter checkpoint to evaluate",
                        "run `make quantize-drafter` first")
    if BASELINE in found and BASELINE not in chosen:
        chosen = [*chosen, BASELINE]
    first = [v for v in (SOURCE, REFERENCE, BASELINE) if v in chosen]
    order = first + sorted(v for v in chosen if v not in first)
    return {v: found[v] for v in order}


def _target_path(cfg, rd: RunDir) -> str:
    variant = cfg.eval.target_variant
    if variant == REFERENCE:
        return str(cfg.target.path)
    if variant not in rd.target_variants():
        raise bad_value("eval.target_variant", variant, f"no quantized target {rd.target(variant)} in this run "
                        f"(have {rd.target_variants() or 'none'})", "run quantize-target for it or use bf16")
    return str(rd.target(variant))


def _variant_meta(rd: RunDir, variant: str, summary: dict) -> dict[str, Any]:
    """Scheme and calibration from the quantize-drafter stage record (`pipeline.artifacts.stage_record`); a
    quantized drafter without one (not made by this run's quantize-drafter) has its scheme read off the
    checkpoint and no calibration setting: nothing records one, so it is in no calibrated vs calibration-free pair."""
    q = summary["quantization"]
    if not q.get("quantized"):
        return {"scheme": None, "calibration": None}
    from pipeline.artifacts.stage_record import load_record

    record = load_record(rd.root, f"quantize-drafter-{variant}")
    if record is not None:
        quant = record.config("quant")
        cal = quant.get("calibration")
        method = quant.get("activation_scale") if cal == "cache" and q.get("activations_quantized") else None
        algo = quant.get("algorithm")
        from pipeline.quant.recipes import DATA_OBSERVERS

        observer = str(quant.get("observer") or "")
        data_obs = observer.strip().lower().replace("_", "-") in DATA_OBSERVERS
        parts = ([f"weights ({algo})"] if cal == "cache" and algo == "gptq" else []) + \
            ([f"weights ({observer} observer)"] if cal == "cache" and algo != "gptq" and data_obs else []) + \
            ([f"activation scale ({method})"] if method else [])
        return {"scheme": quant.get("scheme"), "calibration": cal, "activation_scale": method,
                "algorithm": algo, "what_is_calibrated": " + ".join(parts) or "nothing (data-free)"}
    from pipeline.models.checkpoint_info import scheme_of  # the one parser of a quantization_config's scheme

    return {"scheme": scheme_of(q), "calibration": None, "activation_scale": None}


def _stop_ids(tokenizer, target) -> list[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def _sync(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def subset_stats(results: list, block_size: int) -> dict[str, Any]:
    """Aggregate `SpecResult`s: tau over all steps, drafted/accepted tokens, per-position acceptance."""
    taus = [t for r in results for t in r.acceptance_lengths]
    drafted = [sum(r.drafted[k] for r in results) for k in range(block_size - 1)]
    accepted = [sum(r.accepted[k] for r in results) for k in range(block_size - 1)]
    steps = len(taus)
    return {"steps": steps, "tau": round(sum(taus) / steps, 6) if steps else 0.0,
            "drafted_tokens": sum(drafted), "accepted_tokens": sum(accepted),
            "acceptance_rate": round(sum(accepted) / sum(drafted), 6) if sum(drafted) else 0.0,
            "position_acceptance": [round(a / d, 6) if d else 0.0 for a, d in zip(accepted, drafted)],
            "tau_histogram": {str(k): taus.count(k) for k in range(1, block_size + 1)},
            "generated_tokens": sum(len(r.output_ids) for r in results)}


def tau_table(results: dict) -> list[dict]:
    """Flat rows {variant, subset, tau, relative_to_bf16} (what the model card reads); subset "all" included."""
    from pipeline.evaluation.report import rel_change

    ref = results["variants"].get(REFERENCE)
    rows = []
    for v in results["variant_order"]:
        d = results["variants"][v]
        for s, st in [*d["subsets"].items(), ("all", d["overall"])]:
            base = (ref["overall"] if s == "all" else ref["subsets"][s])["tau"] if ref else None
            change = rel_change(st["tau"], base) if base is not None and v != REFERENCE else None
            rows.append({"variant": v, "subset": s, "tau": st["tau"],
                         "relative_to_bf16": None if change is None else round(change, 6)})
    return rows


def calibration_comparison(rd: RunDir, results: dict, per_prompt: dict, seed: int) -> list[dict]:
    """Calibrated vs calibration-free variant of one scheme, paired: top-1 agreement with bf16 on the
    same held-apart rows (from both drafter checks, exact McNemar test) and tau over the same prompts
    (paired bootstrap, seeded)."""
    from pipeline.evaluation.report import calibration_pairs
    from pipeline.quant import paired

    out = []
    for cal, free in calibration_pairs(results):
        loaded = {v: check_report.load_report(rd.checks, "drafter", v) for v in (cal, free)}
        reports = {v: r for v, r in loaded.items() if r is not None}
        top1 = paired.paired_top1(reports[cal], reports[free]) if len(reports) == 2 else None
        tau = paired.bootstrap_ratio_difference(per_prompt[cal], per_prompt[free], seed)
        # the same interval for each against the bf16 drafter: how far pure quantization noise moves tau
        vs_ref = {v: paired.bootstrap_ratio_difference(per_prompt[v], per_prompt[REFERENCE], seed)
                  for v in (cal, free)} if REFERENCE in per_prompt else {}
        band = rounding_noise(reports.get(free))
        band_cal = rounding_noise(reports.get(cal))  # shown beside it: the calibrated scales' own lottery
        out_err = {v: (r.layer_output_error_summary or None) for v, r in reports.items()}
        out.append({"calibrated": cal, "calibration_free": free, "scheme": results["variants"][cal]["scheme"],
                    "what_is_calibrated": results["variants"][cal].get("what_is_calibrated"),
                    "layer_output_error_heldout": out_err,
                    "activation_scale": results["variants"][cal].get("activation_scale"),
                    "top1_heldout": top1, "kl_heldout": {v: r.served.kl if r.served else None
                                                         for v, r in reports.items()},
                    "top1_rounding_band": band, "top1_rounding_band_calibrated": band_cal,
                    "verdict": verdict(top1, band),
                    "tau": {"calibrated": results["variants"][cal]["overall"]["tau"],
                            "calibration_free": results["variants"][free]["overall"]["tau"],
                            "paired_bootstrap": tau, "vs_bf16_paired_bootstrap": vs_ref}})
    return out


def rounding_noise(report: check_report.DrafterCheck | None) -> dict | None:
    """A variant's served top-1 over its rounding-band draws (its scales times non-power-of-two
    factors, the served_rounding_band of pipeline.quant.drafter_checks.compare) and at its own scales."""
    band = report.served_rounding_band if report is not None else None
    if band is None or report.served is None:
        return None
    draws = [*band.top1_agreement, report.served.top1_agreement]
    return {"factors": [*band.factors, 1.0], "top1": draws, "min": min(draws), "max": max(draws),
            "width": max(draws) - min(draws)}


def verdict(top1: dict | None, band: dict | None, alpha: float = 0.05) -> str:
    """better / worse only when the paired test rejects "no difference" at `alpha` AND the calibrated
    top-1 lies outside every rounding-lottery draw of the calibration-free scales; else within noise.
    Weight-only pairs (no activation scale, so no rounding band): the paired test alone decides."""
    if not top1:
        return "not measured"
    if not band:
        if top1["mcnemar_p"] < alpha:
            return "better" if top1["top1_a"] > top1["top1_b"] else "worse"
        return "within noise"
    significant = top1["mcnemar_p"] < alpha
    if significant and top1["top1_a"] > band["max"]:
        return "better"
    if significant and top1["top1_a"] < band["min"]:
        return "worse"
    return "within noise"


def _matrix_targets(cfg, rd: RunDir, primary: str) -> dict[str, str]:
    """{target variant: path} of the pair matrix (the main table's target first)."""
    have = [REFERENCE, *rd.target_variants()]
    wanted = [str(t) for t in cfg.eval.targets] or have
    unknown = [t for t in wanted if t not in have]
    if unknown:
        raise bad_value("eval.targets", wanted, f"{unknown} is not a target of this run (have {have})",
                        "run quantize-target for it first or drop it from the list")
    order = [primary, *[t for t in wanted if t != primary]]
    return {t: str(cfg.target.path) if t == REFERENCE else str(rd.target(t)) for t in order}


def _matrix_drafters(drafters: dict) -> list[str]:
    """Every drafter variant of the run (the drafter as given, `source`, and the `baseline` drafter only in the
    main table)."""
    return [v for v in drafters if v not in (SOURCE, BASELINE)]


def _pair_entry(d: dict, rd: RunDir, variant: str) -> dict:
    from pipeline.quant import pairing

    brief = ("tau", "steps", "acceptance_rate", "position_acceptance")
    rec = pairing.drafter_record(rd, variant)  # None: no record (the bf16 reference, the drafter as given)
    return {"calibration_target": None if rec is None else rec["variant"] if rec.get("used") else "data-free",
            "subsets": {s: {k: st[k] for k in brief} for s, st in d["subsets"].items()},
            "overall": {k: d["overall"][k] for k in brief}, "lossless_mismatches": dict(d["lossless_mismatches"])}


def pair_comparison(rd: RunDir, matrix: dict, per_prompt: dict, seed: int) -> list[dict]:
    """A drafter calibrated on a quantized target's states vs the same recipe calibrated on the bf16
    target's, paired over the same prompts with each target (95% paired-bootstrap interval of Δτ)."""
    from pipeline.quant import paired, pairing

    out = []
    drafters = next(iter(matrix.values()), {})
    for v in drafters:
        rec = pairing.drafter_record(rd, v)
        base = pairing.base_variant(v, rec)
        if base is None or base not in drafters:
            continue
        for t in matrix:
            b = paired.bootstrap_ratio_difference(per_prompt[t][v], per_prompt[t][base], seed)
            lo, hi = b["ci95"]
            out.append({"variant": v, "calibrated_on": rec["variant"], "base": base, "served_with": t,
                        "tau": matrix[t][v]["overall"]["tau"], "tau_base": matrix[t][base]["overall"]["tau"],
                        "paired_bootstrap": b,
                        "verdict": "better" if lo > 0 else "worse" if hi < 0 else "within noise"})
    return out


def _merge(per_subset: dict[str, list], block_size: int) -> dict:
    return subset_stats([r for rs in per_subset.values() for r in rs], block_size)


def _evaluate_variant(target, drafter, subsets, max_new_tokens, stop, device, greedy, desc):
    from tqdm import tqdm

    from pipeline.models.spec_decode import spec_generate

    runs, seconds, mismatches = {}, {}, {}
    bar = tqdm(total=sum(len(s.prompts) for s in subsets), desc=desc, unit="prompt")
    for s in subsets:
        runs[s.name], seconds[s.name], mismatches[s.name] = [], 0.0, 0
        for i, ids in enumerate(s.prompts):
            _sync(device)
            t0 = time.perf_counter()
            r = spec_generate(target, drafter, ids, max_new_tokens, stop)
            _sync(device)
            seconds[s.name] += time.perf_counter() - t0
            mismatches[s.name] += int(r.output_ids != greedy[s.name][i])
            runs[s.name].append(r)
            bar.update(1)
    bar.close()
    return runs, seconds, mismatches


def _greedy_reference(target, subsets, max_new_tokens, stop, device):
    """Plain target greedy outputs (the lossless reference) and their wall time per subset."""
    from tqdm import tqdm

    from pipeline.models.spec_decode import greedy_generate

    outs, seconds = {}, {}
    bar = tqdm(total=sum(len(s.prompts) for s in subsets), desc="target only", unit="prompt")
    for s in subsets:
        outs[s.name], seconds[s.name] = [], 0.0
        for ids in s.prompts:
            _sync(device)
            t0 = time.perf_counter()
            outs[s.name].append(greedy_generate(target, ids, max_new_tokens, stop))
            _sync(device)
            seconds[s.name] += time.perf_counter() - t0
            bar.update(1)
    bar.close()
    return outs, seconds


def _config_record(cfg) -> dict:
    from omegaconf import OmegaConf

    from pipeline.core.secrets import scrub_obj

    full = OmegaConf.to_container(cfg, resolve=True)
    return scrub_obj({k: full[k] for k in ("run_name", "seed", "target", "drafter", "eval")})


def _tree(path: str | Path) -> dict | None:
    p = Path(path)
    return {k: v["sha256"] for k, v in hash_tree(p).items()} if p.is_dir() else None


def _vllm_ranges(rd: RunDir, variants) -> dict[str, dict | None]:
    """{variant: the vLLM range its checkpoint is written for} from each quantize-drafter record's `vllm`
    (pipeline.serving.contract.Profile.record); None where no record says (the bf16 reference, a given drafter)."""
    from pipeline.artifacts.stage_record import load_record

    out = {}
    for v in variants:
        record = load_record(rd.root, f"quantize-drafter-{v}")
        out[v] = record.result.get("vllm") if record is not None else None
    return out


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


def _write_outputs(out: Path, doc: eval_results.EvalResults, timings: dict, subsets,
                   ranges: dict[str, dict | None] | None = None) -> list[str]:
    from pipeline.evaluation import plots, report

    results = doc.to_json()

    prompt_files = {}
    for stale in sorted((out / "prompts").glob("*.jsonl")):
        if stale.stem not in {s.name for s in subsets}:
            stale.unlink()
    for s in subsets:
        rel = f"prompts/{s.name}.jsonl"
        atomic_write_text(out / rel, "".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\n" for t in s.texts))
        prompt_files[s.name] = str(out / rel)
    eval_results.write_results(out, doc)
    atomic_write_json(out / "timings.json", timings)
    atomic_write_text(out / "report.md", report.render_report(results))
    eval_results.write_vllm_commands(out, with_vllm_ranges(report.render_vllm_commands(results, prompt_files),
                                                           ranges or {v: None for v in results["variant_order"]}))
    plots.tau_bars(results, out / "tau_per_subset.png")
    plots.acceptance_curves(results, out / "acceptance_per_position.png")
    plots.calibration_pairs(results, out / "calibration_vs_datafree.png")
    plots.pair_matrix(results, out / "pair_matrix.png")
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def run(cfg) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.core.dtypes import TORCH_DTYPES
    from pipeline.core.seeding import seed_everything
    from pipeline.evaluation.fakequant import load_drafter_variant, load_target
    from pipeline.evaluation.prompts import load_prompt_sets
    from pipeline.models.compat import check_compatible
    from pipeline.models.formats import load_drafter_config

    rd = RunDir.from_cfg(cfg)
    if cfg.target.dtype not in TORCH_DTYPES:
        raise bad_value("target.dtype", cfg.target.dtype, "unknown dtype", f"use one of {', '.join(TORCH_DTYPES)}")
    if int(cfg.eval.max_new_tokens) < 1:
        raise bad_value("eval.max_new_tokens", cfg.eval.max_new_tokens, "it must be positive", "use a value >= 1")
    drafters = _drafter_dirs(cfg, rd)
    target_path = _target_path(cfg, rd)
    from pipeline.models import validation

    # every field of the target's and each drafter's family against their tensors' headers (issue 47)
    validation.check_target(target_path, cfg.target.revision if cfg.eval.target_variant == REFERENCE else None)
    for p in drafters.values():
        validation.check_drafter(p)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target.tokenizer or cfg.target.path,
                                              revision=cfg.target.revision if not cfg.target.tokenizer else None)
    subsets = load_prompt_sets(cfg.eval, tokenizer)
    block_sizes = {v: int(load_drafter_config(p).block_size) for v, p in drafters.items()}
    if len(set(block_sizes.values())) != 1:
        raise bad_value("eval.variants", list(drafters), f"the drafters have different block sizes {block_sizes}",
                        "evaluate variants of one drafter together")
    block_size = next(iter(block_sizes.values()))

    revision = cfg.target.revision if cfg.eval.target_variant == REFERENCE else None
    target_config = AutoConfig.from_pretrained(target_path, revision=revision,
                                               trust_remote_code=bool(cfg.target.trust_remote_code))
    for p in drafters.values():  # before any weights are loaded
        check_compatible(load_drafter_config(p), target_config, tokenizer, cfg.drafter.mask_token)
    primary = str(cfg.eval.target_variant)
    pair_targets = _matrix_targets(cfg, rd, primary)
    served = {t: pairing.target_identity(path, t, cfg.target.revision if t == REFERENCE else None,
                                         bool(cfg.target.trust_remote_code)) for t, path in pair_targets.items()}
    for t, path in pair_targets.items():  # every pair is checked before any weight is loaded
        if t != primary:
            validation.check_target(path, cfg.target.revision if t == REFERENCE else None)
            tc = AutoConfig.from_pretrained(path, revision=cfg.target.revision if t == REFERENCE else None,
                                            trust_remote_code=bool(cfg.target.trust_remote_code))
            for v in _matrix_drafters(drafters):
                check_compatible(load_drafter_config(drafters[v]), tc, tokenizer, cfg.drafter.mask_token)
    warnings = {t: pairing.check_pairs(rd, _matrix_drafters(drafters), served[t], "evaluate") for t in pair_targets}

    seed_everything(int(cfg.seed))
    dtype, device = TORCH_DTYPES[cfg.target.dtype], str(cfg.target.device)
    target = load_target(target_path, dtype, device, revision, bool(cfg.target.trust_remote_code),
                         cfg.target.attn_implementation)
    stop, max_new = _stop_ids(tokenizer, target), int(cfg.eval.max_new_tokens)
    greedy, target_s = _greedy_reference(target, subsets, max_new, stop, device)

    per_prompt: dict[str, list[tuple[float, int]]] = {}
    variants, timings = {}, {"device": device, "target_only_s": {k: round(v, 4) for k, v in target_s.items()},
                             "speculative_s": {}, "speedup": {}}
    for v, path in drafters.items():
        drafter, summary = load_drafter_variant(path, target, dtype, device)
        runs, spec_s, mismatches = _evaluate_variant(target, drafter, subsets, max_new, stop, device, greedy,
                                                     f"evaluate {v}")
        del drafter
        per_prompt[v] = [(float(sum(r.acceptance_lengths)), len(r.acceptance_lengths))
                         for rs in runs.values() for r in rs]
        variants[v] = {"path": str(path), "files": _tree(path), **summary, **_variant_meta(rd, v, summary),
                       "subsets": {s: subset_stats(rs, block_size) for s, rs in runs.items()},
                       "overall": _merge(runs, block_size), "lossless_mismatches": mismatches}
        timings["speculative_s"][v] = {k: round(x, 4) for k, x in spec_s.items()}
        timings["speedup"][v] = {k: round(target_s[k] / x, 4) if x else None for k, x in spec_s.items()}

    matrix = {primary: {v: _pair_entry(variants[v], rd, v) for v in _matrix_drafters(drafters)}}
    pair_prompts = {primary: per_prompt}
    for t, path in pair_targets.items():
        if t == primary:
            continue
        del target
        target = load_target(path, dtype, device, cfg.target.revision if t == REFERENCE else None,
                             bool(cfg.target.trust_remote_code), cfg.target.attn_implementation)
        greedy_t, _ = _greedy_reference(target, subsets, max_new, stop, device)
        matrix[t], pair_prompts[t] = {}, {}
        for v in _matrix_drafters(drafters):
            drafter, summary = load_drafter_variant(drafters[v], target, dtype, device)
            runs, _, mismatches = _evaluate_variant(target, drafter, subsets, max_new, stop, device, greedy_t,
                                                    f"evaluate {v} with target {t}")
            del drafter
            pair_prompts[t][v] = [(float(sum(r.acceptance_lengths)), len(r.acceptance_lengths))
                                  for rs in runs.values() for r in rs]
            matrix[t][v] = _pair_entry({"subsets": {s: subset_stats(rs, block_size) for s, rs in runs.items()},
                                        "overall": _merge(runs, block_size), "lossless_mismatches": mismatches},
                                       rd, v)

    results = {
        "stage": "evaluate", "config": _config_record(cfg), "block_size": block_size, "max_new_tokens": max_new,
        "stop_token_ids": stop, "reference_variant": REFERENCE if REFERENCE in variants else None,
        "variant_order": list(variants), "variants": variants,
        "drafter": {"name": cfg.drafter.name, "path": str(cfg.drafter.path)},
        "target": {"name": cfg.target.name, "variant": cfg.eval.target_variant, "path": target_path,
                   "serve_path": target_path, "files": _tree(target_path), "revision": cfg.target.revision},
        "subsets": [{"name": s.name, "source": s.source, "num_prompts": len(s.prompts),
                     "prompt_tokens": sum(len(p) for p in s.prompts)} for s in subsets],
    }
    doc = eval_results.EvalResults(
        **results, table=[eval_results.TauRow(**r) for r in tau_table(results)],
        calibration_comparison=[eval_results.CalibrationComparison(**c)
                                for c in calibration_comparison(rd, results, per_prompt, int(cfg.seed))],
        pairs={"targets": list(matrix), "served": served, "matrix": matrix,
               "warnings": {t: w for t, w in warnings.items() if w},
               "comparison": pair_comparison(rd, matrix, pair_prompts, int(cfg.seed))})
    results = doc.to_json()
    written = _write_outputs(rd.eval, doc, timings, subsets, _vllm_ranges(rd, results["variant_order"]))
    lossless = all(n == 0 for row in matrix.values() for d in row.values() for n in d["lossless_mismatches"].values())
    return {"output": str(rd.eval), "files": written, "lossless": lossless,
            "tau": {v: {s: d["subsets"][s]["tau"] for s in d["subsets"]} | {"all": d["overall"]["tau"]}
                    for v, d in variants.items()},
            "timings": timings, "results_sha256": sha256_text(dumps_json(results))}
