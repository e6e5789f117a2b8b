"""serve-check's decisions: from the workers' results to verdicts (lossless count, vLLM tau, kernels, near-ties,
failures), the DFlash2 loads' verdicts, the pairs compared with their bf16-calibrated base and, where the engines
were timed (`serve.speed`), the speed rows and the fastest pair (`speed_summary`, `speed_advice`). `decide` builds
the whole summary the stage writes (`pipeline.artifacts.serve_results`); the words a reader sees, report section
and card sentences, are `pipeline.serving.report`'s."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pipeline.serving.launch import engine_words
from pipeline.serving.records import LOAD_PROBE, Criteria, PairVerdict, ReferenceTau, ServeSummary, pair_key
from pipeline.serving.speedup import speed_summary

# vLLM's CPU build lists no NVFP4 kernel; weight-only NVFP4 forces Marlin (vLLM 0.32
# model_executor/kernels/linear/__init__.py:1174-1185), W4A4 needs the emulation kernel registered
_NO_CPU_KERNEL = re.compile(r"Failed to find a kernel that can implement the\s+NVFP4|NVFP4 kernel \w+ is not\s+supported"
                            r"|MarlinNvFp4LinearKernel", re.S)


# vLLM 0.32's CPU build declares `_C::static_scaled_fp8_quant` as a stub (no arguments, no CPU kernel), and loading
# per-tensor FP8 weights into a fused Linear (gate_up_proj, qkv_proj) always requantizes every shard at the max() of
# their weight scales through it (layers/quantization/utils/fp8_utils.py:1472 -> utils/w8a8_utils.py:103): a
# static FP8 checkpoint (quant=fp8, fp8-minmax) cannot load there; per-channel (fp8-dynamic) and block (fp8-block)
# FP8 weights take no such step and load
_NO_CPU_STATIC_FP8 = re.compile(r"_C::static_scaled_fp8_quant\(\) expected at most 0 argument")


def unsupported_on(result: dict) -> str | None:
    """Why a pair that failed cannot load on this engine's platform at all (no kernel for its scheme there),
    in words; None for a real failure. Only the CPU build has such gaps the check expects."""
    if result.get("ok") or result.get("platform") != "cpu":
        return None
    text = f"{result.get('error') or ''}\n{result.get('traceback') or ''}"
    if _NO_CPU_KERNEL.search(text):
        return ("not loadable on the CPU build: vLLM has no NVFP4 kernel for the CPU platform"
                + (" (weight-only NVFP4 goes to Marlin, GPU only)" if result.get("nvfp4_emulation") else
                   " (serve.cpu_nvfp4_emulation=false)"))
    if _NO_CPU_STATIC_FP8.search(text):
        return ("not loadable on the CPU build: its _C::static_scaled_fp8_quant is a stub with no CPU kernel, and "
                "vLLM calls it to requantize the shards of a fused per-tensor FP8 Linear (gate_up_proj) at one scale "
                "while loading (layers/quantization/utils/w8a8_utils.py:103)")
    return None


def emulation(result: dict) -> dict[str, str]:
    """{"drafter"|"target": what was emulated} for the layers of a result that ran through an emulation
    kernel the worker registered on the CPU build (empty: every layer ran on a kernel vLLM picked itself)."""
    words = {result.get("nvfp4_emulation"): f"NVFP4 layers through vLLM's own {result.get('nvfp4_emulation')}, "
             "registered for the CPU platform (the CPU build has no NVFP4 kernel)",
             result.get("int4_emulation"): f"int4 layers through specquant's pure-torch {result.get('int4_emulation')} "
             "(vLLM's AVX2 CPU build has no cpu_gemm_wna16; loading is vLLM's)"}
    out: dict[str, set[str]] = {}
    for x in result.get("layers") or []:
        if x.get("kernel") and x["kernel"] in words:
            out.setdefault("target" if x["root"] == "model" else "drafter", set()).add(words[x["kernel"]])
    return {role: "; ".join(sorted(w)) for role, w in sorted(out.items())}


def _tau(drafts: int, accepted: int) -> float | None:
    return round(1 + accepted / drafts, 4) if drafts else None


_DRAFT_LAYER = re.compile(r"(?:^|\.)(fc|layers\.\d+\.(?:self_attn|mlp)\.\w+)$")


def layer_kernels(result: dict) -> dict[str, dict[str, dict[str, int]]]:
    """{"target"|"drafter": {layer type: {kernel: count}}} from the worker's model walk."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in result.get("layers") or []:
        role = "target" if r["root"] == "model" else "drafter"
        m = _DRAFT_LAYER.search(r["name"])
        kind = (m.group(1).split(".")[-1] if m else r["name"].split(".")[-1])
        desc = f"{r['scheme']}/{r['kernel']}"
        out.setdefault(role, {}).setdefault(kind, {})
        out[role][kind][desc] = out[role][kind].get(desc, 0) + 1
    return out


def _main_kernel(result: dict, role: str) -> str | None:
    kernels = sorted({r["kernel"] or r["scheme"] for r in result.get("layers") or []
                      if (r["root"] == "model") == (role == "target")})
    return ", ".join(kernels) if kernels else None


def _prefix_share(r: dict, base: dict, prompts: dict) -> float:
    """Share of the target-alone tokens reproduced before the first difference (1.0 = every output equal)."""
    same = total = 0
    for s in prompts:
        for a, b in zip(r["subsets"][s]["outputs"], base["subsets"][s]["outputs"]):
            same, total = same + _first_difference(a, b), total + len(b)
    return round(same / total, 4) if total else 1.0


def _first_difference(a: list, b: list) -> int:
    """The first position where two outputs differ (the shorter one's length where one extends the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _mismatches(r: dict, base: dict, prompts: dict) -> list[tuple[str, int, int | None, int | None, list]]:
    """(subset/index, first differing position, the target alone's token there, the pair's, the pair's whole
    output) per differing output; a token is None where that output has already ended."""
    out = []
    for s in prompts:
        for i, (a, b) in enumerate(zip(r["subsets"][s]["outputs"], base["subsets"][s]["outputs"])):
            if a == b:
                continue
            j = _first_difference(a, b)
            out.append((f"{s}/{i}", j, b[j] if j < len(b) else None, a[j] if j < len(a) else None, a))
    return out


def divergence_key(prompt: str, position: int, output: list[int]) -> str:
    """`subset/index@position:hash`: one pair output that parts from the target alone's at `position`
    (pairs that served the same output share it)."""
    return f"{prompt}@{position}:" + hashlib.sha256(json.dumps(list(output)).encode()).hexdigest()[:12]


def divergences(results: list[dict], prompts: dict) -> dict[str, dict[str, dict]]:
    """Per target: each distinct pair output (`divergence_key`) that parts from the target alone's, with the
    position, the alone's token there, the whole output (what the reference target is run on, teacher-forced)
    and how many pairs served it. What `lossless_tie` asks the reference logits about."""
    alone = {r["job"]["target_variant"]: r for r in results if r["job"].get("variant") is None and r.get("ok")}
    points: dict[str, dict[str, dict]] = {}
    for r in results:
        t = r["job"]["target_variant"]
        if r["job"].get("variant") is None or not r.get("ok") or t not in alone:
            continue
        for prompt, j, a, b, output in _mismatches(r, alone[t], prompts):
            if a is None or b is None:
                continue  # one output ended: no two tokens to weigh
            pt = points.setdefault(t, {}).setdefault(divergence_key(prompt, j, output), {
                "prompt": prompt, "position": j, "alone_token": a, "output": list(output), "pairs": 0})
            pt["pairs"] += 1
    return points


def near_tie(entry: dict | None, a: int | None, b: int | None, tie: float) -> dict | None:
    """Where the pair's output parts from the target alone's (token b against a): the reference's gap between
    the two at that row (of the row's largest |logit|) and the largest gap below the row's top of any pair
    token from there on (teacher-forced on the pair's own output); a near-tie when both tokens are within `tie`
    of the top there and every later pair token is within `tie` of its row's top, else None."""
    if not entry or tie <= 0 or a is None or b is None or "first" not in entry:
        return None
    first = entry["first"]
    la, lb = first["logits"].get(str(a)), first["logits"].get(str(b))
    if la is None or lb is None or not first.get("scale"):
        return None
    gap = abs(la - lb) / first["scale"]
    below_top = (first["top"] - min(la, lb)) / first["scale"]
    if gap > tie or below_top > tie or entry["worst_gap"] > tie:
        return None
    return {"gap": round(gap, 6), "worst_gap": round(entry["worst_gap"], 6), "tokens_checked": entry["tokens_checked"]}


def summarize(results: list[dict], prompts: dict[str, list], min_ratio: float, min_tau: float,
              ref_target: str | None, ref_tau: dict[str, dict[str, float]], require_lossless: bool = True,
              ref_matrix: dict[str, dict[str, dict[str, float]]] | None = None,
              ties: dict[str, dict[str, dict]] | None = None, tie: float = 0.0) -> ServeSummary:
    """`ref_tau`: the reference loop's {variant: {subset: tau}} with `ref_target`; `ref_matrix`: the same
    per target ({target: {variant: ...}}, evaluate's pair matrix), used where it has the pair. `ties`: the
    reference target's verdict on each differing pair output ({target: {"points": {divergence_key: entry},
    "unchecked": n, "error": ...}}, the references' `tie_logits`); a pair whose every difference is a near-tie
    within `tie` (`near_tie`) is warned, not failed."""
    alone = {r["job"]["target_variant"]: r for r in results if r["job"].get("variant") is None}
    pairs: dict[str, PairVerdict] = {}
    failures: list[str] = []
    for r in results:
        job = r["job"]
        t, v, backend = job["target_variant"], job.get("variant"), job.get("linear_backend", "auto")
        if v is None:
            if not r.get("ok") and not unsupported_on(r):  # a target this build has no kernel for: reported below
                failures.append(f"target {t} alone does not load in vLLM ({r.get('error')})")
            continue
        p = pairs[pair_key(t, v, backend)] = _pair_entry(r, t, v, backend)
        if not r.get("ok"):
            _failed_load(p, r)
            continue
        _draft_attention(p, r)
        bf16 = next((x for x in results if x["job"]["target_variant"] == t and x["job"].get("variant") == "bf16"
                     and x["job"].get("linear_backend", "auto") == "auto" and x.get("ok")), None)
        _lossless(p, r, alone.get(t), bf16, prompts, require_lossless, ((ties or {}).get(t) or {}), tie)
        ref = ((ref_matrix or {}).get(t) or {}).get(v) or (ref_tau.get(v) if t == ref_target else None)
        _acceptance(p, r, ref)
    _tau_floors(pairs, min_ratio, min_tau)
    for p in pairs.values():
        p["ok"] = not p["problems"] and "unsupported" not in p
        failures += [f"drafter {p['variant']} with target {p['target']}"
                     + ("" if p["linear_backend"] == "auto" else f" (linear_backend={p['linear_backend']})")
                     + f": {x}" for x in p["problems"]]
    versions = next((r.get("versions") for r in results if r.get("versions") and "vllm" in r["versions"]), {})
    unsupported = sorted(k for k, p in pairs.items() if "unsupported" in p)
    return {"schema": "specquant.serve_check/v1", "versions": versions, "min_tau_ratio": min_ratio,
            "engine": engine_words(versions), "unsupported": unsupported,
            "require_lossless": require_lossless, "lossless_tie": tie,
            "min_tau": min_tau, "reference_target": ref_target, "pairs": pairs,
            "targets_alone": {t: {"ok": r.get("ok"), "error": r.get("error"), "load_s": r.get("load_s"),
                                  "kernel": _main_kernel(r, "target"), "layers": layer_kernels(r),
                                  "emulated": emulation(r),
                                  "peak_gpu_bytes": r.get("peak_gpu_bytes")} for t, r in alone.items()},
            "failures": failures}


def _pair_entry(r: dict, t: str, v: str, backend: str) -> PairVerdict:
    """A pair's figures before any judgement: times, memory, versions, the kernels of its layers."""
    p: PairVerdict = {"target": t, "variant": v, "linear_backend": backend, "ok": False,
                      "load_s": r.get("load_s"), "generate_s": r.get("generate_s"),
                      "peak_gpu_bytes": r.get("peak_gpu_bytes"), "versions": r.get("versions"),
                      "drafter_kernel": _main_kernel(r, "drafter"), "target_kernel": _main_kernel(r, "target"),
                      "layers": layer_kernels(r), "kernel_log": r.get("kernel_log"), "problems": []}
    emulated = emulation(r)
    if emulated:
        p["emulated"] = emulated
    return p


def _failed_load(p: PairVerdict, r: dict) -> None:
    """A pair that did not load or run: a failure, or neither pass nor failure where this build has no kernel."""
    p["error"] = r.get("error")
    why = unsupported_on(r)
    if why:
        p["unsupported"] = why  # neither a pass nor a failure of the checkpoint: reported as such
    else:
        p["problems"].append(f"does not load or run in vLLM ({r.get('error')})")


def _draft_attention(p: PairVerdict, r: dict) -> None:
    causal = [a["name"] for a in r.get("draft_attention") or [] if a["causal"]]
    if causal:  # DFlash drafts a block at once: a causal draft layer is a misread flag, not a slower drafter
        p["problems"].append(f"vLLM built draft attention layers {causal} causal (the checkpoint's is_causal / "
                             "sliding_window_non_causal say so); a DFlash drafter attends within its block "
                             "non-causally, so fix the flag (is_causal: false)")


def _lossless(p: PairVerdict, r: dict, base: dict | None, bf16: dict | None, prompts: dict,
              require_lossless: bool, found: dict, tie: float) -> None:
    """Outputs equal to the same target alone's (and to the bf16 drafter's beside it); differences that are all
    near-ties of the reference target's logits (`found`: its `tie_logits` entry) are a warning, not a failure."""
    v = p["variant"]
    n = sum(len(ps) for ps in prompts.values())
    if base is None or not base.get("ok"):
        p["problems"].append(f"target {p['target']} alone did not run, so losslessness is unknown")
        equal = None
    else:
        equal = sum(int(a == b) for s in prompts for a, b in
                    zip(r["subsets"][s]["outputs"], base["subsets"][s]["outputs"]))
    p["lossless"] = {"equal": equal, "prompts": n}
    if base is not None and base.get("ok"):
        p["lossless"]["agreeing_prefix"] = _prefix_share(r, base, prompts)
    if bf16 is not None and v != "bf16":  # same served numerics but the drafter's rounding
        p["lossless"]["equal_to_bf16_drafter"] = sum(
            int(a == b) for s in prompts for a, b in zip(r["subsets"][s]["outputs"], bf16["subsets"][s]["outputs"]))
    if equal is None or equal == n:
        return
    diffs = _mismatches(r, base, prompts)
    tied = [(prompt, j, a, b, g) for prompt, j, a, b, out in diffs
            for g in [near_tie((found.get("points") or {}).get(divergence_key(prompt, j, out)), a, b, tie)]
            if g is not None]
    if tied:
        p["lossless"]["near_ties"] = [{"prompt": prompt, "position": j, "tokens": [a, b], **g}
                                      for prompt, j, a, b, g in tied]
    if tied and len(tied) == n - equal:  # every differing output judged a near-tie (none missing)
        p["warnings"] = [f"{n - equal} of {n} outputs part from the target alone's on a near-tie of the "
                         "target's own fp32 logits (" + "; ".join(
                             f"{prompt} token {j}: {a} alone vs {b} here, {g['gap']:.2%} of the row's "
                             f"largest |logit| apart; the pair's {g['tokens_checked']} tokens from there "
                             f"each within {g['worst_gap']:.2%} of the reference's top"
                             for prompt, j, a, b, g in tied) + ")"]
    elif require_lossless:
        why = []
        if tied:
            why.append(f"{len(tied)} of the {n - equal} differences {'is a near-tie' if len(tied) == 1 else 'are near-ties'}")
        if found.get("error"):
            why.append(f"the near-tie check did not run: {found['error']}")
        elif found.get("unchecked"):
            why.append(f"{found['unchecked']} differing outputs past serve.lossless_tie_checks were not checked")
        p["problems"].append(f"not lossless ({equal}/{n} outputs equal the target alone"
                             + "".join(f"; {w}" for w in why) + ")")


def _acceptance(p: PairVerdict, r: dict, ref: dict | None) -> None:
    """vLLM's tau and acceptance per position, per subset and over all; beside the reference loop's tau `ref`."""
    tau, per_pos = {}, {}
    drafts = accepted = 0
    pos_total: list[int] = []
    for s, d in r["subsets"].items():
        tau[s] = _tau(d["drafts"], d["accepted"])
        per_pos[s] = [round(a / d["drafts"], 4) if d["drafts"] else None for a in d["accepted_per_pos"]]
        drafts, accepted = drafts + d["drafts"], accepted + d["accepted"]
        pos_total = [a + b for a, b in zip(pos_total + [0] * (len(d["accepted_per_pos"]) - len(pos_total)),
                                           d["accepted_per_pos"] + [0] * (len(pos_total) - len(d["accepted_per_pos"])))]
    tau["all"] = _tau(drafts, accepted)
    per_pos["all"] = [round(a / drafts, 4) if drafts else None for a in pos_total]
    p["tau"], p["acceptance_per_position"], p["drafts"] = tau, per_pos, drafts
    if ref:
        p["reference_tau"] = ref
        p["tau_minus_reference"] = {s: round(tau[s] - ref[s], 4) for s in tau
                                    if tau.get(s) is not None and ref.get(s) is not None}


def _tau_floors(pairs: dict[str, PairVerdict], min_ratio: float, min_tau: float) -> None:
    """Every pair's tau against `min_tau` and against `min_ratio` of the bf16 drafter's beside the same target."""
    for p in pairs.values():
        if "tau" not in p:
            continue
        ref = pairs.get(f"{p['target']}/bf16")
        all_tau = p["tau"]["all"]
        if all_tau is None or all_tau < min_tau:
            p["problems"].append(f"tau {all_tau} is below {min_tau} (the drafter accepts almost nothing)")
        if ref and ref.get("tau") and ref["tau"]["all"] and all_tau is not None and p["variant"] != "bf16":
            p["tau_ratio_to_bf16"] = round(all_tau / ref["tau"]["all"], 4)
            if p["tau_ratio_to_bf16"] < min_ratio:
                p["problems"].append(f"tau {all_tau} is {p['tau_ratio_to_bf16']:.3f} of the bf16 drafter's "
                                     f"{ref['tau']['all']}, below serve.min_tau_ratio {min_ratio}")



# what a load-and-probe check is, in words: no engine runs a DFlash2 drafter here (vLLM 0.32's V1 runner refuses
# candidate-head drafts, config/vllm.py:2990-2991; its V2 runner needs Triton, which has no CPU backend)
LOAD_PROBE_SCOPE = "no engine run"
# the draft block through vLLM's modules vs the reference loop's: hidden states and logits within this share of
# the largest magnitude (bf16 rounding of two orders of the same sums) and the selector path equal
PROBE_TOLERANCE = 0.05
PROBE_TIE = 0.01  # two selector scores this close (of the row's largest) are a tie numerics may break either way


def load_probe_entry(result: dict, module_problems: list[str], probe: dict | None,
                     fp4_activation: bool = False) -> dict[str, Any]:
    """One variant of a load-and-probe family (DFlash2) loaded by vLLM's own model class (no engine run): the
    verdict and its figures. Not a lossless count nor a tau: no engine generated anything. `fp4_activation`: the
    checkpoint quantizes activations to FP4 (`CheckpointInfo.fp4_activation`), whose probe numerics are reported,
    not judged."""
    v = result.get("versions") or {}
    e: dict[str, Any] = {"ok": False, "scope": LOAD_PROBE_SCOPE, "model_class": result.get("model_class"),
                         "said": result.get("no_engine") or f"loaded by vLLM {v.get('vllm')}'s DFlash2 model class, "
                         "no engine run", "versions": v, "load_s": result.get("load_s"),
                         "checkpoint_tensors": result.get("checkpoint_tensors"),
                         "borrowed_from_target": result.get("borrowed_from_target"),
                         "modules": {k: m.get("scheme") or ("parameter" if m["kind"] == "parameter" else "dense")
                                     for k, m in sorted((result.get("modules") or {}).items())},
                         "kernels": result.get("kernels") or {}, "emulated": emulation_words(result),
                         "problems": []}
    if not result.get("ok"):
        e["error"], e["failed_at"] = result.get("error"), result.get("failed_at")
        why = unsupported_on(result)
        if why:  # weight-only NVFP4: no CPU kernel to build its layers with (neither a pass nor a failure)
            e["unsupported"] = why
            return e
        e["problems"].append(f"vLLM's DFlash2 class fails at its {e['failed_at'] or 'start'} step ({e['error']})")
        return e
    if result.get("unwritten"):
        e["problems"].append(f"vLLM's load_weights never wrote {result['unwritten']} (missing from the checkpoint)")
    if result.get("partly_written"):
        e["problems"].append(f"vLLM's load_weights wrote only part of {result['partly_written']} (a fused layer "
                             "missing a shard)")
    e["problems"] += module_problems
    if result.get("kernels_error"):
        e["forward"] = f"not run: no kernel for its scheme on the {result.get('platform')} platform " \
                       f"({result['kernels_error']})"
    elif probe is not None:
        e["forward"] = probe
        # the selector's path is what the engine drafts; the head's argmax and the top-K sets are reported (in bf16 a
        # near-tie flips them: the tiny DFlash2 drafter's bf16 block, argmax 6/7 with the path and logits equal)
        # a path that parts on a near-tie (vLLM scores both tokens within PROBE_TIE of its row's scale; later slots
        # follow their own predecessor) is numerics, reported; a path that parts on a clear margin is a difference
        first = probe.get("path_first_difference") or {}
        tie = first.get("score_gap") is not None and first["score_gap"] <= PROBE_TIE
        same = ((probe["path_equal"] or tie) and probe["hidden_max_rel_diff"] <= PROBE_TOLERANCE
                and probe["logits_max_rel_diff"] <= PROBE_TOLERANCE)
        if same and tie:
            e["warnings"] = [f"its selector path parts from the reference loop's at slot {first['slot']} on a near-tie "
                             f"({first.get('where')}: vLLM puts {first['vllm']} and {first['reference']} "
                             f"{first['score_gap']} of the row's largest value apart; hidden "
                             f"{probe['hidden_max_rel_diff']}, logits {probe['logits_max_rel_diff']} of the largest "
                             "magnitude)"]
        if fp4_activation and not same:  # activations quantized: two emulations of FP4 inputs, reported (docs/serving.md)
            e["warnings"] = [f"its draft block through vLLM's EmulationNvFp4LinearKernel differs from the reference "
                             f"loop's compressed-tensors QDQ (path {probe['path_vllm']} vs {probe['path_reference']}, "
                             f"hidden {probe['hidden_max_rel_diff']} of the largest magnitude): W4A4 activation "
                             "numerics are reported, not judged, on this engine"]
        elif not same:
            e["problems"].append(f"its draft block through vLLM's modules differs from the reference loop's (path "
                                 f"{probe['path_vllm']} vs {probe['path_reference']}, argmax {probe['argmax_equal']}/"
                                 f"{probe['slots']}, hidden {probe['hidden_max_rel_diff']}, logits "
                                 f"{probe['logits_max_rel_diff']} of the largest magnitude)")
    e["ok"] = not e["problems"] and "unsupported" not in e
    return e


def emulation_words(result: dict) -> str | None:
    """The emulation kernels a DFlash2 load's quantized layers ended on (None: none)."""
    words = emulation({**result, "layers": [{"root": "drafter", "kernel": k} for k in (result.get("kernels") or {}).values()]})
    return words.get("drafter")


def pair_comparison(summary: dict, calibrated_on: dict[str, tuple[str, str]]) -> list[dict]:
    """{variant: (calibration target, base variant)} -> each such drafter vs its bf16-calibrated base, per
    served target, from vLLM's tau (all prompts)."""
    out = []
    for v, (cal, base) in sorted(calibrated_on.items()):
        for t in sorted({p["target"] for p in summary["pairs"].values()}):
            a, b = summary["pairs"].get(f"{t}/{v}"), summary["pairs"].get(f"{t}/{base}")
            if not a or not b:
                continue
            ta, tb = (a.get("tau") or {}).get("all"), (b.get("tau") or {}).get("all")
            out.append({"variant": v, "calibrated_on": cal, "base": base, "served_with": t, "tau": ta, "tau_base": tb,
                        "difference": round(ta - tb, 4) if ta is not None and tb is not None else None})
    return out


def decide(results: list[dict], prompts: dict[str, list], criteria: Criteria, reference: ReferenceTau, *,
           ties: dict[str, dict], load_probes: dict[str, dict], speed: bool, speed_tau: float | None,
           pairing_warnings: list[str], calibrated_on: dict[str, tuple[str, str]],
           context: dict[str, Any]) -> ServeSummary:
    """The whole summary of one serve check: the engines' verdicts (`summarize`), the near-tie check `ties` (the
    references' `tie_logits`), the load-and-probe verdicts `load_probes` (DFlash2; `load_probe_entry` each), the speed rows where
    `speed` (`speed_summary`), the pairing warnings, each calibrated drafter against its base, and `context`
    (the probe, served layouts and settings, recorded as given)."""
    engines = [r for r in results if r.get("kind") != LOAD_PROBE]
    summary = summarize(engines, prompts, criteria.min_tau_ratio, criteria.min_tau, reference.target,
                        reference.tau or {}, require_lossless=criteria.require_lossless,
                        ref_matrix=reference.matrix or {}, ties=ties, tie=criteria.lossless_tie)
    summary["tie_logits"] = ties
    summary["load_probes"] = load_probes
    summary["failures"] += [f"DFlash2 drafter {v}: {x}" for v, e in load_probes.items() for x in e["problems"]]
    if load_probes and not summary["versions"]:  # no engine ran: the versions the load-and-probes ran under
        summary["versions"] = next(iter(load_probes.values()))["versions"]
        summary["engine"] = engine_words(summary["versions"])
    if speed:
        summary["speed"] = speed_summary(results, summary, speed_tau)
    summary["pairing_warnings"] = pairing_warnings
    summary["pair_comparison"] = pair_comparison(summary, calibrated_on)
    summary.update(context)
    return summary
