"""serve-check's typed records (`pipeline.serving.records`) against the JSON the worker reads and writes.

The recorded results are real worker output: `tests/fixtures/vllm/*-worker-results.tar.xz` (vLLM 0.26 on an H200,
the tiny, tiny-hybrid and 8B speed runs). Each goes through `WorkerResult` and comes back the same bytes, and the
verdict built from the records is the verdict built from the JSON. The jobs the stage builds for the tiny world
go to JSON and back unchanged, with the keys the recorded jobs had.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.io import dumps_json
from pipeline.serving import verdict, worker_load_probe
from pipeline.serving.records import LOAD_PROBE, EngineJob, LoadProbeJob, WorkerResult, job_from_json
from tests._support import REPO, worker_prompts, worker_results

ARCHIVES = sorted((Path(__file__).parent / "fixtures" / "vllm").glob("*-worker-results.tar.xz"))


@pytest.fixture(scope="module", params=[a.name for a in ARCHIVES])
def recorded(request, tmp_path_factory) -> list[dict]:
    return worker_results(Path(__file__).parent / "fixtures" / "vllm" / request.param,
                          tmp_path_factory.mktemp("results"))


def test_a_recorded_worker_result_round_trips_to_the_same_bytes(recorded):
    for raw in recorded:
        record = WorkerResult.from_json(raw)
        assert record.ok is raw["ok"] and record.name == raw["name"] and record.job == raw["job"]
        assert dumps_json(record.to_json()) == dumps_json(raw), raw["name"]
        assert dict(record) == raw and record.get("subsets") == raw.get("subsets")  # read as its JSON


def test_the_verdict_reads_records_as_it_reads_the_json(recorded):
    prompts = worker_prompts(recorded)
    records = [WorkerResult.from_json(r) for r in recorded]
    assert dumps_json(verdict.summarize(records, prompts, 0.9, 1.05, None, {})) == \
        dumps_json(verdict.summarize(recorded, prompts, 0.9, 1.05, None, {}))


def test_a_failed_worker_result_says_how_it_ended():
    r = WorkerResult(ok=False, name="bf16--w4a16", error="the worker exited 1 without a result (boom)",
                     job={"name": "bf16--w4a16"})
    assert r.to_json() == {"ok": False, "name": "bf16--w4a16", "job": {"name": "bf16--w4a16"},
                           "error": "the worker exited 1 without a result (boom)"}
    assert not r.load_probe and WorkerResult.from_json({**r.to_json(), "kind": "load_probe"}).load_probe


def test_the_stage_jobs_round_trip_with_the_recorded_keys(monkeypatch):
    from pipeline.core.config import compose
    from pipeline.stages import serve_check as sc

    tiny = REPO / "assets" / "tiny"
    monkeypatch.setattr(sc, "_targets", lambda cfg, rd: {"bf16": tiny / "target"})
    monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: {"bf16": tiny / "drafter",
                                                          "d2": tiny / "drafter-dflash2"})
    cfg = compose(["serve.speed=false"])
    jobs = sc.build_jobs(cfg, None, {"platform": "cpu"}, {"s": [[1, 2, 3]]}, [0])
    assert [type(j) for j in jobs] == [LoadProbeJob, EngineJob, EngineJob]
    assert [j["name"] for j in jobs] == ["dflash2--d2", "bf16--target-only", "bf16--bf16"]
    for job in jobs:
        wire = json.loads(json.dumps(job.to_json()))
        assert job_from_json(wire) == job and job_from_json(wire).to_json() == job.to_json()
    probe, alone, pair = (j.to_json() for j in jobs)
    # the keys of the jobs the recorded workers ran (tiny-hybrid: served in its own layout, no served_as here),
    # plus kv_cache_dtype (serve.kv_cache_dtype, added since)
    recorded = {"additional_config", "attention_backend", "cpu_int4_emulation", "cpu_nvfp4_emulation", "drafter",
                "dtype", "enforce_eager", "gpu_memory_utilization", "kv_cache_memory_bytes", "linear_backend",
                "max_model_len", "max_tokens", "name", "seed", "stop_token_ids", "target", "target_variant",
                "tokenizer", "variant", "prompts", "kv_cache_dtype"}
    assert set(alone) == recorded and set(pair) == recorded | {"num_speculative_tokens"}
    assert alone["drafter"] is None and alone["variant"] is None and pair["prompts"] == {"s": [[1, 2, 3]]}
    assert set(probe) == {"kind", "name", "variant", "target_variant", "target", "drafter", "dtype", "seed",
                          "num_speculative_tokens", "max_model_len", "cpu_nvfp4_emulation", "cpu_int4_emulation"}
    assert probe["kind"] == "load_probe" == LOAD_PROBE == worker_load_probe.LOAD_PROBE  # the stage's and the worker's
