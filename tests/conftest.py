"""Shared fixtures (helpers live in tests/_support.py): a small chat tokenizer and the runs built once per
session. `SPECQUANT_FIXTURES=/path` points every test at another golden fixture folder (tests/_support.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one thread per process: `make test` runs one pytest worker per core, and the tiny tensors here gain nothing
# from a second thread, whose spin-waits only take CPU from the other worker (subprocesses inherit it)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import _support  # noqa: E402  (after the offline switches above)

_support.torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def warm_launcher():
    """This worker's warm launcher (tests/warm.py), started before any test changes the environment: its
    imports run beside the first tests, and fault tests fork their stage processes from it."""
    from tests import warm

    warm.start()


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory) -> Path:
    return _support.build_chat_tokenizer(tmp_path_factory.mktemp("tok"))


# ---------------------------------------------------------------- built once per session, shared by modules
# Each is read-only for its users: a test that changes files works on a copy (copy_world, run_root).
def _built_once(tmp_path_factory, name: str, build):
    """`build(root) -> value` (JSON-able) run once per test session: under pytest-xdist the first worker to ask
    builds it in the session's shared base temp folder, holding an exclusive lock, and every other worker waits
    for it and reads the value back (a build that failed is redone by the next worker that asks). The value
    always goes through JSON, so it is the same object whichever worker built it."""
    import fcntl
    import json
    import shutil

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return json.loads(json.dumps(build(tmp_path_factory.mktemp(name))))
    shared = tmp_path_factory.getbasetemp().parent  # pytest-<n>/, above each worker's popen-gw<i>/
    root, done = shared / f"shared-{name}", shared / f"shared-{name}.json"
    with open(shared / f"shared-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(build(root)))
            os.replace(tmp, done)
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def fixture_world(tmp_path_factory) -> Path:
    """runs root with `qw/`: the fixture world's blend (30 samples) and the real cache stage's output."""
    def build(root):
        _support.build_world(root)
        return str(root)
    return Path(_built_once(tmp_path_factory, "fixture_world", build))


@pytest.fixture(scope="session")
def quantized_world(fixture_world, tmp_path_factory) -> tuple[Path, dict]:
    """A copy of `fixture_world` with quantize-drafter's nvfp4, nvfp4a16 and w4a16 variants written once
    (tests/_support.SHARED_VARIANTS) through `run_stage`, as the entry point runs them (each with its stage
    record); returns (runs root, {variant: the stage's result})."""
    from pipeline.stages.runner import run_stage

    def build(root):
        _support.copy_world(fixture_world, root)
        results = {}
        for v, ov in _support.SHARED_VARIANTS.items():
            full = _support.world_cfg(root, *ov, overrides_only=True)
            results[v] = run_stage("quantize-drafter", "pipeline.stages.quantize_drafter", _support.compose(full), full)
        return [str(root), results]
    root, results = _built_once(tmp_path_factory, "quantized_world", build)
    return Path(root), results


@pytest.fixture(scope="session")
def massive_world(tmp_path_factory) -> tuple[Path, Path, dict]:
    """runs root with `target/` (the fixture target with massive activations, _support.massive_activation_target)
    and `qw/`: its blend, the real cache stage's output and quantize-drafter quant=nvfp4 quant.observer=minmax
    (test_quant_drafter and test_quant_scale_search both start from it); returns (runs root, target, result)."""
    from pipeline.stages import quantize_drafter

    def build(root):
        target = _support.massive_activation_target(root / "target")
        _support.build_world(root, target=target)
        return [str(root), str(target), quantize_drafter.run(_support.world_cfg(
            root, "quant=nvfp4", "quant.observer=minmax", target=target))]
    root, target, result = _built_once(tmp_path_factory, "massive_world", build)
    return Path(root), Path(target), result


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> dict:
    """One real run of the fixture world: data -> cache -> quantize-drafter nvfp4 (subprocess) -> manifest."""
    def build(root):
        run = _support.tiny_run(root)
        return {**run, "template": str(run["template"]), "reference": str(run["reference"])}
    run = _built_once(tmp_path_factory, "tiny_run", build)
    return {**run, "template": Path(run["template"]), "reference": Path(run["reference"])}


@pytest.fixture(scope="session")
def pristine_runs(tmp_path_factory) -> Path:
    """The publish tests' small run (tests/_support.make_run: real stages on the fixture world): built once."""
    def build(root):
        _support.make_run(root / "runs")
        return str(root / "runs")
    return Path(_built_once(tmp_path_factory, "pristine", build))


@pytest.fixture
def run_root(pristine_runs, tmp_path, monkeypatch):
    """A fresh copy of `pristine_runs` per test, with the publish tests' token in the environment."""
    import shutil

    monkeypatch.setenv("HF_TOKEN", _support.PUBLISH_TOKEN)
    root = tmp_path / "runs"
    shutil.copytree(pristine_runs, root, symlinks=True)
    return root


# ---------------------------------------------------------------- reliability report
# Tests marked `@pytest.mark.faults("<kind>")` are the fault-injection suite. With
# SPECQUANT_RELIABILITY_OUT set (by `python -m tests.reliability`), each one's outcome is
# appended to that JSONL file and rendered into docs/reliability.md.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    import json

    outcome = yield
    rep = outcome.get_result()
    out = os.environ.get("SPECQUANT_RELIABILITY_OUT")
    marker = item.get_closest_marker("faults")
    if not out or marker is None or (rep.when != "call" and rep.passed):
        return
    doc = (item.function.__doc__ or item.name).strip().splitlines()[0]
    # a parametrized case object may carry its own sentence (e.g. the bad-input table's `what`)
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(getattr(value, "what", None), str) and value.what:
            doc = value.what
            break
    params = getattr(getattr(item, "callspec", None), "id", None)
    with open(out, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"nodeid": item.nodeid, "kind": marker.args[0] if marker.args else "fault",
                             "case": params, "what": doc, "outcome": rep.outcome,
                             "seconds": round(rep.duration, 2)}) + "\n")


# ---------------------------------------------------------------- order of the modules across workers
# pytest-xdist's `--dist loadfile` hands whole modules to whichever worker runs out of work, in the order it
# is given; by default it first sorts them by their number of tests, which puts the modules made of a few long
# tests (vLLM engines, a torchrun pair, real processes) last, where one of them keeps one worker busy while the
# other has nothing left. Longest first instead: the modules below, by their summed test time on the 2-core
# machine (`pytest --durations=0`, 2026-12-07; test_serve_cpu's vLLM engines the longest), then the rest in
# collection order.
LONGEST_FIRST = ("test_serve_cpu.py", "test_serve_dflash2.py", "test_pairing.py",
                 "test_repro_isolation.py", "test_hybrid_eval.py", "test_presets.py", "test_drafter_rope.py",
                 "test_sliding_window.py", "test_quiet_and_tidy.py", "test_faults_stages.py", "test_quant_drafter.py",
                 "test_multirun.py", "test_evaluate.py", "test_family_validation.py", "test_quant_speed.py",
                 "test_secrets.py", "test_bench_draft_vocab.py", "test_quant_target.py", "test_verify.py",
                 "test_vllm_profiles.py", "test_quant_scale_search.py", "test_publish_faults.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is there
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order is kept
