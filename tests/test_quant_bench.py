"""bench/quant_bench.py smoke test on the CPU: tiny shapes, one variant, real stages in subprocesses."""

from __future__ import annotations

import json

from bench import quant_bench


def test_quant_bench_smoke_on_cpu(tmp_path):
    argv = ["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--tiny", "--device", "cpu",
            "--samples", "6", "--heldout", "2", "--seq-len", "48", "--anchors", "4",
            "--variants", "drafter-nvfp4-minmax"]
    assert quant_bench.main(argv) == 0
    results = json.loads((tmp_path / "out" / "quant_bench.json").read_text())
    rec = results["variants"]["drafter-nvfp4-minmax"]
    assert rec["rc"] == 0 and rec["wall_s"] > 0 and rec["host_peak_rss_mib"] > 0
    # nvfp4 searches its activation scales (conf/quant/nvfp4.yaml: activation_scale=mse)
    assert set(rec["timings"]) == {"load_s", "oneshot_s", "scale_search_s", "write_s", "check_s"}
    assert rec["num_calibration_samples"] == 4 and rec["num_calibration_anchors"] == 16
    assert rec["check"]["served"]["rows"] > 0
    table = (tmp_path / "out" / "quant_bench.md").read_text()
    assert "| drafter-nvfp4-minmax | 0 |" in table
