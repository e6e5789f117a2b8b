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
