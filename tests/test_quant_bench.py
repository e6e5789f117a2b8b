"""bench/quant_bench.py smoke test on the CPU: tiny shapes, one variant, real stages in their own processes
(forked from the warm launcher, tests/warm.py)."""

from __future__ import annotations

import json
import os

from bench import quant_bench
from tests import warm


def test_quant_bench_smoke_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(quant_bench, "run_process", warm.run)
    before = dict(warm.launches)
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--tiny", "--device", "cpu",
            "--samples", "6", "--heldout", "2", "--seq-len", "48", "--anchors", "4",
            "--variants", "drafter-nvfp4-expanded-mse", "--results", str(tmp_path / "results")]
    assert quant_bench.main(argv) == 0
    if not os.environ.get("SPECQUANT_TEST_COLD"):
        assert warm.launches["warm"] == before["warm"] + 2  # the cache and the variant, as the bench starts them
    results = json.loads((tmp_path / "out" / "quant_bench.json").read_text())
    rec = results["variants"]["drafter-nvfp4-expanded-mse"]
    assert rec["rc"] == 0 and rec["wall_s"] > 0 and rec["host_peak_rss_mib"] > 0
    # nvfp4 searches its activation scales (conf/quant/nvfp4.yaml: activation_scale=mse)
    phases = {"prepare_s", "load_s", "oneshot_s", "scale_search_s", "write_s", "check_s", "inputs_hash_wait_s"}
    assert set(rec["timings"]) == phases | {"total_s", "peak_host_anon_bytes"}  # no GPU here: no peak_gpu_* keys
    assert set(rec["timings"]["peak_host_anon_bytes"]) >= phases - {"inputs_hash_wait_s"}
    assert rec["num_calibration_samples"] == 4 and rec["num_calibration_anchors"] == 16
    assert rec["check"]["served"]["rows"] > 0
    table = (tmp_path / "out" / "quant_bench.md").read_text()
    assert "| drafter-nvfp4-expanded-mse | 0 |" in table
    # the issue-20 headline file: <date>-<gpu>-quant.json with the stage wall under quantize_drafter_nvfp4_<N>_s
    (headline,) = (tmp_path / "results").glob("*-cpu-quant.json")
    doc = json.loads(headline.read_text())
    assert doc["quantize_drafter_nvfp4_4_s"] == rec["stage_wall_time_s"] > 0
    assert set(doc["phases_s"]) == phases | {"total_s"} and doc["goal_s"] == 60.0
    assert doc["calibration"]["activation_scale_search"] == {"samples": 4, "candidates": 14}
    assert doc["command"].startswith("python -m pipeline quantize-drafter ") and "quant=nvfp4" in doc["command"]
