"""serve-check's references, in torch on the project's side: what the served outputs are held against.

- Near-ties (`tie_logits`): where a pair's output parts from the same target alone's, the reference target (fp32,
  transformers) run teacher-forced over the prompt and that output; `pipeline.serving.verdict.near_tie` judges.
- Load-and-probe drafters (DFlash2: `load_probe_inputs`, `compare_probe`, `check_load_probes`): the reference loop's
  own drafter run on one draft block, the probe's inputs written for the load-and-probe worker, and its output held
  against the reference's.

The loaders are the reference loop's (`pipeline.evaluation.fakequant`), passed in (`Loaders`) by the stage: this
floor does not import the evaluation package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.io import read_json
from pipeline.models import targets as target_families
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.serving import contract, verdict
from pipeline.serving.jobs import is_quantized
from pipeline.serving.records import LoadProbeJob


@dataclass(frozen=True)
class Loaders:
    """The reference loop's loaders: `load_target(path, dtype, device, **kw)` and
    `load_drafter_variant(path, target, dtype, device)` (`pipeline.evaluation.fakequant`)."""
    load_target: Callable
    load_drafter_variant: Callable


# ---------------------------------------------------------------- near-ties: the reference target's own logits
def _fp32_bytes(target: Path) -> int:
    """About what the target takes in fp32 once loaded: its safetensors bytes x 2 (bf16) or x 8 (4-bit packed)."""
    files = sum(f.stat().st_size for f in Path(target).glob("*.safetensors")) if Path(target).is_dir() else 0
    return files * (8 if is_quantized(Path(target)) else 2)


def _free_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def tie_logits(targets: dict[str, Path], results: list, prompts: dict, limit: int,
               load: dict[str, dict] | None = None, *, load_target: Callable) -> dict[str, dict]:
    """The reference target's own fp32 logits over each distinct pair output that parts from the target
    alone's (`verdict.divergences`), teacher-forced on the prompt and that output: at the first difference,
    the logits of the alone's and the pair's tokens, the row's top and largest |logit|; from there on, the
    largest gap below its row's top of any token the pair served. At most `limit` outputs per target (those
    most pairs served first; the rest counted as `unchecked`); a target that cannot be loaded or run here
    (memory, files) is recorded with the reason, never raised. `load`: revision / trust_remote_code per target;
    `load_target`: the reference loop's loader (`Loaders.load_target`)."""
    points = verdict.divergences(results, prompts)
    if not points:
        return {}
    import torch
    from tqdm import tqdm

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


# ---------------------------------------------------------------- DFlash2: one draft block, ours vs vLLM's class
PROBE_TOKENS = 48  # context rows of the probe block: the first evaluate prompt, cut to this many tokens


def load_probe_inputs(cfg, job: LoadProbeJob, prompt: list[int], folder: Path, loaders: Loaders) -> dict:
    """Write the probe's inputs for the worker (`job["probe"]`: the target's aux hidden states over the prompt,
    the block [bonus, mask, ...], positions) and return the reference loop's own drafter output on them
    (`pipeline.models.dflash` through `loaders.load_drafter_variant`, the drafter as evaluate runs it, in the
    dtype vLLM builds it in): final hidden states, logits, the selector's greedy path and its scores."""
    import torch
    from safetensors.torch import save_file

    from pipeline.core.dtypes import TORCH_DTYPES

    dtype = TORCH_DTYPES[str(job.dtype)]
    target = loaders.load_target(str(cfg.target.path), dtype, "cpu", revision=cfg.target.revision,
                                 trust_remote_code=bool(cfg.target.trust_remote_code))
    drafter, _ = loaders.load_drafter_variant(job.drafter, target, dtype, "cpu")
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
    job.probe, job.probe_out = str(folder / f"{job.name}.probe.safetensors"), str(folder / f"{job.name}.vllm.safetensors")
    # where the worker finds the target's embedding and head (it cannot import the target families)
    job.target_head = target_families.head_lookup(read_json(Path(job.target) / "config.json", "target"))
    save_file({"aux_hidden": aux.contiguous(), "block_ids": block, "context_positions": positions[:n].contiguous(),
               "block_positions": positions[n:].contiguous()}, job.probe)
    chosen = path.scores.gather(-1, path.candidates.eq(path.tokens[..., None]).float().argmax(-1, keepdim=True))
    return {"context_rows": n, "hidden": hidden[0].float(), "logits": logits[0].float(), "path": path.tokens[0],
            "path_scores": chosen[0, :, 0].float(), "candidates": path.candidates[0]}


def check_load_probes(results: list, jobs: list, references: dict[str, dict]) -> dict[str, dict]:
    """{variant: verdict} of every load-and-probe drafter (DFlash2): what vLLM's class built against what the checkpoint calls for
    (`contract.load_probe_modules`), every tensor consumed, and the draft block against the reference loop's."""
    by_name = {j["name"]: j for j in jobs}
    out = {}
    for r in results:
        job = by_name[r["name"]]
        modules, probe = [], None
        if r.get("ok"):
            config, names, _ = contract.read_dir(job["drafter"])
            expected = contract.load_probe_modules(config, names, int(r["num_target_layers"]))
            modules = contract.compare_load_probe_modules(expected, r["modules"], r.get("dtype"),
                                                          card_name=contract.family(config).card_name)
            if r.get("probe_out"):
                probe = compare_probe(references[r["name"]], job)
        for key in ("probe", "probe_out"):  # a failed worker leaves the probe's inputs behind
            Path(job.get(key) or "/nonexistent").unlink(missing_ok=True)
        out[job["variant"]] = verdict.load_probe_entry(r, modules, probe,
                                                       CheckpointInfo.read(job["drafter"]).fp4_activation)
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
