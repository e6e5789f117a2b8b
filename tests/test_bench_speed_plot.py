"""`python -m bench.speed plot`: the H200 speed matrix (bench/results, recorded by `bench.speed report`) as one
figure; which run a cell comes from, and byte-stable PNGs."""

from __future__ import annotations

import json
from pathlib import Path

from bench import speed

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
RUNS = [RESULTS / f"2026-12-03-h200-speed{s}.json" for s in ("", "-matrix", "-run4")]


def _row(path: Path, config: str, batch: int) -> dict:
    return next(r for r in json.loads(path.read_text())["pairs"] if r["config"] == config and r["batch"] == batch)


def test_cells_come_from_the_latest_run_that_measured_them():
    cells = speed.plot_cells(RUNS)
    assert {t for t, _, _ in cells} <= set(speed.PLOT_TARGETS) and {d for _, d, _ in cells} <= set(speed.PLOT_DRAFTERS)
    # the W4A16 target through Marlin exists only in the fourth run, with its own alone and pair rows
    assert cells[("w4a16-marlin", None, 1)]["ms_per_step"] == _row(RUNS[2], "w4a16-marlin/-", 1)["ms_per_step"]
    assert cells[("w4a16-marlin", "w4a16", 1)]["source"] == RUNS[2].name  # w4a16/w4a16-marlin/k15: both on Marlin
    # a cell measured twice takes the later file: order decides
    late = speed.plot_cells([RUNS[2], RUNS[1]])[("w4a16", "bf16", 16)]
    early = speed.plot_cells([RUNS[1], RUNS[2]])[("w4a16", "bf16", 16)]
    assert late["source"] == RUNS[1].name and early["source"] == RUNS[2].name
    assert late["ms_per_step"] == _row(RUNS[1], "w4a16/bf16/k15", 16)["ms_per_step"]
    # rows outside the k = 15 matrix are left out (k = 7 / 3, one-layer and 32k-vocabulary drafters)
    assert all(c["num_speculative_tokens"] in (0, 15) for c in cells.values())


def test_the_png_is_written_and_byte_stable(tmp_path):
    a = speed.plot(RUNS, tmp_path / "a.png", "t")
    b = speed.plot(RUNS, tmp_path / "b.png", "t")
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and a.read_bytes() == b.read_bytes()


def test_report_measures_a_drafter_against_its_target_as_served(tmp_path):
    """`bench.speed report` on the seventh run's raw speed.json (as `run` wrote it on the H100): a Marlin W4A16
    drafter beside the FP8 target is measured against the FP8 target alone (disabling Machete moves no FP8 GEMM),
    and the report is the committed bench/results file."""
    import gzip

    raw = tmp_path / "speed.json"
    raw.write_bytes(gzip.decompress((RESULTS / "2026-12-07-h100-speed-fp8.raw.json.gz").read_bytes()))
    out = tmp_path / "report.json"
    speed.report([raw], out, issue=45)
    assert out.read_bytes() == (RESULTS / "2026-12-07-h100-speed-fp8.json").read_bytes()
    rows = {(r["config"], r["batch"]): r for r in json.loads(out.read_text())["pairs"]}
    for b in (1, 16):
        row, alone = rows[("fp8/w4a16-marlin/k15", b)], rows[("fp8/-", b)]
        assert row["env"] and not alone["env"] and row["target_kernels"] == alone["target_kernels"]
        assert row["overhead_ms"] == round(row["ms_per_step"] - alone["ms_per_step"], 3)
        bf16 = rows[("fp8/bf16/k15", b)]
        assert row["overhead_vs_bf16_drafter"] == round(row["overhead_ms"] / bf16["overhead_ms"], 3)
    assert speed.served_target({"target": "w4a16", "env": speed.MARLIN}) == "w4a16-marlin"
    assert speed.served_target({"target": "fp8", "env": speed.MARLIN}) == "fp8"
