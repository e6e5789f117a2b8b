"""Fault points for kill tests, kept out of the shipped package: patch, then run the real entry point.

    python -m tests.faults pause=<n>:<marker> -- -m pipeline cache <overrides>
    python -m tests.faults pause=<n>:<marker> -- path/to/script.py <args>

    python -m tests.faults fill=<module>:<function>:<dir> -- -m pipeline quantize-drafter <overrides>

`pause=<n>:<marker>`: the cache writer (`pipeline.artifacts.cache_writer`) hangs right after the n-th
sample of the run was queued into its shard and that shard's queued writes were drained (the shard's
temp file holds those samples, no sidecar, no index): the n-th sample is written, `<marker>` is created
(holding n) and the writer thread sleeps for ever, so the test can SIGKILL the process at that point.
`fill=<module>:<function>:<dir>`: the first call of `<module>.<function>` (looked up in the module at call
time, as `transformers.modeling_utils:safe_save_file`, the safetensors writer behind save_pretrained) first
fills the file system holding `<dir>` (a real, small one the test mounted: a tmpfs), growing
`<dir>/filler` until the kernel answers ENOSPC, then runs the function on the full disk.
`fsize=<module>:<function>:<bytes>`: the same call first limits the size of any file this process
writes to `<bytes>` (RLIMIT_FSIZE; SIGXFSZ ignored, so a larger write fails with EFBIG), for machines
where the test cannot mount a file system.
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


def fill_disk(where: Path) -> int:
    """Grow `where/filler` until the file system holding it has no space left; returns the bytes written."""
    import errno
    import os

    fd, total = os.open(where / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), 0
    try:
        for chunk in (1 << 20, 1 << 12, 1):  # the last pages too, so the next write of any size fails
            block = b"\0" * chunk
            while True:
                try:
                    total += os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return total


def before_first_call(target: str, action) -> None:
    """Wrap `<module>:<function>` so that `action()` runs once, right before its first call."""
    import importlib

    modname, name = target.split(":")
    module = importlib.import_module(modname)
    original, done = getattr(module, name), []

    def wrapped(*args, **kwargs):
        if not done:
            done.append(True)
            action()
        return original(*args, **kwargs)

    setattr(module, name, wrapped)


def limit_file_size(nbytes: int) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _at(spec: str) -> tuple[str, str]:
    """`<module>:<function>:<arg>` -> (`<module>:<function>`, arg)."""
    modname, name, arg = spec.split(":", 2)
    return f"{modname}:{name}", arg


FAULTS = {
    "pause": lambda spec: pause_writer(int(spec.split(":", 1)[0]), spec.split(":", 1)[1]),
    "fill": lambda spec: before_first_call(_at(spec)[0], lambda: fill_disk(Path(_at(spec)[1]))),
    "fsize": lambda spec: before_first_call(_at(spec)[0], lambda: limit_file_size(int(_at(spec)[1]))),
}


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
