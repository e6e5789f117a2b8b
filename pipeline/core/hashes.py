"""Hash once: a file's sha256 is computed when it is written or first read, then reused while the file is unchanged.

Every sha256 of a file on disk goes through `sha256_file` (`pipeline.core.io.sha256_file`, `hash_files`,
`hash_tree`, `pipeline.core.loading.checkpoint_hashes` all call it). A digest is remembered with the file's
identity and stamp:

    (st_dev, st_ino) -> {"path", "bytes", "mtime_ns", "ctime_ns", "sha256"}

and asking again for the same file returns it without reading a byte while size, mtime_ns and
ctime_ns are all unchanged. Anything else reads the file again: an edit in place (new mtime), a
rewrite through a temp file (new inode), a forged mtime (`os.utime` moves ctime, which no user call
can set back). A digest is remembered only if the file's stamp did not change while it was read.

Where digests come from:
- a `pipeline.core.io.HashingWriter` inside `pipeline.core.io.atomic_open` (samples.jsonl, the cache shards,
  every `atomic_write_*`): recorded when the temp file is renamed into place, so nobody reads it back;
- the first `sha256_file` of any other file (checkpoints a library wrote, the target, inputs).

Two layers:
- in this process, always (thread-safe: the cache stage hashes on writer threads);
- per run, `<run_dir>/.work/hashes.json`: `pipeline.stages.runner.run_stage` loads it before a stage runs
  (`use_run`) and merges this process's new digests into it after the stage finished (`flush`), under
  an exclusive lock on `.work/hashes.lock` (fcntl) and with an atomic rename, so torchrun ranks and
  concurrent stages of one run add to it without losing each other's digests. A stage that fails or
  is refused writes nothing there (the run directory stays as it was). The file is scratch: no file
  list, manifest or comparison names it (`pipeline.provenance.record.is_late`). An unreadable store is
  ignored and rewritten.

Trust: the store only saves reads of files whose stamp is exactly as it was when hashed; whoever can
write the run directory could forge it, as they could the manifests. `python -m pipeline verify`
never uses it (`reuse=False`): it reads every byte, on purpose.

Counters (`counters()`, reset per stage): bytes and files read to hash, and bytes and files a
remembered digest saved; `pipeline.stages.runner` writes them into each stage record (`bytes_hashed`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

SCHEMA = "specquant.hashes/v1"
STORE = Path(".work") / "hashes.json"  # relative to the run directory
_CHUNK = 1 << 20

_lock = threading.RLock()
_known: dict[str, dict[str, Any]] = {}  # key -> entry: every digest this process learnt or used
_stored: dict[str, dict[str, Any]] = {}  # key -> entry: the run's store as `use_run` loaded it
_new: dict[str, dict[str, Any]] = {}  # key -> entry: learnt since the last flush
_store: Path | None = None
_counts = {"bytes_hashed": 0, "files_hashed": 0, "bytes_reused": 0, "files_reused": 0}
_reads: dict[str, int] = {}  # path -> bytes read to hash it, since the last reset


# ---------------------------------------------------------------- identity and stamp
def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def _stamp(st: os.stat_result) -> dict[str, int]:
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _valid(entry: dict[str, Any] | None, st: os.stat_result) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and all(entry.get(k) == v for k, v in _stamp(st).items()))


# ---------------------------------------------------------------- lookups and records
def lookup(path: str | os.PathLike, st: os.stat_result | None = None) -> str | None:
    """The remembered sha256 of `path` if its size, mtime and ctime are as when it was hashed, else None."""
    st = st if st is not None else os.stat(path)
    key = _key(st)
    with _lock:
        entry = next((e for e in (_known.get(key), _stored.get(key)) if _valid(e, st)), None)
        if entry is None:
            return None
        where = os.path.abspath(path)
        if entry["path"] != where:  # the same file under another name (its folder was renamed into place)
            entry = {**entry, "path": where}
            _new[key] = entry
        _known[key] = entry
        return entry["sha256"]


def record(path: str | os.PathLike, sha256: str, st: os.stat_result | None = None) -> None:
    """Remember `sha256` for `path` as it is now (a writer that hashed the bytes it wrote calls this
    after the file is in place)."""
    st = st if st is not None else os.stat(path)
    entry = {"path": os.path.abspath(path), **_stamp(st), "sha256": sha256}
    with _lock:
        _known[_key(st)] = _new[_key(st)] = entry


def record_written(path: str | os.PathLike, sha256: str, nbytes: int) -> None:
    """`record` for a file just renamed into place, if it holds exactly the `nbytes` that were hashed."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if st.st_size == nbytes:
            record(path, sha256, st)


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`os.replace(src, dst)` keeping src's remembered digest: a rename moves the file's ctime (which the
    memo checks), not its bytes. Carried over only if the digest was valid just before the move and the
    file at dst is the same inode with the same size and mtime."""
    st = os.stat(src)
    digest = lookup(src, st)
    os.replace(src, dst)
    if digest is not None:
        with contextlib.suppress(OSError):
            st2 = os.stat(dst)
            if (st2.st_dev, st2.st_ino, st2.st_size, st2.st_mtime_ns) == (st.st_dev, st.st_ino, st.st_size,
                                                                           st.st_mtime_ns):
                record(dst, digest, st2)


def moved_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """After `os.replace(src_dir, dst_dir)`: the files inside keep their inode and stamp, so their digests stay
    valid, but the memo names them under `src`; name them under `dst`, or `flush` would find the old paths gone
    and drop them (a checkpoint folder swapped in by `pipeline.core.io.atomic_dir` would be read again)."""
    old, new = os.path.abspath(src) + os.sep, os.path.abspath(dst) + os.sep
    with _lock:  # every entry of _new is also in _known (record, lookup)
        for key, entry in list(_known.items()):
            if entry["path"].startswith(old):
                _known[key] = _new[key] = {**entry, "path": new + entry["path"][len(old):]}


def count_read(nbytes: int, path: str | os.PathLike | None = None) -> None:
    """Count bytes read for hashing outside `sha256_file` (e.g. a file read whole for a copy and hashed)."""
    with _lock:
        _counts["bytes_hashed"] += int(nbytes)
        _counts["files_hashed"] += 1
        if path is not None:
            where = os.path.abspath(path)
            _reads[where] = _reads.get(where, 0) + int(nbytes)


def sha256_file(path: str | os.PathLike, reuse: bool = True) -> str:
    """The file's sha256: remembered while the file is unchanged (`reuse`), else read and remembered.
    `reuse=False` always reads every byte (what `verify` does)."""
    st = os.stat(path)
    if reuse:
        digest = lookup(path, st)
        if digest is not None:
            with _lock:
                _counts["bytes_reused"] += st.st_size
                _counts["files_reused"] += 1
            return digest
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
        after = os.fstat(fh.fileno())
    count_read(n, path)
    digest = h.hexdigest()
    if _key(after) == _key(st) and _stamp(after) == _stamp(st) and n == after.st_size:
        record(path, digest, after)  # not while someone was writing it
    return digest


# ---------------------------------------------------------------- counters
def counters() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def bytes_hashed() -> int:
    """Bytes this process read for hashing since the last `reset_counters()`."""
    return _counts["bytes_hashed"]


def reads(root: str | os.PathLike | None = None) -> dict[str, int]:
    """{file: bytes read to hash it} since the last reset; paths relative to `root` when inside it."""
    base = os.path.abspath(root) + os.sep if root is not None else None
    with _lock:
        items = sorted(_reads.items())
    return {(p[len(base):] if base and p.startswith(base) else p): n for p, n in items}


def reset_counters() -> None:
    with _lock:
        _counts.update(dict.fromkeys(_counts, 0))
        _reads.clear()


# ---------------------------------------------------------------- the run's store
def _read_store(path: Path) -> dict[str, dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    entries = doc.get("entries") if isinstance(doc, dict) and doc.get("schema") == SCHEMA else None
    return {k: e for k, e in entries.items() if isinstance(e, dict)} if isinstance(entries, dict) else {}


def use_run(run_dir: str | os.PathLike) -> None:
    """Use `<run_dir>/.work/hashes.json`: load its digests now (nothing is created until `flush`)."""
    global _store
    store = Path(run_dir).resolve() / STORE
    loaded = _read_store(store)
    with _lock:
        _store = store
        _stored.clear()
        _stored.update(loaded)


def _still_there(key: str, entry: dict[str, Any]) -> bool:
    try:
        st = os.stat(entry.get("path", ""))
    except (OSError, TypeError, ValueError):
        return False
    return _key(st) == key and _valid(entry, st)


def _replace(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (temp file beside it, fsync, rename). Not `core.io.atomic_open`:
    io records digests here, so this module does not import it back; and the store is never recorded."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def flush() -> Path | None:
    """Merge the digests learnt since the last flush into the run's store; entries whose file is gone or
    changed are dropped. Returns the store's path, or None when there was nothing to write."""
    import fcntl

    with _lock:
        store, new = _store, dict(_new)
    if store is None or not new:
        return None
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        with open(store.with_name("hashes.lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            merged = {**_read_store(store), **new}
            kept = {k: e for k, e in sorted(merged.items()) if _still_there(k, e)}
            _replace(store, json.dumps({"schema": SCHEMA, "entries": kept}, sort_keys=True,
                                       separators=(",", ":")).encode("utf-8"))
    except OSError:  # a memo that cannot be saved (read-only run dir, full disk) costs re-reads, never the stage
        return None
    with _lock:
        for k in new:
            if _new.get(k) is new[k]:
                del _new[k]
    return store
