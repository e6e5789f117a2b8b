"""Atomic writes, hashing and path confinement shared by every stage.

Nothing a stage writes is ever visible half-written: data goes to a temporary
file in the destination directory, is fsynced, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from pipeline.core.errors import DiskFullError, bad_value, fs_errno

TMP_PREFIX = ".tmp-specquant-"
PARTIAL_PREFIX = ".partial-"  # a whole directory being assembled by `atomic_dir`
# `hf download --local-dir` keeps its own download metadata here; it changes whenever the files are
# re-downloaded, so no file list, verification or input hash counts it (see `in_hf_local_cache`)
HF_LOCAL_DIR_CACHE = ".cache/huggingface/"
# out of space, out of quota, or over a file-size limit: the user's fix is the same (more room, re-run)
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _read_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


# mkstemp creates 0600 files; outputs get the mode a plain open() would (read once: umask is process-wide)
_FILE_MODE = 0o666 & ~_read_umask()
# ... and folders (and executable files) a plain mkdir's: 0644 / 0755 under the usual umask 022
_DIR_MODE = 0o777 & ~_read_umask()


def _default_mode() -> int:
    return _FILE_MODE


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_full(path: str | os.PathLike, exc: BaseException | int) -> DiskFullError:
    """The one-sentence error for a write that ran out of space (names the file, says the fix); `exc` is the
    error the writer raised (an OSError, or a library's own type: `errors.fs_errno`) or its errno."""
    code = exc if isinstance(exc, int) else fs_errno(exc) or errno.ENOSPC
    err = DiskFullError(f"no space left to write {path} ({os.strerror(code)}); free some space there or write "
                        "to a larger disk, then re-run the same command (finished files are kept).")
    err.errno = code  # (strerror and filename stay unset: OSError's str() would replace the sentence)
    err.path = str(path)
    return err


class _GuardedFile:
    """The temp file's handle; a write that runs out of space raises `DiskFullError` naming `path`
    (also when the write happens on another thread, as the cache's shard writer does)."""

    def __init__(self, fh: BinaryIO, path: Path):
        self._fh, self._path = fh, path
        self.hasher: HashingWriter | None = None  # set by a HashingWriter over this handle

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            if exc.errno in _DISK_FULL and not isinstance(exc, DiskFullError):
                raise disk_full(self._path, exc.errno) from None
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temp file beside `path`; on clean exit fsync and rename it over `path`.

    Running out of space anywhere (mkdir, the temp file, a write, flush, fsync) raises
    `DiskFullError` naming `path`; the temp file is removed and `path` is left as it was."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
        os.fchmod(fd, _default_mode())
        with os.fdopen(fd, mode) as fh:
            guarded = _GuardedFile(fh, path)
            yield guarded
            fh.flush()
            os.fsync(fh.fileno())
            hasher = guarded.hasher
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if hasher is not None:  # the bytes were hashed as they were written: nobody needs to read them back
            from pipeline.core import hashes

            hashes.record_written(path, hasher.hexdigest(), hasher.bytes)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if not isinstance(exc, DiskFullError) and fs_errno(exc) in _DISK_FULL:
            raise disk_full(path, exc) from None
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        HashingWriter(fh).write(data)  # its sha256 is remembered (pipeline.core.hashes), never read back


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, 2-space indent, trailing newline (byte-stable)."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, dumps_json(obj))


def read_json(path: str | os.PathLike, field: str = "path") -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad_value(field, str(path), "the file does not exist", "run the stage that writes it first") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_value(field, str(path), f"the file is not valid JSON ({exc})", "delete it and re-run the stage that writes it") from None


class HashingWriter:
    """A file-like wrapper that hashes bytes as they are written (no second read).

    Over a handle of `atomic_open` (directly, or through wrappers that keep the inner handle as `_fh`,
    like the cache's `_AsyncFile`), the digest is recorded in `pipeline.core.hashes` when the file is
    renamed into place, if every byte of the file went through this writer."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self._h = hashlib.sha256()
        self.bytes = 0
        inner = fh
        for _ in range(4):
            if isinstance(inner, _GuardedFile):
                inner.hasher = self
                break
            inner = inner.__dict__.get("_fh") if hasattr(inner, "__dict__") else None

    def write(self, data: bytes) -> int:
        self._h.update(data)
        self.bytes += len(data)
        return self._fh.write(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fh, name)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, reuse: bool = True) -> str:
    """The file's sha256 (`pipeline.core.hashes.sha256_file`): remembered while the file is unchanged, else
    read; `reuse=False` reads every byte."""
    from pipeline.core import hashes

    return hashes.sha256_file(path, reuse=reuse)


def in_hf_local_cache(rel: str) -> bool:
    """True for a relative posix path inside the Hub client's `.cache/huggingface/` folder."""
    return rel == HF_LOCAL_DIR_CACHE.rstrip("/") or rel.startswith(HF_LOCAL_DIR_CACHE)


def list_files(root: str | os.PathLike, skip=lambda rel: False, follow_links: bool = False) -> list[str]:
    """Every regular file under root (relative posix paths, sorted), symlinks and temp files left out.

    `follow_links=True` is for inputs such as Hub cache snapshots, whose files are symlinks into `blobs/`."""
    root = Path(root)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if (p.is_symlink() and not follow_links) or not p.is_file() or p.name.startswith(TMP_PREFIX) or skip(rel):
            continue
        out.append(rel)
    return out


def hash_files(root: str | os.PathLike, rels: list[str], desc: str = "hashing",
                reuse: bool = True) -> dict[str, dict[str, Any]]:
    """{rel: {"sha256", "bytes"}} for the given files under root, in the given order (progress bar when large).
    A digest remembered by `pipeline.core.hashes` for an unchanged file is reused; `reuse=False` reads every byte.
    Files are hashed on up to 8 threads at once (one file's sha256 is sequential, hashlib releases the GIL),
    so a sharded checkpoint hashes at several cores' rate."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    root = Path(root)
    sizes = {rel: (root / rel).stat().st_size for rel in rels}
    total = sum(sizes.values())

    def one(rel: str) -> dict[str, Any]:
        p = root / rel
        return {"sha256": sha256_file(p, reuse=reuse), "bytes": p.stat().st_size}

    threads = max(1, min(8, os.cpu_count() or 1, sum(1 for s in sizes.values() if s >= (64 << 20))))
    entries = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=total < (64 << 20)) as bar, \
            ThreadPoolExecutor(threads, thread_name_prefix="hash") as pool:
        futures = {rel: pool.submit(one, rel) for rel in sorted(rels, key=lambda r: -sizes[r])}  # largest first
        for rel, fut in futures.items():
            entries[rel] = fut.result()
            bar.update(entries[rel]["bytes"])
    return {rel: entries[rel] for rel in rels}


def hash_tree(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """{relative posix path: {"sha256", "bytes"}} for every regular file under root, sorted
    (`list_files` + `hash_files`; `exclude` names files or folders to leave out)."""
    def skip(rel: str) -> bool:
        return any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in exclude)

    return hash_files(root, list_files(root, skip))


def confine(path: str | os.PathLike, root: str | os.PathLike, field: str) -> Path:
    """Resolve `path` (symlinks included) and refuse it unless it lies inside `root`."""
    root_r = Path(root).resolve()
    resolved = Path(path).resolve()  # relative paths are relative to the working directory, like `root`
    if resolved != root_r and root_r not in resolved.parents:
        raise bad_value(field, str(path), f"it resolves to {resolved}, outside the run directory {root_r}",
                        "use a path inside the run directory and remove symlinks that point out of it")
    return resolved


def remove_stale_temps(directory: str | os.PathLike) -> int:
    """Delete temp files left by a killed writer; returns how many were removed."""
    n = 0
    d = Path(directory)
    if d.is_dir():
        for p in d.rglob(TMP_PREFIX + "*"):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                n += 1
    return n


# ---------------------------------------------------------------- whole directories
def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _normalize_modes(root: Path) -> None:
    """Give every file under `root` the mode a plain open() would (executables and folders a plain
    mkdir's): libraries that write through their own temp files leave them 0600 (safetensors'
    save_file, behind every quantized model.safetensors), so one checkpoint folder would mix private
    and readable files. Modes are not part of any hash (`hash_files` reads only the bytes)."""
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        want = _DIR_MODE if p.is_dir() or mode & 0o100 else _FILE_MODE
        if mode & 0o7777 != want:
            os.chmod(p, want)


def remove_partials(parent: str | os.PathLike) -> None:
    """Delete the `.partial-*` directories a killed `atomic_dir` left in `parent`."""
    parent = Path(parent)
    if parent.is_dir():
        for p in parent.iterdir():
            if p.name.startswith(PARTIAL_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty sibling directory; on clean exit (modes made uniform, every file fsynced) it
    replaces `final` in one rename, so `final` is never seen half-written. A killed run leaves only a `.partial-*` sibling,
    which the next `atomic_dir` in the same parent removes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(final.parent)
    tmp = final.parent / f"{PARTIAL_PREFIX}{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _normalize_modes(tmp)
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f"{PARTIAL_PREFIX}{final.name}-old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        from pipeline.core import hashes

        hashes.moved_dir(tmp, final)  # the digests of files written inside stay valid under their new names
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # a library writing into the folder (safetensors behind save_pretrained raises its own
        # SafetensorError) ran out of space: the same one sentence as our own writers, naming the folder
        if not isinstance(exc, DiskFullError) and fs_errno(exc) in _DISK_FULL:
            raise disk_full(final, exc) from None
        raise
