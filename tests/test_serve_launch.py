"""serve-check's worker processes (`pipeline.serving.launch`): how the jobs are shared out over processes, and what
happens when a process running several engines dies.

`groups` keeps the jobs' order, puts at most `engines_per_process` jobs in a process (all of a slot's share
when None), never puts an engine and a load-and-probe job in one process and never mixes jobs with different CPU
emulation switches (a kernel registered in a process stays registered). `run_batch` with a process that dies after its first result
(a stand-in interpreter that writes one result and kills itself, as a crash in vLLM would end it): the jobs it
left are each run again in their own process, and every job has its result, in order. That the real worker
serves the same tokens batched or alone is asserted with vLLM's CPU build in tests/test_serve_cpu.py.
"""

from __future__ import annotations

import json
import stat
import sys

from pipeline.serving import launch
from pipeline.serving.records import LOAD_PROBE
from tests import _support


def _job(name: str, **extra) -> dict:
    return {"name": name, "cpu_nvfp4_emulation": True, "cpu_int4_emulation": True, **extra}


def test_groups_share_the_jobs_out_in_order_and_keep_apart_what_cannot_share_a_process():
    jobs = [_job(f"e{i}") for i in range(7)]
    names = lambda gs: [[j["name"] for j in g] for g in gs]  # noqa: E731
    assert names(launch.groups(jobs, 1, None)) == [[j["name"] for j in jobs]]
    assert names(launch.groups(jobs, 1, 1)) == [[j["name"]] for j in jobs]
    assert names(launch.groups(jobs, 2, None)) == [["e0", "e1", "e2", "e3"], ["e4", "e5", "e6"]]
    assert names(launch.groups(jobs, 4, 3)) == [["e0", "e1", "e2"], ["e3", "e4", "e5"], ["e6"]]
    mixed = [_job("p0", kind=LOAD_PROBE), _job("p1", kind=LOAD_PROBE), _job("a"), _job("b"),
             _job("c", cpu_nvfp4_emulation=False), _job("d", cpu_nvfp4_emulation=False), _job("e")]
    assert names(launch.groups(mixed, 1, None)) == [["p0", "p1"], ["a", "b"], ["c", "d"], ["e"]]
    for parallel in (1, 2, 3):
        for per in (None, 1, 2, 5):
            got = launch.groups(mixed, parallel, per)
            assert [j for g in got for j in g] == mixed  # every job once, in order
            assert all(len(g) <= (per or len(mixed)) for g in got)


STAND_IN = """#!{python}
# a stand-in for vLLM's interpreter: `--batch` writes the first job's result, then the process is killed
import json, os, signal, sys
args = sys.argv[3:]
if args[0] == "--batch":
    first = json.load(open(args[1]))[0]
    job = json.load(open(first["job"]))
    json.dump({{"ok": True, "name": job["name"], "job": job, "process": "batch"}}, open(first["result"], "w"))
    os.kill(os.getpid(), signal.SIGKILL)
job = json.load(open(args[0]))
json.dump({{"ok": True, "name": job["name"], "job": job, "process": "alone"}}, open(args[1], "w"))
"""


def test_a_batch_process_that_dies_leaves_its_other_jobs_to_a_process_each(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    jobs = [_job(n) for n in ("bf16--target-only", "bf16--bf16", "bf16--w4a16")]
    folder = tmp_path / "serve_check"
    results = launch.run_jobs(str(python), jobs, folder, 1, {"PATH": "/usr/bin:/bin"}, None)
    assert [r.name for r in results] == [j["name"] for j in jobs]
    assert [r.get("process") for r in results] == ["batch", "alone", "alone"]
    assert all(r.ok for r in results)
    assert (folder / "worker.log").is_file()
    left = sorted(p.name for p in folder.iterdir())
    assert not [n for n in left if n.endswith(".job.json") or n.endswith(".batch.json")], left
    assert json.loads((folder / "bf16--w4a16.json").read_text())["process"] == "alone"



def test_engines_per_process_below_one_is_refused_in_one_sentence(tmp_path):
    rc, out, err = _support.run_main("serve-check", f"runs_root={tmp_path}", "serve.engines_per_process=0")
    assert rc == 2 and "Traceback" not in err, err
    assert "serve.engines_per_process" in err and "= 0" in err and "null" in err, err
    assert not any(tmp_path.iterdir())  # refused before anything is written
