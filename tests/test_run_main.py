"""tests/_support.run_main, the in-process `python -m pipeline` the converted CLI tests use: the same exit codes
and output as a real process, and nothing it changes leaks into the test that called it or the next call."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import torch

from tests._support import run_cli, run_main


def test_exit_codes_and_output_are_those_of_a_real_process(tmp_path):
    for argv in (["stages"], [], ["no-such-stage"], ["data", "data.num_samples=lots"], ["data", "data.(="]):
        real = run_cli(*argv, timeout=120)
        rc, out, err = run_main(*argv)
        assert (rc, out, err) == (real.returncode, real.stdout, real.stderr), argv


def test_nothing_it_changes_leaks_into_the_caller(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_TEST_KEPT", "1")
    monkeypatch.delenv("SPECQUANT_TEST_GONE", raising=False)
    env, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
    threads, filters, tempdir = torch.get_num_threads(), list(warnings.filters), tempfile.tempdir
    handlers, level = list(logging.getLogger().handlers), logging.getLogger().level
    rng = torch.get_rng_state()
    rc, out, _ = run_main("run-dir", f"runs_root={tmp_path}", env={"SPECQUANT_TEST_KEPT": None,
                                                                  "SPECQUANT_TEST_GONE": "x", "OMP_NUM_THREADS": "1",
                                                                  "TMPDIR": str(tmp_path)}, cwd=tmp_path)
    assert rc == 0 and out.strip().startswith(str(tmp_path))
    assert dict(os.environ) == env and os.getcwd() == cwd and sys.argv == argv
    assert torch.get_num_threads() == threads and list(warnings.filters) == filters and tempfile.tempdir == tempdir
    assert list(logging.getLogger().handlers) == handlers and logging.getLogger().level == level
    assert torch.equal(torch.get_rng_state(), rng)
    from hydra.core.global_hydra import GlobalHydra

    assert not GlobalHydra.instance().is_initialized()

