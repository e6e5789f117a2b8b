"""`python -m pipeline <stage> -m key=a,b`: one job per value in one process (what `make all` runs for the drafter
variants), each job's outputs and stage record as if it had been run alone."""

from __future__ import annotations

import json

from tests._support import ENV, copy_world, outputs, run_cli, w4a16_group, world_cfg


def test_a_sweep_in_one_process_writes_what_separate_processes_write(fixture_world, tmp_path):
    one, alone = copy_world(fixture_world, tmp_path / "one"), copy_world(fixture_world, tmp_path / "alone")
    extra = (f"quant.group_size={w4a16_group()}",)
    swept = run_cli("quantize-drafter", "-m", "quant=w4a16-imatrix,w4a16", *world_cfg(one, *extra, overrides_only=True),
                    env=ENV)
    assert swept.returncode == 0, swept.stderr[-2000:]
    single = run_cli("quantize-drafter", "quant=w4a16", *world_cfg(alone, *extra, overrides_only=True), env=ENV)
    assert single.returncode == 0, single.stderr[-2000:]
    # w4a16 ran second in the sweep, after w4a16-imatrix in the same interpreter: not one byte differs from a run alone
    got, want = outputs(one / "qw"), outputs(alone / "qw")
    assert {k: v for k, v in got.items() if "imatrix" not in k} == want and "drafter/w4a16/model.safetensors" in want
    assert any(k.startswith("drafter/w4a16-imatrix/") for k in got)
    for variant in ("w4a16-imatrix", "w4a16"):  # each record: the job's own overrides, and the sweep that ran it
        rec = json.loads((one / "qw" / "stages" / f"quantize-drafter-{variant}.json").read_text())
        assert f" quant={variant}" in rec["command"] and "," not in rec["command"].split("quant=")[1].split()[0]
        assert "-m" in rec["argv"] and "quant=w4a16-imatrix,w4a16" in rec["argv"]


def test_every_job_is_checked_before_the_first_starts_and_a_plain_comma_says_to_add_m(fixture_world, tmp_path):
    root = copy_world(fixture_world, tmp_path / "w")
    ov = world_cfg(root, overrides_only=True)
    bad = run_cli("quantize-drafter", "-m", "quant=w4a16,w4a61", *ov, env=ENV)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "quant/w4a61" in bad.stderr
    assert not (root / "qw" / "drafter" / "w4a16").exists()  # the good first job never ran
    plain = run_cli("quantize-drafter", "quant=w4a16,nvfp4", *ov, env=ENV)
    assert plain.returncode == 2 and "add -m" in plain.stderr and "Traceback" not in plain.stderr


def test_provenance_replays_a_sweep_once():
    from pipeline.provenance.record import commands_sh

    argv = ["python", "-m", "pipeline", "quantize-drafter", "-m", "quant=a,b"]
    text = commands_sh([{"stage": "quantize-drafter", "record": f"stages/quantize-drafter-{v}.json", "argv": argv,
                         "command": f"python -m pipeline quantize-drafter quant={v}", "launcher": {}}
                        for v in ("a", "b")])
    assert text.count("quant=a,b") == 1 and "one job of its -m sweep" in text
