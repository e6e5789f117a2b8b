"""pipeline.core.pool: jobs in spawned processes beside this one (evaluate's eval.workers), in order, their errors
and a Ctrl-C reaching the caller, no worker outliving it."""

from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core import pool

REPO = Path(__file__).resolve().parents[1]


def test_split_cuts_in_order_into_near_equal_runs():
    for n in range(0, 12):
        for parts in range(1, 6):
            runs = pool.split(list(range(n)), parts)
            assert [x for r in runs for x in r] == list(range(n)) and all(runs)
            assert len(runs) == min(parts, n) and (not runs or max(map(len, runs)) - min(map(len, runs)) <= 1)


def test_results_come_back_in_job_order_and_a_workers_error_is_raised_here():
    assert pool.alongside(lambda: "here", operator.neg, [(1,), (2,), (3,)], 3) == ("here", [-1, -2, -3])
    assert pool.alongside(lambda: "here", operator.neg, [(1,)], 1) == ("here", [-1])  # one worker: all here
    with pytest.raises(ValueError, match="invalid literal"):
        pool.alongside(lambda: None, int, [("x",)], 2)


SCRIPT = """
import sys, time
from pipeline.core import pool
try:
    pool.alongside(lambda: (print("up", flush=True), time.sleep(120)), time.sleep, [(120,), (120,)], 3)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def _children(pid: int) -> set[int]:
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            pass
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_stops_every_worker_and_reaches_the_caller():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "up"
    deadline = time.time() + 60
    while len(_children(proc.pid)) < 2 and time.time() < deadline:  # the two workers (and the resource tracker)
        time.sleep(0.1)
    kids = _children(proc.pid)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group, workers included
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in out and "Traceback" not in err, err[-2000:]
    gone = time.time() + 30
    while any(Path(f"/proc/{k}").exists() for k in kids) and time.time() < gone:
        time.sleep(0.2)
    assert len(kids) >= 2 and not any(Path(f"/proc/{k}").exists() for k in kids)
