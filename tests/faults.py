"""Fault points for kill tests, kept out of the shipped package: patch, then run the real entry point.

    python -m tests.faults pause=<n>:<marker> -- -m pipeline cache <overrides>
    python -m tests.faults pause=<n>:<marker> -- path/to/script.py <args>

`pause=<n>:<marker>`: the cache writer (`pipeline.artifacts.cache_writer`) hangs right after the n-th
sample of the run was queued into its shard and that shard's queued writes were drained (the shard's
temp file holds those samples, no sidecar, no index): the n-th sample is written, `<marker>` is created
(holding n) and the writer thread sleeps for ever, so the test can SIGKILL the process at that point.
What follows `--` is run like `python <that>` (runpy), with the patches in place.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
from pathlib import Path


def pause_writer(after: int, marker: str) -> None:
    """Patch `ShardWriter.add` (called once per sample, on a BackgroundWriter lane's thread) so that the
    `after`-th sample of the process drains its shard, writes `marker` and hangs."""
    from pipeline.artifacts.cache_writer import ShardWriter

    original, lock, written = ShardWriter.add, threading.Lock(), [0]

    def add(self, g, hs, scale):
        original(self, g, hs, scale)
        with lock:
            written[0] += 1
            hit = written[0] == after
        if hit:
            self.drain()
            Path(marker).write_text(str(after))
            while True:
                time.sleep(60)

    ShardWriter.add = add


FAULTS = {"pause": lambda spec: pause_writer(int(spec.split(":", 1)[0]), spec.split(":", 1)[1])}


def main(argv: list[str]) -> None:
    if "--" not in argv:
        raise SystemExit(__doc__)
    cut = argv.index("--")
    for fault in argv[:cut]:
        name, _, spec = fault.partition("=")
        if name not in FAULTS or not spec:
            raise SystemExit(f"unknown fault {fault!r}: use one of {', '.join(f'{k}=...' for k in FAULTS)}")
        FAULTS[name](spec)
    run = argv[cut + 1:]
    if run[:1] == ["-m"] and len(run) > 1:
        sys.argv = [run[1], *run[2:]]
        runpy.run_module(run[1], run_name="__main__", alter_sys=True)
    elif run:
        sys.argv = list(run)
        runpy.run_path(run[0], run_name="__main__")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
