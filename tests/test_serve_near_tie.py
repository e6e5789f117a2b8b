"""serve-check's lossless rule on a hybrid target served by vLLM 0.26.0 on an H200: a pair's output that
parts from the target alone's only where the target's own (fp32, reference) logits hold both tokens within
`serve.lossless_tie` is lossless up to a near-tie; any other difference fails.

`tests/fixtures/vllm/tiny-hybrid-h200-worker-results.tar.xz` holds the 24 `eval/serve_check/*.json` files the
worker wrote inside vLLM 0.26.0 (2026-12-03, `serve-check experiment=tiny-hybrid` on a `make all
ARGS="experiment=tiny-hybrid"` run; docs/serving.md). The reference target is the committed tiny hybrid target
(assets/tiny-hybrid/target), run here on CPU by the stage's own `tie_logits`; every size comes from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.config import compose
from pipeline.serving import verdict
from pipeline.stages import serve_check as sc
from tests._support import worker_results

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "tiny-hybrid-h200-worker-results.tar.xz"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cfg = compose(["experiment=tiny-hybrid", f"runs_root={tmp_path_factory.mktemp('runs')}"])
    prompts, _ = sc._prompts(cfg)  # the evaluate stage's rendering: the ids the worker served
    results = [r for r in worker_results(FIXTURE, tmp_path_factory.mktemp("vllm"))
               if r["job"]["target_variant"] == "bf16"]  # the bf16 target is committed; its W4A16 is made by a run
    return {"bf16": Path(str(cfg.target.path))}, prompts, results, float(cfg.serve.lossless_tie)


def _summary(results, prompts, ties, tie):
    return verdict.summarize(results, prompts, 0.9, 1.05, None, {}, ties=ties, tie=tie)


def test_a_divergence_on_the_targets_near_tie_is_a_warning_not_a_failure(world):
    targets, prompts, results, tie = world
    plain = _summary(results, prompts, {}, tie)
    n = sum(len(v) for v in prompts.values())
    differing = {p["lossless"]["equal"] for p in plain["pairs"].values()}
    assert differing and max(differing) < n  # vLLM's verify and its one-token decode parted somewhere
    assert all("not lossless" in " ".join(p["problems"]) for p in plain["pairs"].values())

    points = verdict.divergences(results, prompts)["bf16"]
    ties = sc.tie_logits(targets, results, prompts, 16)
    assert set(ties["bf16"]) == set(points)
    for key, entry in ties["bf16"].items():
        la, lb = (entry["logits"][str(t)] for t in points[key]["tokens"][:2])
        assert entry["top"] >= max(la, lb) and entry["scale"] >= abs(entry["top"])

    s = _summary(results, prompts, ties, tie)
    assert s["failures"] == []
    for p in s["pairs"].values():
        assert p["ok"] and p["lossless"]["near_ties"] and all(t["gap"] <= tie for t in p["lossless"]["near_ties"])
        assert p["lossless"]["equal"] + len(p["lossless"]["near_ties"]) == n
    text = verdict.render(s)
    assert "near-tie" in text and "(up to the near-ties above)" in text
    assert "near-tie of the target's logits" in verdict.variant_status(s, "bf16")["summary"]

    # a tolerance below the measured gap turns the same difference back into a failure
    gap = min(t["gap"] for p in s["pairs"].values() for t in p["lossless"]["near_ties"])
    strict = _summary(results, prompts, ties, gap / 2)
    assert all("not lossless" in " ".join(p["problems"]) for p in strict["pairs"].values())


def test_a_difference_where_the_target_is_sure_fails(world):
    """A pair's first token replaced by the one the target ranks lowest there: the reference says the two are
    far apart, so the pair fails although every other output is as vLLM served it."""
    import torch

    from pipeline.evaluation.fakequant import load_target

    targets, prompts, results, tie = world
    broken = json.loads(json.dumps(results))
    pair = next(r for r in broken if r["job"]["variant"] == "w4a16")
    alone = next(r for r in broken if r["job"]["variant"] is None)
    s0 = next(iter(prompts))
    first = alone["subsets"][s0]["outputs"][0]
    model = load_target(str(targets["bf16"]), torch.float32, "cpu")
    with torch.no_grad():
        row = model(input_ids=torch.tensor([list(prompts[s0][0])])).logits[0, -1]
    assert int(row.argmax()) == first[0]  # the reference agrees with what vLLM served alone there
    worst = int(row.argmin())
    pair["subsets"][s0]["outputs"][0] = [worst] + first[1:]
    ties = sc.tie_logits(targets, broken, prompts, 16)
    entry = ties["bf16"][verdict.divergence_key(f"{s0}/0", 0)]
    assert entry["position"] == 0 and entry["top_token"] == first[0]
    assert (entry["top"] - entry["logits"][str(worst)]) / entry["scale"] > tie
    summary = _summary(broken, prompts, ties, tie)
    p = summary["pairs"]["bf16/w4a16"]
    assert not p["ok"] and any("not lossless" in x and "near-ties" in x for x in p["problems"])
    assert all(q["ok"] for k, q in summary["pairs"].items() if k != "bf16/w4a16")  # each point judged on its own


def test_without_the_reference_or_with_tie_zero_every_difference_fails(world):
    targets, prompts, results, tie = world
    ties = sc.tie_logits(targets, results, prompts, 16)
    assert all("not lossless" in " ".join(p["problems"])
               for p in _summary(results, prompts, ties, 0.0)["pairs"].values())
    assert sc.tie_logits(targets, results, prompts, 0) == {}  # no checks asked: nothing computed
