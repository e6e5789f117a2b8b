"""`python -m tests.reliability`: run the fault-injection suite and write docs/reliability.md.

Every test marked `faults` (kills, full disk, tampering, bad inputs, leaked secrets) is run with
pytest; its outcome is rendered as a table with the command that regenerates it.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.core.io import atomic_write_text

REPO = Path(__file__).resolve().parent.parent
KIND_TITLES = {
    "kill": "Killed stages (SIGKILL, then re-run)",
    "disk_full": "Full disk",
    "tamper": "Flipped bytes / tampered files",
    "bad_input": "Bad inputs (one-sentence error, nothing written)",
    "secret": "Secrets",
}


def render(rows: list[dict], command: str) -> str:
    by_kind = collections.defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    passed = sum(r["outcome"] == "passed" for r in rows)
    lines = [
        "# Reliability: faults, bad inputs and tampering",
        "",
        f"Generated {_dt.date.today().isoformat()} by `{command}` on the tiny world "
        f"({len(rows)} cases, {passed} passed, {len(rows) - passed} not passed).",
        "",
        "| kind | cases | passed |",
        "|---|---|---|",
    ]
    for kind, items in sorted(by_kind.items()):
        lines.append(f"| {KIND_TITLES.get(kind, kind)} | {len(items)} | {sum(i['outcome'] == 'passed' for i in items)} |")
    for kind, items in sorted(by_kind.items()):
        lines += ["", f"## {KIND_TITLES.get(kind, kind)}", "", "| case | what is tried and checked | outcome |", "|---|---|---|"]
        for r in sorted(items, key=lambda r: r["nodeid"]):
            case = r["case"] or r["nodeid"].split("::")[-1]
            lines.append(f"| `{case}` | {r['what'].replace('|', '/')} | {r['outcome']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "results.jsonl"
        env = {**os.environ, "SPECQUANT_RELIABILITY_OUT": str(log)}
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "faults", "-p", "no:cacheprovider",
                              *args.pytest_args], cwd=REPO, env=env)
        rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    atomic_write_text(args.out, render(rows, "make reliability"))
    print(f"[specquant] reliability: {len(rows)} cases -> {args.out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
