"""The warm launcher (tests/warm.py) gives what a real exec gives: exit codes, stdout/stderr, cwd, environment,
signals; and it takes the real exec wherever a fork could differ (another cwd, an import-time variable)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import warm
from tests._support import REPO

pytestmark = pytest.mark.skipif(bool(os.environ.get("SPECQUANT_TEST_COLD")), reason="the warm launcher is off")

CASES = {
    "a stage's bad override": ["-m", "pipeline", "data", "seed=abc"],
    "the stage list": ["-m", "pipeline", "stages"],
    "sys.exit with a code": ["-c", "import sys; print('out', sys.argv[1:]); print('err', file=sys.stderr); "
                                   "sys.exit(3)", "a", "b"],
    "sys.exit with a message": ["-c", "import sys; sys.exit('a message')"],
    "an uncaught exception": ["-c", "def f():\n    raise ValueError('boom')\nf()"],
    "atexit and a thread still running": ["-c", "import atexit, threading, time\n"
                                                "atexit.register(print, 'at exit')\n"
                                                "threading.Thread(target=lambda: (time.sleep(0.2), print('thread')))"
                                                ".start()"],
    "cwd, env and TMPDIR": ["-c", "import os, tempfile; print(os.getcwd(), os.environ['TMPDIR'], "
                                  "tempfile.gettempdir(), os.environ.get('SPECQUANT_TEST_KILLPOINT'))"],
}

INTERLEAVED = ["-c", "import sys; print('out 1'); sys.stderr.write('err\\n'); print('out 2'); "
                     "print(sys.stdout.line_buffering, sys.stderr.line_buffering, sys.stdout.write_through)"]


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_stdout_and_stderr_buffer_as_in_a_real_process(unbuffered):
    """On one pipe, stdout's lines come after stderr's unless PYTHONUNBUFFERED is set, in both."""
    env = {**os.environ, "PYTHONUNBUFFERED": unbuffered}
    kw = {"cwd": REPO, "env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    forked = warm.popen([sys.executable, *INTERLEAVED], **kw)
    assert isinstance(forked, warm.WarmProcess)
    real = subprocess.Popen([sys.executable, *INTERLEAVED], **kw)
    outs = [p.communicate(timeout=120)[0] for p in (forked, real)]
    assert outs[0] == outs[1] and outs[0].startswith("out 1\n" if unbuffered else "err\n"), outs


@pytest.mark.parametrize("argv", list(CASES.values()), ids=list(CASES))
def test_a_forked_run_looks_like_a_real_process(argv, tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "SPECQUANT_TEST_KILLPOINT": "x"}
    before = dict(warm.launches)
    forked = warm.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert warm.launches["warm"] == before["warm"] + 1, "the warm path was not taken"
    real = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def test_sigkill_and_ctrl_c_end_it_as_they_end_a_real_process(tmp_path):
    # 'up' is printed inside the try: a SIGINT right after it must land in the handler, as in a real process
    code = "import sys, time\ntry:\n    print('up', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n" \
           "    print('interrupted', flush=True)\n    sys.exit(130)\n"
    for sig, rc, said in ((signal.SIGKILL, -signal.SIGKILL, ""), (signal.SIGINT, 130, "interrupted\n")):
        proc = warm.popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                          sigint_default=True)
        assert isinstance(proc, warm.WarmProcess) and proc.stdout.readline() == "up\n"
        assert proc.poll() is None
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == rc and proc.stdout.read() == said
        assert proc.poll() == rc
    proc = warm.popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=REPO)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_what_a_fork_could_not_reproduce_is_a_real_exec(tmp_path):
    code = ["-c", "import os; print(os.getpid())"]
    for kwargs in ({"cwd": tmp_path},  # sys.path[0] would be another folder
                   {"cwd": REPO, "env": {**os.environ, "HF_HOME": str(tmp_path)}},  # read by imports
                   {"cwd": REPO, "env": {**os.environ, "PYTHONHASHSEED": "1"}}):  # the server's is 0
        proc = warm.popen([sys.executable, *code], stdout=subprocess.PIPE, **kwargs)
        assert isinstance(proc, subprocess.Popen), kwargs
        proc.communicate(timeout=60)
    t0 = time.monotonic()
    proc = warm.popen([sys.executable, *code], cwd=REPO, stdout=subprocess.PIPE)
    assert isinstance(proc, warm.WarmProcess)
    out, _ = proc.communicate(timeout=60)
    assert int(out) == proc.pid != os.getpid() and time.monotonic() - t0 < 30
