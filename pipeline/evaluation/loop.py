"""The reference loop over prompt subsets: the target alone (the lossless reference), a drafter beside it, and
the acceptance statistics of a subset (`subset_stats`). The evaluate stage runs these per pair; bench/draft_vocab.py
reuses them."""

from __future__ import annotations

import time
from typing import Any


def sync(device: str) -> None:
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


def merge(per_subset: dict[str, list], block_size: int) -> dict:
    return subset_stats([r for rs in per_subset.values() for r in rs], block_size)


def evaluate_variant(target, drafter, subsets, max_new_tokens, stop, device, greedy, desc, memo=None):
    """Every prompt of `subsets` decoded with `drafter` beside `target`: ({subset: [SpecResult]}, {subset: seconds},
    {subset: outputs that differ from `greedy`}). `memo`: a `pipeline.models.target_steps.StepMemo` of this target,
    shared by the drafters evaluated with it (their decodes reuse each other's target forwards)."""
    from tqdm import tqdm

    from pipeline.models.spec_decode import spec_generate

    runs, seconds, mismatches = {}, {}, {}
    bar = tqdm(total=sum(len(s.prompts) for s in subsets), desc=desc, unit="prompt")
    for s in subsets:
        runs[s.name], seconds[s.name], mismatches[s.name] = [], 0.0, 0
        for i, ids in enumerate(s.prompts):
            sync(device)
            t0 = time.perf_counter()
            r = spec_generate(target, drafter, ids, max_new_tokens, stop, memo=memo)
            sync(device)
            seconds[s.name] += time.perf_counter() - t0
            mismatches[s.name] += int(r.output_ids != greedy[s.name][i])
            runs[s.name].append(r)
            bar.update(1)
    bar.close()
    return runs, seconds, mismatches


def greedy_reference(target, subsets, max_new_tokens, stop, device):
    """Plain target greedy outputs (the lossless reference) and their wall time per subset."""
    from tqdm import tqdm

    from pipeline.models.spec_decode import greedy_generate

    outs, seconds = {}, {}
    bar = tqdm(total=sum(len(s.prompts) for s in subsets), desc="target only", unit="prompt")
    for s in subsets:
        outs[s.name], seconds[s.name] = [], 0.0
        for ids in s.prompts:
            sync(device)
            t0 = time.perf_counter()
            outs[s.name].append(greedy_generate(target, ids, max_new_tokens, stop))
            sync(device)
            seconds[s.name] += time.perf_counter() - t0
            bar.update(1)
    bar.close()
    return outs, seconds
