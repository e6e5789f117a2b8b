"""Stage `evaluate`: acceptance length per subset for the bf16 drafter and every quantized variant.

Recipe: check the request (variants, target, prompt sets) -> load the target as served (dense or
dequantized) -> per drafter variant, run the greedy speculative loop over every prompt of every
subset -> write eval/results.json, timings.json, report.md, the plots, vllm_commands.sh and the
prompts the vLLM benchmark commands read. Quantized drafters run as their checkpoints specify
(pipeline.evaluation.fakequant).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import check_report, eval_results
from pipeline.artifacts.rundir import RunDir
from pipeline.core import pool
from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, dumps_json, hash_tree, sha256_text
from pipeline.evaluation.loop import evaluate_variant as _evaluate_variant
from pipeline.evaluation.loop import greedy_reference as _greedy_reference
from pipeline.evaluation.loop import merge as _merge
from pipeline.evaluation.loop import subset_stats
from pipeline.quant import pairing

REFERENCE = "bf16"
SOURCE = "source"
TIMINGS_NOTE = ("speedup = target_only_s / speculative_s of the reference loop; null where the variant took target "
                "forwards from an earlier drafter's decodes (target_forwards.reused > 0, eval.target_memo_mb): its "
                "loop time leaves those forwards out. eval.target_memo_mb=0 runs and times every forward.")
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
        for t in [t for t in matrix if v in matrix[t] and base in matrix[t]]:  # eval.pairs=calibrated: both served
            b = paired.bootstrap_ratio_difference(per_prompt[t][v], per_prompt[t][base], seed)
            lo, hi = b["ci95"]
            out.append({"variant": v, "calibrated_on": rec["variant"], "base": base, "served_with": t,
                        "tau": matrix[t][v]["overall"]["tau"], "tau_base": matrix[t][base]["overall"]["tau"],
                        "paired_bootstrap": b,
                        "verdict": "better" if lo > 0 else "worse" if hi < 0 else "within noise"})
    return out


def _config_record(cfg) -> dict:
    from omegaconf import OmegaConf

    from pipeline.core.secrets import scrub_obj

    full = OmegaConf.to_container(cfg, resolve=True)
    for knob in ("workers", "target_memo_mb"):  # how the work was done, not what was computed: results.json is the same
        full["eval"].pop(knob, None)
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
    eval_results.write_vllm_commands(out, report.with_vllm_ranges(report.render_vllm_commands(results, prompt_files),
                                                                  ranges or {v: None for v in results["variant_order"]}))
    plots.tau_bars(results, out / "tau_per_subset.png")
    plots.acceptance_curves(results, out / "acceptance_per_position.png")
    plots.calibration_pairs(results, out / "calibration_vs_datafree.png")
    plots.pair_matrix(results, out / "pair_matrix.png")
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def _check_knobs(cfg) -> None:
    """The evaluate knobs a typo would turn into a traceback, each one sentence before any work."""
    from pipeline.core.dtypes import TORCH_DTYPES

    if cfg.target.dtype not in TORCH_DTYPES:
        raise bad_value("target.dtype", cfg.target.dtype, "unknown dtype", f"use one of {', '.join(TORCH_DTYPES)}")
    if int(cfg.eval.max_new_tokens) < 1:
        raise bad_value("eval.max_new_tokens", cfg.eval.max_new_tokens, "it must be positive", "use a value >= 1")
    if int(cfg.eval.target_memo_mb) < 0:
        raise bad_value("eval.target_memo_mb", cfg.eval.target_memo_mb, "it cannot be negative",
                        "use 0 (every decode runs all its target forwards) or the MB the shared forwards may hold")
    if int(cfg.eval.workers) < 1:
        raise bad_value("eval.workers", cfg.eval.workers, "it must be at least 1",
                        "use 1 (everything in this process) or the number of cores to spread the pairs over")
    if str(cfg.eval.pairs) not in pairing.PAIRINGS:
        raise bad_value("eval.pairs", cfg.eval.pairs, "it is not a pairing evaluate knows",
                        "use all (every drafter on every target) or calibrated (a quantized target evaluates the "
                        "drafters made for it)")


@dataclass
class _Plan:
    """What evaluate will run, every input checked (no weight loaded yet)."""
    drafters: dict[str, Path]
    target_path: str
    revision: str | None
    subsets: list
    block_size: int
    primary: str
    pair_targets: dict[str, str]
    paired: dict[str, list[str]]
    served: dict[str, dict]
    warnings: dict[str, dict]
    stop: list[int] = field(default_factory=list)


def _plan(cfg, rd: RunDir) -> tuple[_Plan, Any]:
    """Every drafter and target checked against its tensors, each other and the pairing, before any weight
    is loaded; returns the plan and the tokenizer."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.evaluation.prompts import load_prompt_sets
    from pipeline.models import validation
    from pipeline.models.compat import check_compatible
    from pipeline.models.formats import load_drafter_config

    _check_knobs(cfg)
    drafters = _drafter_dirs(cfg, rd)
    target_path = _target_path(cfg, rd)
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

    revision = cfg.target.revision if cfg.eval.target_variant == REFERENCE else None
    trust = bool(cfg.target.trust_remote_code)
    target_config = AutoConfig.from_pretrained(target_path, revision=revision, trust_remote_code=trust)
    for p in drafters.values():  # before any weights are loaded
        check_compatible(load_drafter_config(p), target_config, tokenizer, cfg.drafter.mask_token)
    primary = str(cfg.eval.target_variant)
    pair_targets = _matrix_targets(cfg, rd, primary)
    paired = pairing.pairs_for(rd, list(pair_targets), _matrix_drafters(drafters),
                               "all" if list(cfg.eval.variants or []) else str(cfg.eval.pairs), primary,
                               [str(x) for x in cfg.eval.pairs_every_target or []])
    served = {t: pairing.target_identity(path, t, cfg.target.revision if t == REFERENCE else None, trust)
              for t, path in pair_targets.items()}
    for t, path in pair_targets.items():  # every pair is checked before any weight is loaded
        if t != primary:
            validation.check_target(path, cfg.target.revision if t == REFERENCE else None)
            tc = AutoConfig.from_pretrained(path, revision=cfg.target.revision if t == REFERENCE else None,
                                            trust_remote_code=trust)
            for v in paired[t]:
                check_compatible(load_drafter_config(drafters[v]), tc, tokenizer, cfg.drafter.mask_token)
    warnings = {t: pairing.check_pairs(rd, paired[t], served[t], "evaluate") for t in pair_targets}
    return _Plan(drafters, target_path, revision, subsets, next(iter(block_sizes.values())), primary, pair_targets,
                 paired, served, warnings), tokenizer


def _per_prompt(runs: dict) -> list[tuple[float, int]]:
    return [(float(sum(r.acceptance_lengths)), len(r.acceptance_lengths)) for rs in runs.values() for r in rs]


def _pairs_job(cfg, plan: _Plan, chunk: list[tuple[str, list[str]]], max_new: int, greedy=None, target=None) -> dict:
    """The pairs of `chunk` ([(target, [drafters])], in order): {(target, drafter): outcome}. `greedy`, `target`:
    the primary target's outputs and model where this process has them, else each target is loaded and run alone
    here. A worker runs this when eval.workers > 1 (pipeline.core.pool), so it seeds itself."""
    from pipeline.core.dtypes import TORCH_DTYPES
    from pipeline.core.seeding import seed_everything
    from pipeline.evaluation.fakequant import load_drafter_variant, load_target
    from pipeline.models.target_steps import StepMemo

    seed_everything(int(cfg.seed))
    rd, dtype, device = RunDir.from_cfg(cfg), TORCH_DTYPES[cfg.target.dtype], str(cfg.target.device)
    out = {}
    for t, drafters in chunk:
        mine = t == plan.primary and target is not None
        model = target if mine else load_target(
            plan.pair_targets[t], dtype, device, plan.revision if t == plan.primary else
            cfg.target.revision if t == REFERENCE else None, bool(cfg.target.trust_remote_code),
            cfg.target.attn_implementation)
        ref = greedy if mine and greedy is not None else _greedy_reference(model, plan.subsets, max_new, plan.stop,
                                                                            device)[0]
        memo = StepMemo(int(cfg.eval.target_memo_mb) << 20) if int(cfg.eval.target_memo_mb) else None
        for v in drafters:
            path = plan.drafters[v]
            drafter, summary = load_drafter_variant(path, model, dtype, device)
            before = memo.counts() if memo else None
            runs, spec_s, mismatches = _evaluate_variant(model, drafter, plan.subsets, max_new, plan.stop, device, ref,
                                                         f"evaluate {v}" + ("" if t == plan.primary else f" with target {t}"),
                                                         memo)
            del drafter
            stats = {"subsets": {s: subset_stats(rs, plan.block_size) for s, rs in runs.items()},
                     "overall": _merge(runs, plan.block_size), "lossless_mismatches": mismatches}
            entry = ({"path": str(path), "files": _tree(path), **summary, **_variant_meta(rd, v, summary), **stats}
                     if t == plan.primary else stats)
            out[(t, v)] = {"entry": entry, "per_prompt": _per_prompt(runs), "spec_s": spec_s,
                           "forwards": {k: n - before[k] for k, n in memo.counts().items()} if memo else None}
        del model, memo
    return out


def _spread(cfg, plan: _Plan, target, device: str, max_new: int) -> tuple[dict, dict]:
    """Every pair of the matrix (the main table's first), cut into eval.workers runs of about equal length: the
    first here, beside the primary target alone (its wall time is the speedups' reference), the others in
    worker processes. Returns (the primary target's wall times, {(target, drafter): outcome})."""
    others = [t for t in plan.pair_targets if t != plan.primary]
    units = [(plan.primary, v) for v in plan.drafters] + [(t, v) for t in others for v in plan.paired[t]]
    chunks = [[(t, [v for u, v in part if u == t]) for t in dict.fromkeys(u for u, _ in part)]
              for part in pool.split(units, int(cfg.eval.workers))] or [[]]

    def here():
        greedy, target_s = _greedy_reference(target, plan.subsets, max_new, plan.stop, device)
        return target_s, _pairs_job(cfg, plan, chunks[0], max_new, greedy, target)

    (target_s, done), theirs = pool.alongside(here, _pairs_job, [(cfg, plan, c, max_new) for c in chunks[1:]],
                                              int(cfg.eval.workers))
    for d in theirs:
        done.update(d)
    return target_s, done


def run(cfg) -> dict:
    from pipeline.core.dtypes import TORCH_DTYPES
    from pipeline.core.seeding import seed_everything
    from pipeline.evaluation.fakequant import load_target

    rd = RunDir.from_cfg(cfg)
    plan, tokenizer = _plan(cfg, rd)
    seed_everything(int(cfg.seed))
    dtype, device = TORCH_DTYPES[cfg.target.dtype], str(cfg.target.device)
    target = load_target(plan.target_path, dtype, device, plan.revision, bool(cfg.target.trust_remote_code),
                         cfg.target.attn_implementation)
    plan.stop, max_new = _stop_ids(tokenizer, target), int(cfg.eval.max_new_tokens)
    target_s, done = _spread(cfg, plan, target, device, max_new)
    del target
    variants, per_prompt = {}, {}
    timings = {"device": device, "target_only_s": {k: round(v, 4) for k, v in target_s.items()},
               "speculative_s": {}, "speedup": {}, "target_forwards": {}, "note": TIMINGS_NOTE}
    for v in plan.drafters:
        o = done[(plan.primary, v)]
        variants[v], per_prompt[v] = o["entry"], o["per_prompt"]
        timings["speculative_s"][v] = {k: round(x, 4) for k, x in o["spec_s"].items()}
        shared = bool(o["forwards"] and o["forwards"]["reused"])
        timings["speedup"][v] = {k: round(target_s[k] / x, 4) if x and not shared else None
                                 for k, x in o["spec_s"].items()}
        timings["target_forwards"][v] = o["forwards"]
    matrix = {plan.primary: {v: _pair_entry(variants[v], rd, v) for v in _matrix_drafters(plan.drafters)}}
    pair_prompts = {plan.primary: per_prompt}
    for t in [t for t in plan.pair_targets if t != plan.primary]:
        matrix[t] = {v: _pair_entry(done[(t, v)]["entry"], rd, v) for v in plan.paired[t]}
        pair_prompts[t] = {v: done[(t, v)]["per_prompt"] for v in plan.paired[t]}
    return _finish(cfg, rd, plan, variants, per_prompt, matrix, pair_prompts, timings)


def _finish(cfg, rd: RunDir, plan: _Plan, variants: dict, per_prompt: dict, matrix: dict, pair_prompts: dict,
            timings: dict) -> dict:
    """results.json, the report, plots and commands from the passes; the stage's result."""
    from pipeline.evaluation import report

    results = {
        "stage": "evaluate", "config": _config_record(cfg), "block_size": plan.block_size,
        "max_new_tokens": int(cfg.eval.max_new_tokens), "stop_token_ids": plan.stop,
        "reference_variant": REFERENCE if REFERENCE in variants else None,
        "variant_order": list(variants), "variants": variants,
        "drafter": {"name": cfg.drafter.name, "path": str(cfg.drafter.path)},
        "target": {"name": cfg.target.name, "variant": cfg.eval.target_variant, "path": plan.target_path,
                   "serve_path": plan.target_path, "files": _tree(plan.target_path), "revision": cfg.target.revision},
        "subsets": [{"name": s.name, "source": s.source, "num_prompts": len(s.prompts),
                     "prompt_tokens": sum(len(p) for p in s.prompts)} for s in plan.subsets],
    }
    doc = eval_results.EvalResults(
        **results, table=[eval_results.TauRow(**r) for r in report.tau_table(results, REFERENCE)],
        calibration_comparison=[eval_results.CalibrationComparison(**c)
                                for c in calibration_comparison(rd, results, per_prompt, int(cfg.seed))],
        pairs={"targets": list(matrix), "served": plan.served, "matrix": matrix,
               "warnings": {t: w for t, w in plan.warnings.items() if w},
               "comparison": pair_comparison(rd, matrix, pair_prompts, int(cfg.seed))})
    results = doc.to_json()
    written = _write_outputs(rd.eval, doc, timings, plan.subsets, _vllm_ranges(rd, results["variant_order"]))
    lossless = all(n == 0 for row in matrix.values() for d in row.values() for n in d["lossless_mismatches"].values())
    return {"output": str(rd.eval), "files": written, "lossless": lossless,
            "tau": {v: {s: d["subsets"][s]["tau"] for s in d["subsets"]} | {"all": d["overall"]["tau"]}
                    for v, d in variants.items()},
            "timings": timings, "results_sha256": sha256_text(dumps_json(results))}
