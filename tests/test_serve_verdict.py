"""serve-check verdicts on real vLLM output: the worker result files of one tiny-world run on an H200.

`tests/fixtures/vllm/tiny-h200-worker-results.tar.xz` holds the `eval/serve_check/*.json` files that
`pipeline.serving.worker` wrote inside vLLM 0.26.0 (2026-12-01, `make serve-check` on the tiny world's
`make all` outputs; the run is in docs/serving.md). CI has no GPU and no vLLM, so the rules that turn
those files into pass/fail, the report section, the manifest/card sentence and publish's refusal are
checked here on them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.core.errors import SpecquantError
from pipeline.serving import report, verdict
from tests._support import worker_prompts, worker_results

FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "tiny-h200-worker-results.tar.xz"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results(FIXTURE, tmp_path_factory.mktemp("vllm"))


_prompts = worker_prompts


def test_every_pair_loads_is_lossless_and_bf16_matches_the_reference_loop(results):
    ref = {"bf16": {"all": 3.870}}  # the reference loop's tau for the same drafter and target (README)
    s = verdict.summarize(results, _prompts(results), 0.9, 1.05, "bf16", ref)
    assert s["failures"] == []
    n = sum(len(v) for v in _prompts(results).values())
    assert all(p["lossless"]["equal"] == n for p in s["pairs"].values())
    bf16 = s["pairs"]["bf16/bf16"]
    assert abs(bf16["tau"]["all"] / 3.870 - 1) < 0.01  # vLLM's tau within 1% of the reference loop's
    # vLLM ran NVFP4 weight-only (Marlin) on Hopper, W4A4 only when asked for emulation
    assert "Marlin" in s["pairs"]["bf16/nvfp4"]["drafter_kernel"]
    assert "Emulation" in s["pairs"]["bf16/nvfp4/emulation"]["drafter_kernel"]
    assert s["pairs"]["bf16/nvfp4"]["tau"] == s["pairs"]["bf16/nvfp4-nocalib"]["tau"]  # one model on Hopper


def test_a_tau_below_the_floor_fails_naming_the_variant(results):
    s = verdict.summarize(results, _prompts(results), 0.99, 1.05, None, {})
    assert any(f.startswith("drafter nvfp4-nocalib with target bf16 (linear_backend=emulation): tau 3.73")
               for f in s["failures"]), s["failures"]
    assert s["pairs"]["bf16/bf16"]["ok"]
    s = verdict.summarize(results, _prompts(results), 0.9, 5.0, None, {})
    assert len(s["failures"]) == len(s["pairs"])  # the zero-acceptance floor catches every pair


def test_a_pair_that_does_not_load_or_differs_from_the_target_fails(results):
    broken = json.loads(json.dumps(results))
    for r in broken:
        if r["job"]["variant"] == "w4a16" and r["job"]["target_variant"] == "bf16":
            r.update(ok=False, error="AttributeError: 'QKVParallelLinear' object has no attribute 'data'")
        if r["job"]["variant"] == "nvfp4a16" and r["job"]["target_variant"] == "bf16":
            first = next(iter(r["subsets"].values()))
            first["outputs"][0] = first["outputs"][0][:-1] + [first["outputs"][0][-1] + 1]
    s = verdict.summarize(broken, _prompts(broken), 0.9, 1.05, None, {})
    assert any("drafter w4a16 with target bf16: does not load" in f and "QKVParallelLinear" in f
               for f in s["failures"])
    assert any(f.startswith("drafter nvfp4a16 with target bf16: not lossless (59/60") for f in s["failures"])
    status = report.variant_status(s, "w4a16")
    assert status["checked"] and status["ok"] is False and "does not load" in status["summary"]


def test_report_section_and_card_sentence(results):
    s = verdict.summarize(results, _prompts(results), 0.9, 1.05, "bf16", {"nvfp4": {"all": 3.765}})
    text = report.render(s)
    assert "| bf16 | nvfp4 [emulation] | EmulationNvFp4LinearKernel (emulated W4A4) | yes | 60/60 |" in text
    assert "vLLM 0.26.0" in text and "NVIDIA H200" in text
    status = report.variant_status(s, "nvfp4")
    assert status["ok"] and "lossless 60/60, tau 3.806, MarlinNvFp4LinearKernel (weight-only FP4)" in status["summary"]
    assert report.variant_status(s, "not-a-variant")["checked"] is False


def test_publish_refuses_a_variant_whose_serve_check_failed(results, tmp_path):
    from pipeline.artifacts.rundir import RunDir
    from pipeline.core.config import compose
    from pipeline.core.io import atomic_write_json
    from pipeline.stages import publish

    cfg = compose([f"runs_root={tmp_path}", "run_name=r"])
    rd = RunDir.from_cfg(cfg)
    s = verdict.summarize(results, _prompts(results), 0.99, 1.05, None, {})
    atomic_write_json(rd.eval / "serve_check.json", s)
    with pytest.raises(SpecquantError, match=r"`publish.variants` = 'nvfp4-nocalib': its vLLM serve check failed"):
        publish._refuse_unserved(cfg, rd, "nvfp4-nocalib")
    publish._refuse_unserved(cfg, rd, "bf16")  # a passing variant goes through


def test_serve_check_json_is_versioned_and_read_through_its_one_reader(results, tmp_path):
    """eval/serve_check.json through `pipeline.artifacts.serve_results`: the writer adds format_version, the reader
    gives back the summary verdict built, reads a file written before the field existed the same way, reads a
    version-1 file (its load-and-probe verdicts under `dflash2`) as version 2 (`load_probes`), and refuses another
    version in one sentence naming the file; `report.status_for` reads it (None file: not checked)."""
    from pipeline.artifacts import serve_results

    s = verdict.summarize(results, _prompts(results), 0.99, 1.05, None, {})
    path = tmp_path / "eval" / "serve_check.json"
    assert report.status_for(tmp_path, "nvfp4")["checked"] is False and serve_results.read(path) is None
    serve_results.write(path, s)
    written = json.loads(path.read_text())
    assert written["format_version"] == serve_results.FORMAT_VERSION == 2
    assert serve_results.read(path) == json.loads(json.dumps(s))
    assert report.status_for(tmp_path, "nvfp4") == report.variant_status(serve_results.read(path), "nvfp4")
    assert report.status_for(tmp_path, "nvfp4")["checked"] is True
    path.write_text(json.dumps({k: v for k, v in written.items() if k != "format_version"}))  # before the field
    assert serve_results.read(path) == json.loads(json.dumps(s))
    entry = {"ok": True, "problems": [], "said": "loaded"}
    v2 = {**json.loads(json.dumps(s)), "load_probes": {"w4a16": entry}}
    v1 = {("dflash2" if k == "load_probes" else k): x for k, x in v2.items()}  # version 1's name of the field
    for old in ({**v1, "format_version": 1}, v1):  # version 1, and before the field existed
        path.write_text(json.dumps(old))
        assert serve_results.read(path) == v2
    path.write_text(json.dumps({**written, "format_version": 3}))
    with pytest.raises(SpecquantError) as exc:
        serve_results.read(path)
    assert str(exc.value).count(". ") == 0 and str(path) in str(exc.value) and "format_version is 3" in str(exc.value)
    assert "reads versions 1 and 2 only" in str(exc.value)
