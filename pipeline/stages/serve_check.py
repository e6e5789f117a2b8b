"""Stage `serve-check`: every drafter variant of the run, served by the real vLLM beside each target.

Recipe: probe `serve.python` (vLLM importable, a CUDA GPU visible) and refuse in one sentence before
anything is written -> render the evaluate stage's prompt sets (same chat template, same ids) ->
one job per engine: each target of the run (the configured target and every `target/<variant>/`)
alone, and with each drafter variant (NVFP4 W4A4 drafters a second time with
`linear_backend=emulation` where the GPU has no FP4 tensor cores, so W4A4 numerics are measured, not
only Marlin's weight-only path) -> `serve.parallel` worker processes at once in `serve.python`
(`pipeline.serving.worker`), each building its engines one after another (`serve.engines_per_process`: one on
a GPU, all on the CPU build) -> lossless count against the same target alone, vLLM's tau per subset and
acceptance per position, the kernel of every quantized layer ->
`eval/serve_check.json`, the per-job files under `eval/serve_check/`, a section in `eval/report.md`
-> exit non-zero naming every variant that does not load, is not lossless or whose tau falls below
`serve.min_tau_ratio` of the bf16 drafter's (same target, same kernel) or below `serve.min_tau`. Where a
pair's output parts from the target alone's, the reference target (fp32, transformers) is run teacher-forced
over the prompt and that output (`tie_logits`): the two tokens at the difference within `serve.lossless_tie` of
each other and of the row's top, and every later served token within it of its row's top, is a near-tie the
engine's batch shapes break either way, reported with its gaps, not failed.

With `serve.speed` on a GPU every engine is also timed as served (CUDA graphs: enforce_eager off, one
engine at a time): decode ms per step and tokens/s at batch 1 and `serve.speed_batch`, tau from the same
run, weight bytes, peak memory; the speedup over the same target alone, measured and estimated as
tau x t(target alone) / t(pair) (`pipeline.serving.speedup`). Never a pass/fail criterion. On the CPU
build the section says it was not measured.

The pieces: `pipeline.serving.launch` (probe, environment, worker subprocesses), `.jobs` and `.records` (the jobs
and results, typed), `.worker*` (inside vLLM), `.references` (near-tie and DFlash2 references in torch), `.verdict`
(decides; `decide` builds the summary), `.report` (the report section and card sentences) and
`pipeline.artifacts.serve_results` (eval/serve_check.json, versioned).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

from pipeline.artifacts import serve_results
from pipeline.artifacts.rundir import RunDir
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_text
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.quant import pairing
from pipeline.serving import jobs as serve_jobs
from pipeline.serving import launch, layout, references, report, verdict
from pipeline.serving.records import Criteria, EngineJob, LoadProbeJob, ReferenceTau, ServeSummary

REFERENCE = "bf16"
KV_CACHE_DTYPES = ("auto", "fp8")  # what serve.kv_cache_dtype may be (vLLM's CacheConfig.cache_dtype values we check)


def run(cfg) -> dict:
    s = cfg.serve
    _validate(s)
    rd = RunDir.from_cfg(cfg)
    if not rd.root.is_dir():
        raise bad_value("run_dir", str(rd.root), "the run directory does not exist", "run the earlier stages first")
    targets, drafters = _targets(cfg, rd), _drafters(cfg, rd)  # bad names fail before the probe
    pairing_warnings, calibrated_on = check_checkpoints(cfg, rd, targets, drafters)  # nothing written on a refusal
    archs = _architectures(targets)
    wrappers = [w for a in archs for w in [layout.WRAPPERS.get(a)] if w and w not in archs]
    info = launch.probe(s.python, archs + wrappers)  # no vLLM: one sentence alone, before any warning, nothing written
    _check_engine(s, info)
    served = served_layouts(info, targets, rd.eval / "serve_check" / "served")
    unbuilt = unbuildable_targets(info, {t: p for t, p in targets.items() if t not in served})
    if unbuilt:  # e.g. a hybrid target on an engine without its model class: said once, nothing written, exit 0
        print(f"[specquant] {unbuilt}", file=sys.stderr)
        return {"output": None, "engines": 0, "skipped": unbuilt}
    for sentence in pairing_warnings:
        pairing.warn(sentence, "serve-check")
    prompts, stop = _prompts(cfg)
    jobs = build_jobs(cfg, rd, info, prompts, stop, served)
    results, probes = _launch(cfg, rd, info, jobs, prompts, f"{len(targets)} targets, {len(drafters)} drafters")
    loads = [j for j in jobs if isinstance(j, LoadProbeJob)]
    engines = [r for r in results if not r.load_probe]
    ties = (tie_logits(targets, engines, prompts, int(s.lossless_tie_checks), _load_settings(cfg))
            if float(s.lossless_tie) > 0 and bool(s.require_lossless) else {})
    loaded = [r for r in results if r.load_probe]
    summary = verdict.decide(
        results, prompts, Criteria(float(s.min_tau_ratio), float(s.min_tau), bool(s.require_lossless),
                                   float(s.lossless_tie)), _reference_tau(rd),
        ties=ties, load_probes=references.check_load_probes(loaded, loads, probes), speed=bool(s.speed),
        speed_tau=s.speed_tau, pairing_warnings=pairing_warnings, calibrated_on=calibrated_on,
        context={"probe": info, "served_layouts": served, "settings": _settings(s)})
    serve_results.write(rd.eval / "serve_check.json", summary)
    update_report(rd, report.render(summary))
    _refuse_failures(rd, summary)
    return _outcome(rd, jobs, info, summary)


def _launch(cfg, rd: RunDir, info: dict, jobs: list, prompts: dict, what: str) -> tuple[list, dict[str, dict]]:
    """The DFlash2 references' inputs written for their load-and-probe jobs, then every job in its worker,
    `parallel` at once. Returns the results in the jobs' order and the references by job name."""
    n = parallel(cfg, info)
    print(f"[specquant] serve-check: {len(jobs)} vLLM engines ({what}, serve.pairs={cfg.serve.pairs}, + each target "
          f"alone), {n} at a time, {launch.engine(info)}", file=sys.stderr)
    folder = rd.eval / "serve_check"
    folder.mkdir(parents=True, exist_ok=True)
    first = next(p for ps in prompts.values() for p in ps)
    probes = {j.name: references.load_probe_inputs(cfg, j, first, folder, _loaders())
              for j in jobs if isinstance(j, LoadProbeJob)}
    return launch.run_jobs(str(cfg.serve.python), jobs, folder, n, launch.worker_env(info),
                           engines_per_process(cfg, info)), probes


def _validate(s) -> None:
    """The `serve.*` knobs the verdict and the engines read, each in its range (before anything runs)."""
    if not 0 < float(s.min_tau_ratio) <= 1:
        raise bad_value("serve.min_tau_ratio", s.min_tau_ratio, "it must be in (0, 1]", "use e.g. 0.9")
    if not 0 <= float(s.lossless_tie) <= 0.1:
        raise bad_value("serve.lossless_tie", s.lossless_tie, "it is a share of the row's largest |logit| and must be "
                        "in [0, 0.1]", "use e.g. 0.01 (1%), or 0 for exact equality only")
    if int(s.lossless_tie_checks) < 0:
        raise bad_value("serve.lossless_tie_checks", s.lossless_tie_checks, "it must be >= 0", "use e.g. 16")
    if s.engines_per_process is not None and int(s.engines_per_process) < 1:
        raise bad_value("serve.engines_per_process", s.engines_per_process, "it must be a whole number >= 1 or null",
                        "use 1 (each engine its own process), e.g. 8, or null (all on the CPU build, 1 on a GPU)")
    if str(s.kv_cache_dtype) not in KV_CACHE_DTYPES:
        raise bad_value("serve.kv_cache_dtype", s.kv_cache_dtype, "it is not a KV cache dtype serve-check runs",
                        f"use {' or '.join(KV_CACHE_DTYPES)} (auto = the model dtype)")


def _check_engine(s, info: dict) -> None:
    """What the probed engine cannot run at all, refused before any engine starts: an FP8 KV cache on a CPU
    build whose CPU lacks AVX-512 and AMX (vLLM's CPU attention refuses it at every engine's start)."""
    if str(s.kv_cache_dtype) == "fp8" and info.get("platform") == "cpu" and info.get("fp8_kv_cache") is False:
        raise bad_value("serve.kv_cache_dtype", s.kv_cache_dtype, f"vLLM {info.get('vllm')}'s CPU build stores an FP8 "
                        "KV cache only on x86 with AVX-512 or AMX, which this CPU lacks",
                        "use serve.kv_cache_dtype=auto here, or run serve-check on a GPU or an AVX-512 machine")


def check_checkpoints(cfg, rd: RunDir, targets: dict[str, Path], drafters: dict[str, Path]) -> tuple[list[str], dict]:
    """Before the probe, nothing written on a refusal: every field of each checkpoint's family against its tensors,
    then every pair (issue 47), the pairing (`check_pairing`) and the load-and-probe drafters (DFlash2) against their
    vLLM range (`refuse_load_probe_contract`).
    Returns `check_pairing`'s warnings and calibrated drafters."""
    from pipeline.models import validation
    from pipeline.models.compat import check_compatible

    drafter_configs = [validation.check_drafter(path) for path in drafters.values()]
    for t, path in targets.items():
        tconf = validation.check_target(path, cfg.target.revision if t == REFERENCE else None)
        for dconf in drafter_configs if tconf is not None else ():
            check_compatible(dconf, tconf)
    found = check_pairing(cfg, rd, targets, drafters)  # an unservable pair: refused
    refuse_load_probe_contract(cfg, rd, drafters)
    return found


def _loaders() -> references.Loaders:
    from pipeline.evaluation import fakequant

    return references.Loaders(fakequant.load_target, fakequant.load_drafter_variant)


def _load_settings(cfg) -> dict[str, dict]:
    """How the reference target loads (revision, remote code); a quantized target of the run: as it is."""
    return {REFERENCE: {"revision": cfg.target.revision, "trust_remote_code": bool(cfg.target.trust_remote_code)}}


def tie_logits(targets: dict[str, Path], results: list, prompts: dict, limit: int,
               load: dict[str, dict] | None = None) -> dict[str, dict]:
    """`references.tie_logits` with the reference loop's loader."""
    from pipeline.evaluation.fakequant import load_target

    return references.tie_logits(targets, results, prompts, limit, load, load_target=load_target)


def _settings(s) -> dict:
    """`serve.*` as the check ran with it (the interpreter's path aside)."""
    return {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in ((k, s[k]) for k in s if k != "python")}


def update_report(rd: RunDir, section: str) -> None:
    p = rd.eval / "report.md"
    atomic_write_text(p, report.splice(p.read_text(encoding="utf-8") if p.is_file() else None, section))


def _refuse_failures(rd: RunDir, summary: ServeSummary) -> None:
    """Exit non-zero naming the first failures (the summary and report are written already)."""
    failed = summary["failures"]
    if failed:
        raise SpecquantError(f"serve-check failed for {len(failed)} of {len(summary['pairs']) + len(summary['load_probes'])} "
                             "pairs or DFlash2 loads: "
                             + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else "")
                             + f" (details: {rd.eval / 'serve_check.json'})")


def _outcome(rd: RunDir, jobs: list, info: dict, summary: ServeSummary) -> dict:
    """The stage's result (its record): the file, the engine, each pair's verdict in brief."""
    return {"output": str(rd.eval / "serve_check.json"), "engines": len(jobs), "gpu": info.get("gpu"),
            "platform": info.get("platform"), "vllm": info.get("vllm"),
            "speed": {k: v for k, v in (summary.get("speed") or {}).items() if k != "rows"} or None,
            "pairs": {k: {"ok": p["ok"], "tau": p.get("tau", {}).get("all"), "lossless": p.get("lossless")}
                      for k, p in summary["pairs"].items()}}


# ---------------------------------------------------------------- what is served, and with which settings
def _targets(cfg, rd: RunDir) -> dict[str, Path]:
    found = {REFERENCE: Path(str(cfg.target.path))}
    found.update({v: rd.target(v) for v in rd.target_variants()})
    wanted = list(cfg.serve.targets or [])
    unknown = [t for t in wanted if t not in found]
    if unknown:
        raise bad_value("serve.targets", wanted, f"{unknown} are not targets of this run (have {sorted(found)})",
                        "run quantize-target for them or drop them")
    return {t: found[t] for t in (wanted or found)}


def _drafters(cfg, rd: RunDir) -> dict[str, Path]:
    found = {v: rd.drafter(v) for v in rd.drafter_variants()}
    wanted = list(cfg.serve.variants or [])
    unknown = [v for v in wanted if v not in found]
    if unknown:
        raise bad_value("serve.variants", wanted, f"{unknown} not found in {rd.root / 'drafter'} (have {sorted(found)})",
                        "run quantize-drafter for them first or drop them from the list")
    chosen = wanted or sorted(found, key=lambda v: (v != REFERENCE, v))
    if not chosen:
        raise bad_value("run_dir", str(rd.root), "it holds no drafter checkpoint to serve",
                        "run `make quantize-drafter` first")
    return {v: found[v] for v in chosen}


PAIRS = pairing.PAIRINGS


def pairs_to_serve(cfg, rd: RunDir, targets: dict[str, Path], drafters: dict[str, Path]) -> dict[str, list[str]]:
    """{target: the drafters served beside it}. `serve.pairs=all`, or drafters named in `serve.variants`: every
    drafter on every target. `calibrated` (the default): the configured target serves every drafter; a quantized
    target serves the drafters calibrated on its hidden states, the bf16-calibrated recipe of each (the
    mismatched pair beside it) and the bf16 drafter, or every drafter when none was calibrated on it."""
    if str(cfg.serve.pairs) not in PAIRS:
        raise bad_value("serve.pairs", cfg.serve.pairs, "it is not a pairing serve-check knows",
                        "use calibrated (a quantized target serves the drafters made for it) or all")
    mode = "all" if list(cfg.serve.variants or []) else str(cfg.serve.pairs)
    return pairing.pairs_for(rd, list(targets), list(drafters), mode)


def _prompts(cfg) -> tuple[dict[str, list[list[int]]], list[int]]:
    """The evaluate stage's rendering: the same prompt ids and stop tokens the reference loop used."""
    from transformers import AutoTokenizer, GenerationConfig

    from pipeline.evaluation.prompts import load_prompt_sets

    tok = AutoTokenizer.from_pretrained(cfg.target.tokenizer or cfg.target.path,
                                        revision=cfg.target.revision if not cfg.target.tokenizer else None)
    subsets = load_prompt_sets(cfg.eval, tok)
    stop = {tok.eos_token_id}
    try:
        gen = GenerationConfig.from_pretrained(str(cfg.target.path), revision=cfg.target.revision)
        eos = gen.eos_token_id
        stop |= set(eos if isinstance(eos, list) else [eos])
    except OSError:
        pass
    return {s.name: s.prompts for s in subsets}, sorted(i for i in stop if i is not None)


def build_jobs(cfg, rd: RunDir, info: dict, prompts: dict, stop: list[int],
               served: dict[str, dict] | None = None) -> list[EngineJob | LoadProbeJob]:
    """The worker jobs (`pipeline.serving.jobs`): a load-and-probe per DFlash2 drafter; per target, the target
    alone and beside each drafter it serves (`pairs_to_serve`). `served` (from `served_layouts`): targets
    served from a copy in another layout."""
    s = cfg.serve
    targets, drafters = _targets(cfg, rd), _drafters(cfg, rd)
    max_len = serve_jobs.max_model_len(cfg, prompts)
    settings = serve_jobs.engine_settings(cfg, stop, max_len, parallel(cfg, info), speed_on(cfg, info))
    sm, on_cpu = float(info.get("capability") or 0), info.get("platform") == "cpu"
    probed = {v: d for v, d in drafters.items() if load_and_probe(d)}
    drafters = {v: d for v, d in drafters.items() if v not in probed}
    # no engine runs a load-and-probe drafter (DFlash2) here: vLLM's model class loads it
    jobs: list = [serve_jobs.load_probe_job(cfg, v, REFERENCE, d, max_len) for v, d in probed.items()]
    serve_with = pairs_to_serve(cfg, rd, targets, drafters)
    for t, tpath in targets.items() if drafters or not probed else ():
        # linear_backend is engine-wide and vLLM 0.26 has no emulation kernel for int4 (W4A16) layers, so a
        # quantized target is paired with the drafters' default kernel only
        # (on the CPU build every NVFP4 layer is emulated already: serve.cpu_nvfp4_emulation)
        emulate = bool(s.emulate_w4a4) and not on_cpu and sm < 10 and not serve_jobs.is_quantized(tpath)
        jobs += serve_jobs.target_jobs(settings, t, tpath, {v: drafters[v] for v in serve_with[t]}, prompts,
                                       (served or {}).get(t), emulate)
    return jobs


def load_and_probe(path: Path) -> bool:
    """Whether a drafter's family is served by loading vLLM's model class and probing it, not by an engine (its
    `serve_mode`: DFlash2 today, `pipeline.models.families`)."""
    return CheckpointInfo.read(path, "drafter").drafter_family.serve_mode == "load-and-probe"


def speed_on(cfg, info: dict) -> bool:
    """Whether engines are timed here: `serve.speed` on a GPU (the CPU build is not timed)."""
    return bool(cfg.serve.speed) and info.get("platform") != "cpu"


def engines_per_process(cfg, info: dict) -> int | None:
    """Engines one worker process builds one after another (vLLM imported once): `serve.engines_per_process`, or
    by default every engine of its slot on the CPU build (where importing vLLM takes longer than a tiny engine's
    whole check) and 1 on a GPU (each engine its own process: its memory and timing its own); None = all."""
    p = cfg.serve.engines_per_process
    if p is not None:
        return int(p)
    return None if info.get("platform") == "cpu" else 1  # the CPU build is never timed (`speed_on`)


def parallel(cfg, info: dict) -> int:
    """Engines at once: `serve.parallel`, or by default 4 on a GPU and 1 on the CPU build (each engine
    takes every core); always 1 when timing (`serve.speed` on a GPU), engines sharing a GPU skew each other."""
    if speed_on(cfg, info):
        return 1
    p = cfg.serve.parallel
    return int(p) if p else (1 if info.get("platform") == "cpu" else 4)


# ---------------------------------------------------------------- before the engines: checks that write nothing
def refuse_load_probe_contract(cfg, rd: RunDir, drafters: dict[str, Path]) -> None:
    """Every drafter of a load-and-probe family (its family's `serve_mode`: DFlash2 today) against the rules of the
    vLLM range it was written for (its quantize-drafter record's `vllm.profile`, else the newest;
    `pipeline.serving.contract`, which asks the family): a checkpoint that range would read otherwise than it stores
    is refused in one sentence naming the family, before anything is written."""
    from pipeline.artifacts.stage_record import load_record
    from pipeline.serving import contract

    for v, path in drafters.items():
        fam = CheckpointInfo.read(path, "drafter").drafter_family
        if fam.serve_mode != "load-and-probe":
            continue
        rec = load_record(rd.root, f"quantize-drafter-{v}")
        prof = contract.profile(((rec.result.get("vllm") or {}).get("profile") if rec else None) or None)
        problems = contract.check_dir(path, _target_layers(cfg), prof)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise bad_value(f"drafter/{v}", str(path), f"vLLM {prof.versions} would not read this {fam.card_name} "
                            f"checkpoint as stored: {problems[0]}{more}",
                            "re-run quantize-drafter for it (its ignore list and dense layers follow quant.vllm), "
                            "or drop it with serve.variants")


def _target_layers(cfg) -> int:
    """The configured target's decoder depth (T: draft layer i is vLLM's `model.layers.{i + T}`)."""
    from pipeline.models.targets import text_config

    conf = json.loads((Path(str(cfg.target.path)) / "config.json").read_text(encoding="utf-8"))
    return int(text_config(conf)["num_hidden_layers"])


def _reference_tau(rd: RunDir) -> ReferenceTau:
    """The reference loop's tau (evaluate): {variant: {subset|all: tau}}, which target it ran with, and the
    same for every target of its pair matrix ({target: {variant: ...}})."""
    from pipeline.artifacts.eval_results import read_results

    res = read_results(rd.eval)
    if res is None:
        return ReferenceTau(None, {}, {})

    def taus(d):
        return {**{s: d["subsets"][s]["tau"] for s in d["subsets"]}, "all": d["overall"]["tau"]}

    out = {v: taus(d) for v, d in res.variants.items()}
    matrix = {t: {v: taus(d) for v, d in row.items()} for t, row in (res.pairs.get("matrix") or {}).items()}
    return ReferenceTau(res.target.get("variant"), out, matrix)


def check_pairing(cfg, rd: RunDir, targets: dict[str, Path], drafters: dict[str, Path]) -> tuple[list[str], dict]:
    """Every drafter against every target it will be served with (a refusal or a warning sentence each),
    and {variant: (calibration target, base variant)} for the drafters calibrated on a quantized target."""
    warnings = []
    serve_with = pairs_to_serve(cfg, rd, targets, drafters)
    for t, path in targets.items():
        served = pairing.target_identity(path, t, cfg.target.revision if t == REFERENCE else None,
                                         bool(cfg.target.trust_remote_code))
        for v in serve_with[t]:  # a refusal raises here; the warnings are printed once vLLM is known to be there
            sentence = pairing.check_pair(v, pairing.drafter_record(rd, v), served)
            if sentence:
                warnings.append(sentence)
    calibrated_on = {}
    for v in drafters:
        rec = pairing.drafter_record(rd, v)
        base = pairing.base_variant(v, rec)
        if base in drafters:
            calibrated_on[v] = (rec["variant"], base)
    return warnings, calibrated_on


def _architectures(targets: dict[str, Path]) -> list[str]:
    """The model classes the targets' config.json files name (a Hub id without a local config: none)."""
    archs: list[str] = []
    for path in targets.values():
        conf = Path(path) / "config.json"
        if conf.is_file():
            archs += [a for a in json.loads(conf.read_text(encoding="utf-8")).get("architectures") or []
                      if a not in archs]
    return archs


def served_layouts(info: dict, targets: dict[str, Path], folder: Path) -> dict[str, dict]:
    """{target: {"path", "architecture", "wrapper", "reason"}} for each target whose own class this vLLM cannot
    build while its family's image-text wrapper it can (vLLM 0.26 and a text-only Qwen3.5 checkpoint): the
    target is written in the wrapper's layout under `folder` (tensors renamed, bytes unchanged;
    `pipeline.serving.layout`) and served from there with `language_model_only`."""
    classes = info.get("model_classes") or {}
    out: dict[str, dict] = {}
    for t, path in targets.items():
        conf = Path(path) / "config.json"
        if not conf.is_file():
            continue
        config = json.loads(conf.read_text(encoding="utf-8"))
        pair = layout.wrapper_for(config)
        if not pair or classes.get(pair[0]) is None or pair[1] not in classes or classes[pair[1]] is not None:
            continue
        dest = layout.wrap_text_checkpoint(Path(path), folder / t)
        out[t] = {"path": str(dest.resolve()), "architecture": pair[0], "wrapper": pair[1],
                  "reason": f"{launch.engine(info)} cannot build {pair[0]} ({classes[pair[0]]}); served as {pair[1]}, "
                            "its text weights renamed and no vision tower built (language_model_only)"}
        print(f"[specquant] serve-check: target {t}: {out[t]['reason']}", file=sys.stderr)
    return out


def unbuildable_targets(info: dict, targets: dict[str, Path]) -> str | None:
    """One sentence naming the targets whose model class this vLLM cannot build, and why (None: it builds all)."""
    bad = {a: why for a, why in (info.get("model_classes") or {}).items() if why}
    names = [t for t, p in targets.items() if any(a in bad for a in _architectures({t: p}))]
    if not names:
        return None
    bad = {a: why for a, why in bad.items() if any(a in _architectures({t: targets[t]}) for t in names)}
    words = launch.engine(info)
    return (f"serve-check skips the targets {', '.join(names)}: {words} cannot build "
            + "; ".join(f"{a} ({why})" for a, why in bad.items())
            + ", so their pairs are not checked in vLLM (the evaluate stage's reference loop still checks them)")
