"""The one place a file's sha256 is computed from its bytes on disk, and the count of bytes read for it.

`sha256_file(path)` reads the file and hashes it; every byte it reads is counted (`bytes_hashed()`),
so each stage record (`pipeline/stage.py`) can report how much it read for hashing.
"""

from __future__ import annotations

import hashlib
import os
import threading

_CHUNK = 1 << 20
_lock = threading.Lock()
_read = {"bytes": 0, "files": 0}


def count_read(nbytes: int, files: int = 1) -> None:
    """Count bytes read for hashing outside `sha256_file` (e.g. files read whole for another purpose too)."""
    with _lock:
        _read["bytes"] += int(nbytes)
        _read["files"] += files


def bytes_hashed() -> int:
    """Bytes this process read for hashing since the last `reset_counters()`."""
    return _read["bytes"]


def counters() -> dict[str, int]:
    with _lock:
        return {"bytes_hashed": _read["bytes"], "files_hashed": _read["files"]}


def reset_counters() -> None:
    with _lock:
        _read.update(bytes=0, files=0)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    count_read(n)
    return h.hexdigest()
