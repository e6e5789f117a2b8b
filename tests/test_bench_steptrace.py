"""bench/steptrace.py on a real trace: seven decode steps of the bf16 target + bf16 DFlash drafter (Qwen3-8B /
DFlash-b16 shapes, random weights, k = 15, batch 1) profiled on an H200 with vLLM 0.26.0 by
`python -m bench.speed run --profile` (pipeline.serving.worker.profile_steps), cut to the events of those steps
(tests/fixtures/traces/h200-bf16-pair-b1-steps.json.gz). And the worker's scopes on a real module."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from bench import steptrace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "fixtures" / "traces" / "h200-bf16-pair-b1-steps.json.gz"
VOCAB = {151936}


@pytest.fixture(scope="module")
def events() -> list[dict]:
    return steptrace.load(TRACE)


def _gpu(events):
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in steptrace.GPU_CATS]


def test_parts_account_for_every_kernel_of_the_kept_steps(events):
    d = steptrace.decompose(events, VOCAB, skip=1)
    assert set(d["parts_ms"]) == set(steptrace.PARTS)
    assert d["steps_kept"] == d["steps"] - 2  # the first (skip) and the last are left out
    assert d["gpu_busy_ms"] == pytest.approx(sum(d["parts_ms"].values()), abs=1e-3)
    # the busy time (kernel durations) never exceeds the span on one stream; idle is what is left of it
    assert d["gpu_busy_ms"] <= d["gpu_span_ms"] + 1e-6
    assert d["gpu_idle_ms"] == pytest.approx(d["gpu_span_ms"] - d["gpu_busy_ms"], abs=0.05)
    # a pair's step runs the target's layers, its head, sampling and the drafter's graph and head
    for part in ("target layers", "target head", "sampling", "drafter layers", "drafter head"):
        assert d["parts_ms"][part] > 0, part
    shares = d["parts_share_of_busy"]
    assert sum(v for v in shares.values() if v) == pytest.approx(1.0, abs=1e-3)


def test_drafter_graph_split_after_its_last_rmsnorm(events):
    """Each drafter CUDA-graph replay splits in two contiguous runs: layers up to the last RMSNorm kernel,
    head after it; the head's kernels are those `_graph_head` names and nothing else of the graph."""
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in steptrace.LAUNCH_CATS
                and "correlation" in (e.get("args") or {})}
    per_graph = defaultdict(list)
    for g in _gpu(events):
        launch = launches.get(g["args"].get("correlation"))
        if launch is not None and "Graph" in launch.get("name", ""):
            per_graph[g["args"]["correlation"]].append(g)
    drafter = [ks for ks in per_graph.values() if len(ks) < max(len(v) for v in per_graph.values())]
    assert drafter, "the fixture holds the drafter's graph replays"
    for ks in drafter:
        ks.sort(key=lambda k: k["ts"])
        head = steptrace._graph_head(ks)
        last_norm = max(i for i, k in enumerate(ks) if "rms_norm" in k["name"].lower())
        assert head == set(range(last_norm + 1, len(ks)))
        assert not any("rms_norm" in ks[i]["name"].lower() for i in head)
    assert steptrace._graph_head([{"name": "gemm"}, {"name": "argmax"}]) == set()


def test_decomposition_is_a_function_of_the_trace(events):
    a = steptrace.decompose(events, VOCAB, skip=1)
    b = steptrace.decompose(list(reversed(events)), VOCAB, skip=1)  # event order in the file does not matter
    assert a == b


def test_refusals_are_one_sentence(events, tmp_path):
    no_scopes = [e for e in events if not str(e.get("name", "")).startswith(steptrace.OURS)]
    with pytest.raises(steptrace.TraceError, match="no step scopes"):
        steptrace.decompose(no_scopes, VOCAB)
    no_gpu = [e for e in events if e.get("cat") not in steptrace.GPU_CATS]
    with pytest.raises(steptrace.TraceError, match="no GPU activity"):
        steptrace.decompose(no_gpu, VOCAB)
    with pytest.raises(steptrace.TraceError, match="none left"):
        steptrace.decompose(events, VOCAB, skip=100)
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"not gzip")
    numbers = tmp_path / "numbers.json"
    numbers.write_text("[1, 2]")
    for args in ([str(bad)], [str(numbers)], [str(tmp_path / "missing.json.gz")], [str(TRACE), "--vocab", "x"],
                 [str(TRACE), "--skip", "-3"]):
        r = subprocess.run([sys.executable, "-m", "bench.steptrace", *args], cwd=ROOT, capture_output=True,
                           text=True)
        assert r.returncode == 2
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_writes_json(tmp_path):
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", "bench.steptrace", str(TRACE), "--skip", "1", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())[TRACE.name]
    assert d == steptrace.decompose(steptrace.load(TRACE), {151936, 32768}, skip=1)
    with gzip.open(TRACE, "rt") as f:  # the fixture is a Chrome trace as torch writes it
        assert "traceEvents" in json.load(f)


def test_worker_scopes_wrap_and_restore_a_module():
    """pipeline.serving.worker's profiler scopes on a real nn.Module: named scopes while on, the class's methods
    (and an instance attribute that was there before) back afterwards, wrapping twice is a no-op."""
    from torch.profiler import profile

    from pipeline.serving import worker_speed as worker

    class Net(torch.nn.Module):
        def forward(self, x):
            return x + 1

        def compute_logits(self, h):
            return h * 2

    def step():
        return 5

    runner = types.SimpleNamespace(model=Net(), execute_model=step, speculator=None)
    w = types.SimpleNamespace(model_runner=runner)
    assert worker._scopes_on(w) == ["runner.execute_model", "model.forward", "model.compute_logits"]
    assert worker._scopes_on(w) == []
    with profile() as prof:
        runner.model(torch.ones(2))
        runner.model.compute_logits(torch.ones(2))
        runner.execute_model()
    names = {e.name for e in prof.events() if e.name.startswith(worker.SCOPE_PREFIX)}
    assert names == {"specquant: target layers", "specquant: target head", "specquant: step"}
    worker._scopes_off(w)
    assert "forward" not in vars(runner.model) and "compute_logits" not in vars(runner.model)
    assert runner.execute_model is step
    assert torch.equal(runner.model(torch.ones(1)), torch.tensor([2.0]))
