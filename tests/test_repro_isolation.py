"""repro-check judges only what the stages write (issue 47): a reduced check (`python -m tests.repro --stages
data`: the data stage twice, compared) passes while another program writes into the machine's temp dir all
along, and still fails, naming the files, when a stage itself leaves a file in its temp dir."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests._support import REPO

REDUCED = ["--stages", "data", "--quants", "", "--pair-target", "", "--pair-quants", "", "data.num_samples=12",
           "run_name=repro-isolation"]


def reduced_check(work: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.repro", "--workdir", str(work / "check"),
                           "--reference", str(work / "no-reference"), *REDUCED], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_a_program_writing_to_the_temp_dir_meanwhile_cannot_fail_the_check(tmp_path):
    """A bystander process writes a new file into the machine's temp dir (and touches it) every 0.2 s from before
    the check starts until after it ends; the check passes and counts no file of it."""
    machine_tmp = Path(tempfile.gettempdir())
    spot = Path(tempfile.mkdtemp(prefix="specquant-bystander-", dir=machine_tmp))
    stop = tmp_path / "stop"
    bystander = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, pathlib, time
        spot, stop, n = pathlib.Path({str(spot)!r}), pathlib.Path({str(stop)!r}), 0
        while not stop.exists():
            (spot / f"note-{{n}}.txt").write_text("another program's file")
            n += 1
            time.sleep(0.2)
    """)])
    try:
        time.sleep(0.5)
        res = reduced_check(tmp_path)
    finally:
        stop.write_text("")
        bystander.wait(timeout=30)
    written = sorted(spot.iterdir())
    try:
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-4000:]
        assert len(written) >= 10, "the bystander wrote nothing during the check"
        newest = max(p.stat().st_mtime for p in written)
        assert newest > (tmp_path / "check" / "b").stat().st_mtime, "the bystander stopped before the check ended"
        assert "files left in the stages' private HOME and TMPDIR" in out and "): 0 (not counted" in out, out[-3000:]
        assert str(spot) not in out
        assert "[repro] OK:" in out
    finally:
        for p in written:
            p.unlink()
        spot.rmdir()


@pytest.mark.slow
def test_a_file_a_stage_leaves_in_its_temp_dir_is_still_named(tmp_path):
    """Each stage process (and only a process with the check's private TMPDIR) leaves one file in its temp dir,
    through a sitecustomize module on PYTHONPATH: the check fails in one sentence naming those files."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, tempfile
        if os.path.join("env", "tmp") in os.environ.get("TMPDIR", ""):  # a stage of the check, not the check
            with open(os.path.join(tempfile.gettempdir(), f"left-by-{os.getpid()}.txt"), "w") as f:
                f.write("a stage's leftover")
    """))
    res = reduced_check(tmp_path, {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])})
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]
    left = sorted((tmp_path / "check" / "env" / "tmp").glob("left-by-*.txt"))
    assert len(left) == 2, left  # the data stage of run a and of run b
    sentence = next(ln for ln in out.splitlines() if "were left in the stages' private HOME or TMPDIR" in ln)
    assert "FAILED: 2 file(s)" in sentence and all(str(p.resolve()) in sentence for p in left), sentence
    assert "[repro] OK:" in out  # the outputs themselves still compare equal
