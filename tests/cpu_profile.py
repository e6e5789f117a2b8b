"""Where the suite's time goes: a pytest plugin recording each test's wall time and CPU time, its subprocesses'
included (`resource.getrusage`, setup and teardown counted with the test), one JSON line per test; and a
report of the lines (docs/benchmarks-archive.md, "`make test` on the 2-core CI-sized machine", 2026-12-02).

    CPU_PROFILE_OUT=/tmp/cpu.jsonl python -m pytest -q -n 2 --dist loadfile -p tests.cpu_profile tests
    python -m tests.cpu_profile /tmp/cpu.jsonl

A developer tool: the suite never loads it unless asked (`-p tests.cpu_profile`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time

import pytest


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("CPU_PROFILE_OUT")
    self0, kids0 = _cpu()
    t0 = time.time()
    yield
    if not out:
        return
    self1, kids1 = _cpu()
    with open(out, "a", encoding="utf-8") as fh:  # one short line per write: workers append to the same file
        fh.write(json.dumps({"id": item.nodeid, "wall": round(time.time() - t0, 3), "self": round(self1 - self0, 3),
                             "children": round(kids1 - kids0, 3),
                             "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


def report(path: str, top: int = 20) -> str:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    cpu = lambda r: r["self"] + r["children"]  # noqa: E731
    lines = [f"{len(rows)} tests: CPU {sum(map(cpu, rows)):.0f} s (in-process {sum(r['self'] for r in rows):.0f} s, "
             f"subprocesses {sum(r['children'] for r in rows):.0f} s)"]
    workers = collections.defaultdict(float)
    for r in rows:
        workers[r["worker"]] += r["wall"]
    lines.append("test wall time per worker: " + ", ".join(f"{w} {s:.0f} s" for w, s in sorted(workers.items())))
    modules = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        m = modules[r["id"].split("::")[0]]
        m[0], m[1], m[2] = m[0] + r["self"], m[1] + r["children"], m[2] + 1
    lines.append(f"\n{'module':45s} {'in-process':>10s} {'children':>9s} tests")
    for name, (s, c, n) in sorted(modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"{name:45s} {s:10.1f} {c:9.1f} {n:5d}")
    lines.append(f"\n{'CPU s':>7s} {'wall s':>7s}  test")
    for r in sorted(rows, key=cpu, reverse=True)[:top]:
        lines.append(f"{cpu(r):7.1f} {r['wall']:7.1f}  {r['id']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="report a CPU_PROFILE_OUT file of tests.cpu_profile")
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    print(report(args.path, args.top))


if __name__ == "__main__":
    main()
