"""Stage `serve-check`: every drafter variant of the run, served by the real vLLM beside each target.

Recipe: probe `serve.python` (vLLM importable, a CUDA GPU visible) and refuse in one sentence before
anything is written -> render the evaluate stage's prompt sets (same chat template, same ids) ->
one job per engine: each target of the run (the configured target and every `target/<variant>/`)
alone, and with each drafter variant (NVFP4 W4A4 drafters a second time with
`linear_backend=emulation` where the GPU has no FP4 tensor cores, so W4A4 numerics are measured, not
only Marlin's weight-only path) -> `serve.parallel` worker processes at once, each its own vLLM
engine in `serve.python` (`pipeline.serving.worker`) -> lossless count against the same target
alone, vLLM's tau per subset and acceptance per position, the kernel of every quantized layer ->
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
tau x t(target alone) / t(pair) (`verdict.speed_summary`). Never a pass/fail criterion. On the CPU
build the section says it was not measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.artifacts import serve_results
from pipeline.artifacts.rundir import RunDir
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, read_json
from pipeline.models import targets as target_families
from pipeline.quant import pairing
from pipeline.serving import layout, verdict
from pipeline.serving.launch import PLATFORMS, engine, probe  # noqa: F401 - PLATFORMS, probe: the stage's names too
from pipeline.serving.launch import repo_root as _repo_root
from pipeline.serving.launch import worker_pythonpath as _worker_pythonpath

REFERENCE = "bf16"
REPORT_BEGIN = "<!-- serve-check: begin -->"
REPORT_END = "<!-- serve-check: end -->"


# ---------------------------------------------------------------- the jobs
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


PAIRS = ("calibrated", "all")


def pairs_to_serve(cfg, rd: RunDir, targets: dict[str, Path], drafters: dict[str, Path]) -> dict[str, list[str]]:
    """{target: the drafters served beside it}. `serve.pairs=all`, or drafters named in `serve.variants`: every
    drafter on every target. `calibrated` (the default): the configured target serves every drafter; a quantized
    target serves the drafters calibrated on its hidden states, the bf16-calibrated recipe of each (the
    mismatched pair beside it) and the bf16 drafter, or every drafter when none was calibrated on it."""
    if str(cfg.serve.pairs) not in PAIRS:
        raise bad_value("serve.pairs", cfg.serve.pairs, "it is not a pairing serve-check knows",
                        "use calibrated (a quantized target serves the drafters made for it) or all")
    order = list(drafters)
    if str(cfg.serve.pairs) == "all" or list(cfg.serve.variants or []):
        return {t: order for t in targets}
    out = {}
    for t in targets:
        mine = [v for v in order if t != REFERENCE and pairing.drafter_record(rd, v) is not None
                and (pairing.drafter_record(rd, v) or {}).get("variant") == t]
        keep = set(mine) | {pairing.base_variant(v, pairing.drafter_record(rd, v)) for v in mine} | {REFERENCE}
        out[t] = order if t == REFERENCE or not mine else [v for v in order if v in keep]
    return out


def _w4a4(path: Path) -> bool:
    """Whether a drafter quantizes activations to FP4 (NVFP4 W4A4): those get the emulation run too."""
    conf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    q = ((conf.get("transformer_layer_config") or {}).get("quantization_config") or {})
    return any(((g.get("input_activations") or {}).get("type") == "float"
                and (g.get("input_activations") or {}).get("num_bits") == 4)
               for g in (q.get("config_groups") or {}).values())


def _quantized(target: Path) -> bool:
    conf = target / "config.json"
    return conf.is_file() and "quantization_config" in json.loads(conf.read_text(encoding="utf-8"))


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
               served: dict[str, dict] | None = None) -> list[dict]:
    """The worker jobs; `served` (from `served_layouts`): targets served from a copy in another layout."""
    from pipeline.models.formats import load_drafter_config

    s = cfg.serve
    targets, drafters = _targets(cfg, rd), _drafters(cfg, rd)
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_len = int(s.max_model_len or 0) or longest + int(cfg.eval.max_new_tokens) + 64
    sm = float(info.get("capability") or 0)
    on_cpu = info.get("platform") == "cpu"
    base = {"max_tokens": int(cfg.eval.max_new_tokens), "stop_token_ids": stop, "max_model_len": max_len,
            "kv_cache_memory_bytes": int(s.kv_cache_memory_bytes), "seed": int(cfg.seed), "dtype": s.dtype,
            "kv_cache_dtype": str(s.kv_cache_dtype),
            "gpu_memory_utilization": float(s.gpu_memory_utilization or round(0.9 / max(1, parallel(cfg, info)), 3)),
            "cpu_nvfp4_emulation": bool(s.cpu_nvfp4_emulation), "cpu_int4_emulation": bool(s.cpu_int4_emulation),
            "attention_backend": s.attention_backend, "additional_config": dict(s.additional_config or {}),
            "enforce_eager": bool(s.enforce_eager) and not speed_on(cfg, info),
            "tokenizer": str(Path(str(cfg.target.tokenizer or cfg.target.path)).resolve())
            if Path(str(cfg.target.tokenizer or cfg.target.path)).exists() else str(cfg.target.tokenizer or cfg.target.path)}
    if s.speed:  # the worker says "not measured" on the CPU build
        if int(s.speed_batch) < 1 or int(s.speed_max_tokens) < 2:
            raise bad_value("serve.speed_batch/speed_max_tokens", [s.speed_batch, s.speed_max_tokens],
                            "the batch must be >= 1 and the tokens >= 2", "use e.g. 16 and 128")
        if s.speed_tau is not None and not float(s.speed_tau) >= 1:
            raise bad_value("serve.speed_tau", s.speed_tau, "an acceptance length is at least 1",
                            "give the tau of your own run (e.g. 3.2) or null for the reference loop's")
        base["speed"] = {"batches": sorted({1, int(s.speed_batch)}), "max_tokens": int(s.speed_max_tokens)}
    jobs = []
    dflash2 = {v: d for v, d in drafters.items() if is_dflash2(d)}
    drafters = {v: d for v, d in drafters.items() if v not in dflash2}
    for v, dpath in dflash2.items():  # no engine runs a DFlash2 drafter here: vLLM's model class loads it
        reference = Path(str(cfg.target.path))
        jobs.append({"kind": "dflash2_load", "name": f"dflash2--{v}", "variant": v, "target_variant": REFERENCE,
                     "target": str(reference.resolve()) if reference.exists() else str(reference),
                     "drafter": str(dpath.resolve()), "dtype": s.dtype, "seed": int(cfg.seed),
                     "num_speculative_tokens": int(load_drafter_config(dpath).block_size) - 1,
                     "max_model_len": max_len, "cpu_nvfp4_emulation": bool(s.cpu_nvfp4_emulation),
                     "cpu_int4_emulation": bool(s.cpu_int4_emulation)})
    served = served or {}
    serve_with = pairs_to_serve(cfg, rd, targets, drafters)
    for t, tpath in targets.items() if drafters or not dflash2 else ():
        target = str(tpath.resolve()) if tpath.exists() else str(tpath)
        as_served = {"target": served[t]["path"], "served_as": served[t], "language_model_only": True} if t in served else {}
        # linear_backend is engine-wide and vLLM 0.26 has no emulation kernel for int4 (W4A16) layers, so a
        # quantized target is paired with the drafters' default kernel only
        # (on the CPU build every NVFP4 layer is emulated already: serve.cpu_nvfp4_emulation)
        emulate = bool(s.emulate_w4a4) and not on_cpu and sm < 10 and not _quantized(tpath)
        jobs.append({**base, "name": f"{t}--target-only", "target_variant": t, "target": target, "drafter": None,
                     "variant": None, "linear_backend": "auto", "prompts": prompts, **as_served})
        for v, dpath in ((v, drafters[v]) for v in serve_with[t]):
            k = int(load_drafter_config(dpath).block_size) - 1
            backends = ["auto"] + (["emulation"] if emulate and _w4a4(dpath) else [])
            for b in backends:
                jobs.append({**base, "name": f"{t}--{v}" + ("" if b == "auto" else f"--{b}"), "target_variant": t,
                             "target": target, "drafter": str(dpath.resolve()), "variant": v, "linear_backend": b,
                             "num_speculative_tokens": k, "prompts": prompts, **as_served})
    return jobs


def is_dflash2(path: Path) -> bool:
    """Whether a drafter folder holds a DFlash2 drafter (speculators `dflash2` or z-lab `DFlash2DraftModel`)."""
    conf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return conf.get("speculators_model_type") == "dflash2" or "DFlash2DraftModel" in (conf.get("architectures") or [])


# ---------------------------------------------------------------- DFlash2: one draft block, ours vs vLLM's class
PROBE_TOKENS = 48  # context rows of the probe block: the first evaluate prompt, cut to this many tokens


def dflash2_probe(cfg, job: dict, prompt: list[int], folder: Path) -> dict:
    """Write the probe's inputs for the worker (`job["probe"]`: the target's aux hidden states over the prompt,
    the block [bonus, mask, ...], positions) and return the reference loop's own drafter output on them
    (`pipeline.models.dflash` through `fakequant.load_drafter_variant`, the drafter as evaluate runs it, in the
    dtype vLLM builds it in): final hidden states, logits, the selector's greedy path and its scores."""
    import torch
    from safetensors.torch import save_file

    from pipeline.core.dtypes import TORCH_DTYPES
    from pipeline.evaluation import fakequant

    dtype = TORCH_DTYPES[str(job["dtype"])]
    target = fakequant.load_target(str(cfg.target.path), dtype, "cpu", revision=cfg.target.revision,
                                   trust_remote_code=bool(cfg.target.trust_remote_code))
    drafter, _ = fakequant.load_drafter_variant(job["drafter"], target, dtype, "cpu")
    dc = drafter.config
    ids = torch.tensor(prompt[-PROBE_TOKENS:])[None]
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in dc.aux_layer_ids], -1)
        bonus = int(out.logits[0, -1].argmax())
        n, bs = ids.shape[1], int(dc.block_size)
        block = torch.tensor([bonus] + [int(dc.mask_token_id)] * (bs - 1))
        positions = torch.arange(n + bs)
        hidden = drafter.draft_hidden(aux[None], block[None], positions[None])
        logits = drafter.head_logits(hidden)
        path = drafter.candidate_selector.select(hidden[:, 1:], logits[:, 1:], block[:1])
    job["probe"], job["probe_out"] = str(folder / f"{job['name']}.probe.safetensors"), \
        str(folder / f"{job['name']}.vllm.safetensors")
    # where the worker finds the target's embedding and head (it cannot import the target families)
    job["target_head"] = target_families.head_lookup(read_json(Path(job["target"]) / "config.json", "target"))
    save_file({"aux_hidden": aux.contiguous(), "block_ids": block, "context_positions": positions[:n].contiguous(),
               "block_positions": positions[n:].contiguous()}, job["probe"])
    chosen = path.scores.gather(-1, path.candidates.eq(path.tokens[..., None]).float().argmax(-1, keepdim=True))
    return {"context_rows": n, "hidden": hidden[0].float(), "logits": logits[0].float(), "path": path.tokens[0],
            "path_scores": chosen[0, :, 0].float(), "candidates": path.candidates[0]}


def refuse_dflash2_contract(cfg, rd: RunDir, drafters: dict[str, Path]) -> None:
    """Every DFlash2 drafter against the rules of the vLLM range it was written for (its quantize-drafter record's
    `vllm.profile`, else the newest; `pipeline.serving.contract`): a checkpoint that range would read otherwise
    than it stores is refused in one sentence, before anything is written."""
    from pipeline.artifacts.stage_record import load_record
    from pipeline.serving import contract

    for v, path in drafters.items():
        if not is_dflash2(path):
            continue
        rec = load_record(rd.root, f"quantize-drafter-{v}")
        prof = contract.profile(((rec.result.get("vllm") or {}).get("profile") if rec else None) or None)
        problems = contract.check_dir(path, _target_layers(cfg), prof)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise bad_value(f"drafter/{v}", str(path), f"vLLM {prof.versions} would not read this DFlash2 "
                            f"checkpoint as stored: {problems[0]}{more}",
                            "re-run quantize-drafter for it (its ignore list and dense layers follow quant.vllm), "
                            "or drop it with serve.variants")


def _target_layers(cfg) -> int:
    """The configured target's decoder depth (T: draft layer i is vLLM's `model.layers.{i + T}`)."""
    from pipeline.models.targets import text_config

    conf = json.loads((Path(str(cfg.target.path)) / "config.json").read_text(encoding="utf-8"))
    return int(text_config(conf)["num_hidden_layers"])


def check_dflash2(results: list[dict], jobs: list[dict], references: dict[str, dict]) -> dict[str, dict]:
    """{variant: verdict} of every DFlash2 load: what vLLM's class built against what the checkpoint calls for
    (`contract.dflash2_modules`), every tensor consumed, and the draft block against the reference loop's."""
    from pipeline.serving import contract

    by_name = {j["name"]: j for j in jobs}
    out = {}
    for r in results:
        job = by_name[r["name"]]
        modules, probe = [], None
        if r.get("ok"):
            config, names, _ = contract.read_dir(job["drafter"])
            expected = contract.dflash2_modules(config, names, int(r["num_target_layers"]))
            modules = contract.compare_dflash2_modules(expected, r["modules"], r.get("dtype"))
            if r.get("probe_out"):
                probe = compare_probe(references[r["name"]], job)
        for key in ("probe", "probe_out"):  # a failed worker leaves the probe's inputs behind
            Path(job.get(key) or "/nonexistent").unlink(missing_ok=True)
        out[job["variant"]] = verdict.dflash2_entry(r, modules, probe)
    return out


def compare_probe(reference: dict, job: dict) -> dict:
    """The worker's draft block (vLLM's modules) against the reference loop's, in figures; the files go."""
    from safetensors.torch import load_file

    vllm_out = load_file(job["probe_out"])

    def rel(a, b) -> float:
        return round(float((a - b).abs().max() / max(1.0, float(b.abs().max()))), 6)

    v_path = vllm_out["path"]
    v_chosen = vllm_out["path_scores"].gather(-1, vllm_out["candidates"].eq(v_path[:, None]).float().argmax(
        -1, keepdim=True))[:, 0]
    out = {"block_size": int(reference["hidden"].shape[0]), "context_rows": reference["context_rows"],
           "hidden_max_rel_diff": rel(vllm_out["hidden"], reference["hidden"]),
           "logits_max_rel_diff": rel(vllm_out["logits"], reference["logits"]),
           "argmax_equal": int((vllm_out["logits"][1:].argmax(-1) == reference["logits"][1:].argmax(-1)).sum()),
           "slots": int(reference["path"].shape[0]),
           "path_vllm": [int(x) for x in v_path], "path_reference": [int(x) for x in reference["path"]],
           "candidate_sets_equal": all(set(a.tolist()) == set(b.tolist()) for a, b in
                                       zip(vllm_out["candidates"], reference["candidates"])),
           "path_score_max_rel_diff": rel(v_chosen, reference["path_scores"])}
    out["path_equal"] = out["path_vllm"] == out["path_reference"]
    if not out["path_equal"]:  # where the walks part: a near-tie in vLLM's own scores, or a real difference
        slot = next(i for i, (a, b) in enumerate(zip(out["path_vllm"], out["path_reference"])) if a != b)
        row, cands = vllm_out["path_scores"][slot], vllm_out["candidates"][slot].tolist()
        ref_tok = out["path_reference"][slot]
        if ref_tok in cands:  # vLLM's score of its own choice minus its score of the reference's, over the row's scale
            gap = float((row[cands.index(out["path_vllm"][slot])] - row[cands.index(ref_tok)]).abs()
                        / max(1e-12, float(row.abs().max())))
            why = "selector scores"
        else:  # the reference's token fell out of vLLM's top-K: its logit against vLLM's lowest candidate's
            lg = vllm_out["logits"][slot + 1]
            gap = float((lg[cands].min() - lg[ref_tok]).clamp(min=0) / max(1e-12, float(lg.abs().max())))
            why = "top-K edge"
        out["path_first_difference"] = {"slot": slot, "vllm": out["path_vllm"][slot], "reference": ref_tok,
                                        "score_gap": round(gap, 6), "where": why}
    for key in ("probe", "probe_out"):
        Path(job[key]).unlink(missing_ok=True)
    return out


def speed_on(cfg, info: dict) -> bool:
    """Whether engines are timed here: `serve.speed` on a GPU (the CPU build is not timed)."""
    return bool(cfg.serve.speed) and info.get("platform") != "cpu"


def parallel(cfg, info: dict) -> int:
    """Engines at once: `serve.parallel`, or by default 4 on a GPU and 1 on the CPU build (each engine
    takes every core); always 1 when timing (`serve.speed` on a GPU), engines sharing a GPU skew each other."""
    if speed_on(cfg, info):
        return 1
    p = cfg.serve.parallel
    return int(p) if p else (1 if info.get("platform") == "cpu" else 4)


def worker_env(info: dict) -> dict[str, str]:
    """The worker's environment: in-process engine, offline, no usage report; on the CPU build the
    interpreter's libiomp5 preloaded (`worker.cpu_runtime`, found by the probe)."""
    env = {**os.environ, "PYTHONPATH": _worker_pythonpath(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0")}
    if info.get("platform") == "cpu" and info.get("libiomp5"):
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (info["libiomp5"], os.environ.get("LD_PRELOAD", "")) if p)
    return env


def _run_one(python: str, job: dict, folder: Path, env: dict[str, str]) -> dict:
    job_file, result_file, log = (folder / f"{job['name']}.job.json", folder / f"{job['name']}.json",
                                  folder / f"{job['name']}.log")
    result_file.unlink(missing_ok=True)
    atomic_write_json(job_file, job)
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run([python, "-m", "pipeline.serving.worker", str(job_file), str(result_file)],
                              stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(_repo_root()))
    job_file.unlink(missing_ok=True)
    if result_file.is_file():
        return json.loads(result_file.read_text(encoding="utf-8"))
    tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:] or ["no output"]
    return {"ok": False, "name": job["name"], "error": f"the worker exited {proc.returncode} without a result "
            f"({tail[0][:300]})", "job": {k: v for k, v in job.items() if k not in ("prompts", "target_head")}}


def run_jobs(python: str, jobs: list[dict], folder: Path, parallel: int, env: dict[str, str]) -> list[dict]:
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(jobs), desc="serve-check engines", unit="engine")

    def one(job):
        r = _run_one(python, job, folder, env)
        bar.update(1)
        return r

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        results = list(pool.map(one, jobs))
    bar.close()
    return results


def _fp32_bytes(target: Path) -> int:
    """About what the target takes in fp32 once loaded: its safetensors bytes x 2 (bf16) or x 8 (4-bit packed)."""
    files = sum(f.stat().st_size for f in Path(target).glob("*.safetensors")) if Path(target).is_dir() else 0
    return files * (8 if _quantized(Path(target)) else 2)


def _free_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def tie_logits(targets: dict[str, Path], results: list[dict], prompts: dict, limit: int,
               load: dict[str, dict] | None = None) -> dict[str, dict]:
    """The reference target's own fp32 logits over each distinct pair output that parts from the target
    alone's (`verdict.divergences`), teacher-forced on the prompt and that output: at the first difference,
    the logits of the alone's and the pair's tokens, the row's top and largest |logit|; from there on, the
    largest gap below its row's top of any token the pair served. At most `limit` outputs per target (those
    most pairs served first; the rest counted as `unchecked`); a target that cannot be loaded or run here
    (memory, files) is recorded with the reason, never raised. `load`: revision / trust_remote_code per target."""
    points = verdict.divergences(results, prompts)
    if not points:
        return {}
    import torch
    from tqdm import tqdm

    from pipeline.evaluation.fakequant import load_target

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, dict] = {}
    for t, pts in points.items():
        chosen = sorted(pts.items(), key=lambda kv: (-kv[1]["pairs"], kv[0]))[:max(0, limit)]
        found: dict[str, Any] = {"points": {}, "unchecked": len(pts) - len(chosen)}
        out[t] = found
        if not chosen:
            continue
        model = None
        try:
            need, free = _fp32_bytes(targets[t]), _free_bytes(device)
            if need > 0.8 * free:
                found["error"] = (f"the reference target {t} needs about {need / 1e9:.1f} GB in fp32 and {device} "
                                  f"has {free / 1e9:.1f} GB free (serve.lossless_tie=0 skips the check)")
                continue
            model = load_target(str(targets[t]), torch.float32, device, **((load or {}).get(t) or {}))
            for key, pt in tqdm(chosen, desc=f"near-tie check, target {t}", unit="output"):
                s, i = pt["prompt"].rsplit("/", 1)
                prompt, output, j = list(prompts[s][int(i)]), pt["output"], pt["position"]
                with torch.no_grad():
                    rows = model(input_ids=torch.tensor([prompt + output], device=device)).logits[0].float()
                rows = rows[len(prompt) - 1:len(prompt) - 1 + len(output)]  # row k predicts output[k]
                top, scale = rows.max(dim=-1).values, rows.abs().max(dim=-1).values
                served = rows.gather(1, torch.tensor(output, device=device)[:, None])[:, 0]
                below = ((top - served) / scale)[j:]
                first = rows[j]
                found["points"][key] = {
                    "prompt": pt["prompt"], "position": j, "pairs": pt["pairs"],
                    "first": {"top_token": int(first.argmax()), "top": float(top[j]), "scale": float(scale[j]),
                              "logits": {str(x): float(first[x]) for x in (pt["alone_token"], output[j])}},
                    "worst_gap": float(below.max()), "worst_position": j + int(below.argmax()),
                    "tokens_checked": len(output) - j}
        except Exception as exc:  # noqa: BLE001 - any failure of the check is reported, the verdict stays strict
            found["error"] = f"the reference target {t} could not be run here ({type(exc).__name__}: " \
                             f"{str(exc).splitlines()[0][:300] if str(exc) else ''})"
            found["points"] = {}
        finally:
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- the stage
def _reference_tau(rd: RunDir) -> tuple[str | None, dict, dict]:
    """{variant: {subset|all: tau}} of the reference loop (evaluate), which target it ran with, and the
    same for every target of its pair matrix ({target: {variant: ...}})."""
    from pipeline.artifacts.eval_results import read_results

    res = read_results(rd.eval)
    if res is None:
        return None, {}, {}

    def taus(d):
        return {**{s: d["subsets"][s]["tau"] for s in d["subsets"]}, "all": d["overall"]["tau"]}

    out = {v: taus(d) for v, d in res.variants.items()}
    matrix = {t: {v: taus(d) for v, d in row.items()} for t, row in (res.pairs.get("matrix") or {}).items()}
    return res.target.get("variant"), out, matrix


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


def update_report(rd: RunDir, section: str) -> None:
    p = rd.eval / "report.md"
    text = p.read_text(encoding="utf-8") if p.is_file() else "# Evaluation\n"
    if REPORT_BEGIN in text:
        head, rest = text.split(REPORT_BEGIN, 1)
        tail = rest.split(REPORT_END, 1)[1] if REPORT_END in rest else ""
        text = head.rstrip("\n") + "\n\n" + tail.lstrip("\n")
    atomic_write_text(p, text.rstrip("\n") + "\n\n" + REPORT_BEGIN + "\n" + section.rstrip("\n") + "\n" + REPORT_END
                      + "\n")


KV_CACHE_DTYPES = ("auto", "fp8")  # what serve.kv_cache_dtype may be (vLLM's CacheConfig.cache_dtype values we check)


def run(cfg) -> dict:
    s = cfg.serve
    if not 0 < float(s.min_tau_ratio) <= 1:
        raise bad_value("serve.min_tau_ratio", s.min_tau_ratio, "it must be in (0, 1]", "use e.g. 0.9")
    if not 0 <= float(s.lossless_tie) <= 0.1:
        raise bad_value("serve.lossless_tie", s.lossless_tie, "it is a share of the row's largest |logit| and must be "
                        "in [0, 0.1]", "use e.g. 0.01 (1%), or 0 for exact equality only")
    if int(s.lossless_tie_checks) < 0:
        raise bad_value("serve.lossless_tie_checks", s.lossless_tie_checks, "it must be >= 0", "use e.g. 16")
    if str(s.kv_cache_dtype) not in KV_CACHE_DTYPES:
        raise bad_value("serve.kv_cache_dtype", s.kv_cache_dtype, "it is not a KV cache dtype serve-check runs",
                        f"use {' or '.join(KV_CACHE_DTYPES)} (auto = the model dtype)")
    rd = RunDir.from_cfg(cfg)
    if not rd.root.is_dir():
        raise bad_value("run_dir", str(rd.root), "the run directory does not exist", "run the earlier stages first")
    targets, drafters = _targets(cfg, rd), _drafters(cfg, rd)  # bad names fail before the probe
    from pipeline.models import validation
    from pipeline.models.compat import check_compatible

    # every field of each checkpoint's family against its tensors, then every pair (issue 47)
    drafter_configs = [validation.check_drafter(path) for path in drafters.values()]
    for t, path in targets.items():
        tconf = validation.check_target(path, cfg.target.revision if t == REFERENCE else None)
        for dconf in drafter_configs if tconf is not None else ():
            check_compatible(dconf, tconf)
    pairing_warnings, calibrated_on = check_pairing(cfg, rd, targets, drafters)  # an unservable pair: refused
    refuse_dflash2_contract(cfg, rd, drafters)  # static, before the probe: nothing written
    archs = _architectures(targets)
    wrappers = [w for a in archs for w in [layout.WRAPPERS.get(a)] if w and w not in archs]
    info = probe(s.python, archs + wrappers)  # no vLLM: one sentence alone, before any pairing warning, nothing written
    served = served_layouts(info, targets, rd.eval / "serve_check" / "served")
    unbuilt = unbuildable_targets(info, {t: p for t, p in targets.items() if t not in served})
    if unbuilt:  # e.g. a hybrid target on an engine without its model class: said once, nothing written, exit 0
        print(f"[specquant] {unbuilt}", file=sys.stderr)
        return {"output": None, "engines": 0, "skipped": unbuilt}
    for sentence in pairing_warnings:
        pairing.warn(sentence, "serve-check")
    prompts, stop = _prompts(cfg)
    jobs = build_jobs(cfg, rd, info, prompts, stop, served)
    n = parallel(cfg, info)
    print(f"[specquant] serve-check: {len(jobs)} vLLM engines ({len(targets)} targets, {len(drafters)} drafters, "
          f"serve.pairs={cfg.serve.pairs}, + each target alone), {n} at a time, {engine(info)}", file=sys.stderr)
    folder = rd.eval / "serve_check"
    folder.mkdir(parents=True, exist_ok=True)
    first = next(p for ps in prompts.values() for p in ps)
    references = {j["name"]: dflash2_probe(cfg, j, first, folder) for j in jobs if j.get("kind") == "dflash2_load"}
    results = run_jobs(str(s.python), jobs, folder, n, worker_env(info))
    ref_target, ref_tau, ref_matrix = _reference_tau(rd)
    engines = [r for r in results if r.get("kind") != "dflash2_load"]
    load = {REFERENCE: {"revision": cfg.target.revision, "trust_remote_code": bool(cfg.target.trust_remote_code)}}
    ties = (tie_logits(targets, engines, prompts, int(s.lossless_tie_checks), load)
            if float(s.lossless_tie) > 0 and bool(s.require_lossless) else {})
    summary = verdict.summarize(engines, prompts, float(s.min_tau_ratio), float(s.min_tau), ref_target, ref_tau,
                                require_lossless=bool(s.require_lossless), ref_matrix=ref_matrix,
                                ties=ties, tie=float(s.lossless_tie))
    summary["tie_logits"] = ties
    summary["dflash2"] = check_dflash2([r for r in results if r.get("kind") == "dflash2_load"], jobs, references)
    summary["failures"] += [f"DFlash2 drafter {v}: {x}" for v, e in summary["dflash2"].items() for x in e["problems"]]
    if summary["dflash2"] and not summary["versions"]:  # no engine ran: the versions the DFlash2 loads ran under
        summary["versions"] = next(iter(summary["dflash2"].values()))["versions"]
        summary["engine"] = verdict.engine_words(summary["versions"])
    if s.speed:
        summary["speed"] = verdict.speed_summary(results, summary, s.speed_tau)
    summary["pairing_warnings"] = pairing_warnings
    summary["pair_comparison"] = verdict.pair_comparison(summary, calibrated_on)
    summary["probe"] = info
    summary["served_layouts"] = served
    summary["settings"] = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
                           for k, v in ((k, s[k]) for k in s if k != "python")}
    serve_results.write(rd.eval / "serve_check.json", summary)
    update_report(rd, verdict.render(summary))
    failed = summary["failures"]
    if failed:
        raise SpecquantError(f"serve-check failed for {len(failed)} of {len(summary['pairs']) + len(summary['dflash2'])} "
                             "pairs or DFlash2 loads: "
                             + "; ".join(failed[:4]) + (" ..." if len(failed) > 4 else "")
                             + f" (details: {rd.eval / 'serve_check.json'})")
    return {"output": str(rd.eval / "serve_check.json"), "engines": len(jobs), "gpu": info.get("gpu"),
            "platform": info.get("platform"), "vllm": info.get("vllm"),
            "speed": {k: v for k, v in (summary.get("speed") or {}).items() if k != "rows"} or None, "pairs": {k: {"ok": p["ok"], "tau": p.get("tau", {}).get("all"),
                                                    "lossless": p.get("lossless")}
                                                for k, p in summary["pairs"].items()}}


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
                  "reason": f"{engine(info)} cannot build {pair[0]} ({classes[pair[0]]}); served as {pair[1]}, "
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
    words = engine(info)
    return (f"serve-check skips the targets {', '.join(names)}: {words} cannot build "
            + "; ".join(f"{a} ({why})" for a, why in bad.items())
            + ", so their pairs are not checked in vLLM (the evaluate stage's reference loop still checks them)")


def status_for(rd: RunDir, variant: str) -> dict[str, Any]:
    """What the serve check says about one drafter variant (`pipeline.serving.verdict.status_for`)."""
    return verdict.status_for(rd.root, variant)
