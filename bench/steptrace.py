"""Where a decode step's GPU time goes, read off a torch-profiler trace of a vLLM engine (issue 34).

    python -m bench.steptrace TRACE.json.gz [...] [--vocab 151936,32768] [--skip 2] [--json OUT.json]

The traces come from `python -m bench.speed run --profile` (pipeline.serving.worker_speed.profile_steps): one greedy
run under torch's profiler with vLLM's step scopes on (`gpu_model_runner: preprocess / forward / postprocess /
sample / draft / bookkeep`, vLLM 0.26 `v1/worker/gpu_model_runner.py:4149-4774`). Every GPU activity (kernel,
memcpy, memset) is tied to the CPU call that launched it by its correlation id, and that call to the innermost
scope around it on its thread, so a kernel replayed from a CUDA graph counts where its `cudaGraphLaunch` was made.
Parts of a step:

- `target layers`: the target's forward (its CUDA graph: the decoder over the step's rows, 1 per sequence alone,
  k + 1 per sequence with a drafter, i.e. the verify pass);
- `target head`: the target's `compute_logits` (its LM head over the rows sampled);
- `sampling`: the rest of `sample` (greedy / rejection sampling of the draft);
- `drafter layers`: the drafter's forward or CUDA graph, up to its last RMSNorm kernel (its decoder layers);
- `drafter head`: the drafter graph's kernels after that (the rows sampled, the LM head GEMM, the argmax), or
  the drafter's eager `compute_logits` / an eager operator with a vocabulary-sized input (`--vocab`);
- `drafter other`: the rest of the proposal (`fc` and the context K/V of the accepted tokens, input preparation);
- `runner other`: input preparation and the rest of the runner's step;
- `unscoped`: activity launched outside any scope.

The scopes are those `pipeline.serving.worker_speed.PROFILE_SCOPES` sets on vLLM 0.26's V2 runner (`specquant: ...`)
or vLLM's own V1 runner scopes (`gpu_model_runner: ...`). Steps are cut at each `specquant: step` (or
`gpu_model_runner: preprocess`) scope; the first `--skip` (the prefill) and the last are left out. Per step:
the GPU busy time of each part (kernel durations; a part's share is of the busy time), the GPU span (first
activity start of the step to the next step's), and the span not covered by any activity (`gpu idle`: launch
gaps and CPU-side scheduling, inflated by the profiler's own overhead - the unprofiled ms/step of the same
engine is in speed.json). Means over the kept steps.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

SCOPE = "gpu_model_runner: "
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
PARTS = ("target layers", "target head", "sampling", "drafter layers", "drafter head", "drafter other",
         "runner other", "unscoped")


class TraceError(ValueError):
    pass


def load(path: Path) -> list[dict]:
    """The trace's events (a Chrome trace as torch writes it, gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, EOFError) as exc:
        raise TraceError(f"trace {path}: not a readable Chrome trace ({type(exc).__name__}: {exc}); "
                         "pass a file written by `bench.speed run --profile`") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceError(f"trace {path}: no `traceEvents` list of events; pass a file written by "
                         "`bench.speed run --profile`")
    return events


def _dims(ev: dict) -> set[int]:
    out: set[int] = set()
    for d in (ev.get("args") or {}).get("Input Dims") or []:
        if isinstance(d, list):
            out.update(x for x in d if isinstance(x, int))
    return out


def _enclosing(intervals: list[tuple[float, float, dict]], points: list[float]) -> list[list[dict]]:
    """For each time point, the intervals of one thread containing it, outermost first (a sweep with a stack:
    a thread's scopes and operators nest)."""
    order = sorted(range(len(points)), key=points.__getitem__)
    items = sorted(intervals, key=lambda t: (t[0], -t[1]))
    out: list[list[dict]] = [[] for _ in points]
    stack: list[tuple[float, float, dict]] = []
    j = 0
    for k in order:
        ts = points[k]
        while j < len(items) and items[j][0] <= ts:
            while stack and stack[-1][1] <= items[j][0]:
                stack.pop()
            stack.append(items[j])
            j += 1
        while stack and stack[-1][1] <= ts:
            stack.pop()
        out[k] = [ev for s, e, ev in stack if s <= ts < e]
    return out


# scope -> part, for the runner scopes bench.speed's profile sets (`specquant: <part>`, pipeline.serving.worker.
# PROFILE_SCOPES: vLLM 0.26's V2 runner) and vLLM's own V1 runner scopes (`gpu_model_runner: <phase>`)
OURS = "specquant: "
PART_OF = {OURS + "target layers": "target layers", OURS + "target head": "target head", OURS + "sample": "sampling",
           OURS + "drafter layers": "drafter layers", OURS + "drafter graph": "drafter layers",
           OURS + "drafter head": "drafter head", OURS + "drafter fc": "drafter other",
           OURS + "drafter context": "drafter other", OURS + "draft": "drafter other",
           OURS + "prepare": "runner other", OURS + "step": "runner other",
           SCOPE + "forward": "target layers", SCOPE + "postprocess": "target head", SCOPE + "sample": "sampling",
           SCOPE + "draft": "drafter other"}
STEP_SCOPES = (OURS + "step", SCOPE + "preprocess")


def _graph_head(kernels: list[dict]) -> set[int]:
    """Indices (into `kernels`, one drafter graph replay in time order) of the draft head's kernels: those
    after the graph's last RMSNorm kernel (the drafter's final norm; then the rows sampled, the LM head GEMM,
    the argmax). A graph without an RMSNorm kernel gives none."""
    last = max((i for i, k in enumerate(kernels) if "rms_norm" in k.get("name", "").lower()), default=None)
    return set() if last is None else set(range(last + 1, len(kernels)))


def decompose(events: list[dict], vocab: set[int], skip: int = 2) -> dict:
    scopes: dict[int, list] = defaultdict(list)
    ops: dict[int, list] = defaultdict(list)
    launches: dict[int, dict] = {}
    gpu: list[dict] = []
    starts: dict[str, list[float]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat"), ev.get("name", "")
        ts, dur = float(ev.get("ts", 0)), float(ev.get("dur", 0))
        if cat == "user_annotation" and (name in PART_OF or name in STEP_SCOPES):
            if name in PART_OF:
                scopes[ev.get("tid")].append((ts, ts + dur, ev))
            if name in STEP_SCOPES:
                starts[name].append(ts)
        elif cat == "cpu_op":
            ops[ev.get("tid")].append((ts, ts + dur, ev))
        elif cat in LAUNCH_CATS:
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = ev
        elif cat in GPU_CATS:
            gpu.append(ev)
    step_starts = next((sorted(starts[n]) for n in STEP_SCOPES if starts.get(n)), [])
    if not step_starts:
        raise TraceError("the trace has no step scopes (`specquant: step` or `gpu_model_runner: preprocess`): "
                         "it was not made with the runner's scopes on; make it with `bench.speed run --profile`")
    if not gpu:
        raise TraceError("the trace has no GPU activity: it was made without CUDA activity (a CPU engine?); "
                         "profile on a GPU")
    # the scopes and operators around each GPU activity's launch, per launching thread
    where: dict[int, tuple[list, list]] = {}
    by_tid: dict = defaultdict(list)
    for i, g in enumerate(gpu):
        launch = launches.get((g.get("args") or {}).get("correlation"))
        if launch is not None:
            by_tid[launch.get("tid")].append((i, float(launch["ts"])))
    for tid, pts in by_tid.items():
        ts_list = [t for _, t in pts]
        sc, op = _enclosing(scopes.get(tid, []), ts_list), _enclosing(ops.get(tid, []), ts_list)
        for (i, _), x, y in zip(pts, sc, op):
            where[i] = (x, y)
    n_steps = len(step_starts)
    busy = [defaultdict(float) for _ in range(n_steps)]
    first = [float("inf")] * n_steps
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(n_steps)]
    graph_corrs: set = set()  # the CUDA-graph launches the activities came from
    assigned: list[tuple[int, str, int | None]] = []  # (gpu index, part, step)
    drafter_graphs: dict = defaultdict(list)  # correlation -> gpu indices of one drafter graph replay
    for gi, g in enumerate(gpu):
        corr = (g.get("args") or {}).get("correlation")
        launch = launches.get(corr)
        if launch is None:
            assigned.append((gi, "unscoped", None))
            continue
        step = bisect.bisect_right(step_starts, float(launch["ts"])) - 1
        inner, enclosing = where.get(gi, ([], []))
        part = PART_OF[inner[-1]["name"]] if inner else "unscoped"
        graph = "Graph" in launch.get("name", "")
        if graph:
            graph_corrs.add(corr)
        if part == "drafter other" and not graph and any(_dims(o) & vocab for o in enclosing):
            part = "drafter head"  # an eager operator over the vocabulary (V1 runner: the draft head, argmax)
        if part == "drafter layers" and graph:
            drafter_graphs[corr].append(gi)
        assigned.append((gi, part, step))
    head: set[int] = set()
    for idx in drafter_graphs.values():
        idx.sort(key=lambda i: float(gpu[i].get("ts", 0)))
        head.update(idx[j] for j in _graph_head([gpu[i] for i in idx]))
    for gi, part, step in assigned:
        if step is None or step < 0:
            continue
        g = gpu[gi]
        ts, dur = float(g.get("ts", 0)), float(g.get("dur", 0))
        busy[step]["drafter head" if gi in head else part] += dur
        first[step] = min(first[step], ts)
        intervals[step].append((ts, ts + dur))
    kept = [i for i in range(skip, n_steps - 1) if first[i] < float("inf") and first[i + 1] < float("inf")]
    if not kept:
        raise TraceError(f"the trace has {n_steps} steps: none left after skipping {skip} and the last; "
                         "profile more tokens")
    mean = {p: sum(busy[i][p] for i in kept) / len(kept) / 1000 for p in PARTS}
    spans, covered = [], []
    for i in kept:
        span = first[i + 1] - first[i]
        merged, end, total = sorted(intervals[i]), float("-inf"), 0.0
        for s, e in merged:
            s, e = max(s, end), min(e, first[i + 1])
            if e > s:
                total += e - s
                end = e
        spans.append(span)
        covered.append(total)
    busy_ms = sum(mean.values())
    span_ms = sum(spans) / len(spans) / 1000
    cover_ms = sum(covered) / len(covered) / 1000
    return {"steps": n_steps, "steps_kept": len(kept), "skip": skip, "graph_launches": len(graph_corrs),
            "parts_ms": {p: round(v, 4) for p, v in mean.items()},
            "parts_share_of_busy": {p: round(v / busy_ms, 4) if busy_ms else None for p, v in mean.items()},
            "gpu_busy_ms": round(busy_ms, 4), "gpu_span_ms": round(span_ms, 4),
            "gpu_idle_ms": round(max(span_ms - cover_ms, 0.0), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.steptrace", description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--vocab", default="151936,32768", help="vocabulary sizes that mark a head's operators")
    p.add_argument("--skip", type=int, default=2, help="steps left out at the start (the prefill)")
    p.add_argument("--json", default=None, help="write the decompositions here")
    a = p.parse_args(argv)
    if a.skip < 0:
        print(f"--skip {a.skip}: steps cannot be skipped backwards; give 0 or more (2 leaves out the prefill)",
              file=sys.stderr)
        return 2
    try:
        vocab = {int(x) for x in a.vocab.split(",") if x}
    except ValueError:
        print(f"--vocab {a.vocab!r}: not comma-separated integers; e.g. --vocab 151936,32768", file=sys.stderr)
        return 2
    out = {}
    for t in a.traces:
        try:
            out[Path(t).name] = d = decompose(load(Path(t)), vocab, a.skip)
        except TraceError as exc:
            print(str(exc) if str(exc).startswith(f"trace {t}") else f"{t}: {exc}", file=sys.stderr)
            return 2
        except FileNotFoundError:
            print(f"{t}: no such file; pass a trace written by `bench.speed run --profile`", file=sys.stderr)
            return 2
        parts = ", ".join(f"{k} {v:.3f}" for k, v in d["parts_ms"].items() if v)
        print(f"{Path(t).name}: {d['steps_kept']} steps; busy {d['gpu_busy_ms']:.3f} ms of span "
              f"{d['gpu_span_ms']:.3f} (idle {d['gpu_idle_ms']:.3f}); {parts}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
