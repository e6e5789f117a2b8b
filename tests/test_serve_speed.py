"""serve-check's speed plumbing on real vLLM output: worker result files timed on an H200.

`tests/fixtures/vllm/8b-h200-speed-worker-results.tar.xz` holds result files that
`pipeline.serving.worker` wrote inside vLLM 0.26.0 with a `speed` block (CUDA graphs, batch 1 and 16),
recorded by `python -m bench.speed run` at Qwen3-8B / DFlash-b16 shapes with random weights (nothing is
accepted; docs/benchmarks-archive.md "Speed in the engine", 2026-12-03). CI has no GPU: the timings are never asserted, only
what the stage does with them - the speedup arithmetic, the rows, the report section - and that the
CPU build says "not measured".
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.serving import report, speedup, verdict
from pipeline.stages import serve_check
from tests._support import worker_prompts, worker_results

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "8b-h200-speed-worker-results.tar.xz"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results(FIXTURE, tmp_path_factory.mktemp("speed"))


_prompts = worker_prompts


def _summary(results, ref=None):
    return verdict.summarize(results, _prompts(results), 0.01, 1.0, "bf16", ref or {}, require_lossless=False)


def test_the_recorded_results_are_timed_engines_with_graphs(results):
    assert {r["job"]["variant"] for r in results} >= {None, "bf16/k15"}
    for r in results:
        assert r["ok"] and r["speed"]["measured"] and r["job"]["enforce_eager"] is False
        assert r["versions"]["vllm"] == "0.26.0" and "H200" in r["versions"]["gpu"]
        assert set(r["speed"]["batches"]) == {"1", "16"}
        assert r["weight_bytes"]["target"] > 0


def test_speedup_arithmetic_on_recorded_timings(results):
    s = _summary(results)
    speed = speedup.speed_summary(results, s, user_tau=3.5)
    assert speed["measured"] and speed["batches"] == [1, 16]
    alone = {r["batch"]: r for r in speed["rows"] if r["drafter"] is None and r["target"] == "bf16"}
    pairs = [r for r in speed["rows"] if r["drafter"] is not None and r["target"] == "bf16"]
    assert pairs and set(alone) == {1, 16}
    for r in pairs:
        a = alone[r["batch"]]
        assert r["target_ms_per_step"] == a["ms_per_step"]
        assert r["step_overhead_ms"] == pytest.approx(r["ms_per_step"] - a["ms_per_step"], abs=1e-3)
        assert r["speedup_measured"] == pytest.approx(r["tok_s"] / a["tok_s"], rel=1e-3)
        assert r["speedup_estimated"] == pytest.approx(3.5 * a["ms_per_step"] / r["ms_per_step"], rel=1e-3)
        assert r["tau_estimate_source"] == "serve.speed_tau"
        assert r["weight_bytes_target"] > 0
    # random weights: nothing is accepted, so a pair's measured speedup is its step cost ratio
    assert all(r["tau"] == 1.0 for r in pairs)


def test_estimate_takes_the_reference_loops_tau_and_none_without_one(results):
    pair = next(r for r in results if r["job"]["variant"] == "bf16/k15")
    ref = {"bf16/k15": {"all": 4.2, **{s: 4.2 for s in pair["subsets"]}}}
    s = _summary(results, ref)
    rows = [r for r in speedup.speed_summary(results, s)["rows"] if r["drafter"] == "bf16/k15"]
    assert rows and all(r["tau_estimate"] == 4.2 and r["tau_estimate_source"] == "reference loop" for r in rows)
    assert all(r["speedup_estimated"] == pytest.approx(4.2 * r["target_ms_per_step"] / r["ms_per_step"], rel=1e-3)
               for r in rows)
    bare = speedup.speed_summary(results, _summary(results))
    assert all("speedup_estimated" not in r for r in bare["rows"])  # no tau, no estimate: nothing invented


def test_report_section_names_gpu_versions_date_and_every_row(results):
    s = _summary(results)
    s["speed"] = speedup.speed_summary(results, s, user_tau=3.0)
    text = report.render(s)
    section = text.split("### Speed as served", 1)[1]
    v = results[0]["versions"]
    for word in (v["gpu"], "vLLM 0.26.0", f"torch {v['torch']}", s["speed"]["date"], "CUDA graphs"):
        assert word in section
    assert section.count("\n| bf16 |") == len([r for r in s["speed"]["rows"] if r["target"] == "bf16"])


def test_without_a_gpu_the_section_says_not_measured(results):
    cpu = copy.deepcopy(results)
    for r in cpu:  # what the worker writes on the CPU build
        r["speed"] = {"measured": False, "reason": "not measured on the cpu platform"}
    s = _summary(cpu)
    s["speed"] = speedup.speed_summary(cpu, s)
    assert s["speed"] == {"measured": False, "reason": "not measured on the cpu platform"}
    text = report.render(s)
    assert "Not measured: not measured on the cpu platform. No figure is given." in text
    assert "ms/step" not in text
    assert report.render({**s, "speed": None}).count("Speed as served") == 0


def test_speed_turns_graphs_on_and_one_engine_at_a_time_on_a_gpu_only():
    def cfg(speed, parallel=None):
        return SimpleNamespace(serve=SimpleNamespace(speed=speed, parallel=parallel))

    gpu, cpu = {"platform": "cuda"}, {"platform": "cpu"}
    assert serve_check.speed_on(cfg(True), gpu) and not serve_check.speed_on(cfg(True), cpu)
    assert serve_check.parallel(cfg(True, 4), gpu) == 1
    assert serve_check.parallel(cfg(False), gpu) == 4 and serve_check.parallel(cfg(True), cpu) == 1


def _as_stage_names(results):
    """The bench names its k = 15 drafters `<variant>/k15`; serve-check names a variant by its directory."""
    out = copy.deepcopy([r for r in results if r["job"].get("variant") in (None, "bf16/k15", "w4a16/k15",
                                                                           "w4a16-fcdense/k15")])
    for r in out:
        if r["job"].get("variant"):
            r["job"]["variant"] = r["job"]["variant"].removesuffix("/k15")
    return out


def test_recommendation_is_the_best_speedup_and_names_drafters_slower_than_bf16(results):
    res = _as_stage_names(results)
    s = _summary(res)
    s["speed"] = speedup.speed_summary(res, s, user_tau=3.0)
    advice = speedup.speed_advice(s["speed"])
    pairs = [r for r in s["speed"]["rows"] if r["drafter"] is not None]
    assert {(a["target"], a["batch"]) for a in advice} == {(r["target"], r["batch"]) for r in pairs}
    for a in advice:
        mine = [r for r in pairs if (r["target"], r["batch"]) == (a["target"], a["batch"])]
        assert a["by"] == "speedup_estimated"  # a tau was given: acceptance and step cost weighed together
        assert a["best_speedup"] == max(r["speedup_estimated"] for r in mine)
        bf16 = next(r for r in mine if r["drafter"] == "bf16")
        assert a["slower_than_bf16"] == sorted(r["drafter"] for r in mine if r["ms_per_step"] > bf16["ms_per_step"])
        assert report.advice_words(a) in report.render(s)
    variants = {p["variant"] for p in s["pairs"].values()}
    assert {"bf16", "w4a16"} <= variants
    for variant in variants:
        line = report.variant_status(s, variant)["speed"]
        assert line.startswith("Speed as served") and results[0]["versions"]["gpu"] in line
        assert line.count("at batch") == len(advice)
    # the same engines with no tau: the advice falls back to the measured speedup, and says so
    bare = _summary(res)
    bare["speed"] = speedup.speed_summary(res, bare)
    assert all(a["by"] == "speedup_measured" for a in speedup.speed_advice(bare["speed"]))


def test_card_says_speed_measured_or_not(results):
    from pipeline.provenance.modelcard import _speed_measured

    res = _as_stage_names(results)
    s = _summary(res)
    s["speed"] = speedup.speed_summary(res, s, user_tau=3.0)
    assert _speed_measured({"serving": report.variant_status(s, "w4a16")})
    s["speed"] = {"measured": False, "reason": "not measured on the cpu platform"}
    status = report.variant_status(s, "w4a16")
    assert status["speed"] == "Speed: not measured (not measured on the cpu platform)."
    assert not _speed_measured({"serving": status})
    s.pop("speed")
    assert "speed" not in report.variant_status(s, "w4a16")  # nothing timed, nothing said
