"""User-facing errors: one sentence naming the field, the value and the fix."""

from __future__ import annotations

import errno
import os
import re


class SpecquantError(Exception):
    """An error caused by the user's input or environment, printed as one line without a traceback."""


class DiskFullError(SpecquantError, OSError):
    """The disk (or quota, or file-size limit) ran out while writing a file; still an OSError for callers
    (`errno` set; `path`: the file or folder being written)."""

    path: str | None = None


def bad_value(field: str, value: object, problem: str, fix: str) -> SpecquantError:
    """Build the house error sentence: `field` = value: problem; fix."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    problem = problem.rstrip(".")
    fix = fix.rstrip(".")
    return SpecquantError(f"`{field}` = {shown}: {problem}; {fix}.")


# ---------------------------------------------------------------- file-system errors libraries raise as their own types
# safetensors' Rust writer (behind every save_pretrained and save_file) raises `SafetensorError` whose text ends in
# the OS error: "Error while serializing: I/O error: No space left on device (os error 28)"
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|\bcode: (\d+)")


def fs_errno(exc: BaseException) -> int | None:
    """The errno behind `exc` when it is a file-system error, whatever type the writer raised it as: an
    OSError's own; the OS error safetensors' Rust writer names in its `SafetensorError` text; torch.save's
    C++ stream writer (a RuntimeError from inline_container.cc, which keeps no errno: EIO). Its causes are
    looked at too (a library that re-raises). None for anything else."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno is not None:
            return int(exc.errno)
        text = str(exc)
        if type(exc).__name__ == "SafetensorError":
            m = _OS_ERROR_CODE.search(text)
            if m:
                return int(m.group(1) or m.group(2))
        if isinstance(exc, RuntimeError) and ("PytorchStreamWriter" in text or "inline_container.cc" in text):
            return errno.EIO
        exc, seen = exc.__cause__, seen + 1  # `raise ... from`: an implicit context may be unrelated
    return None


def as_os_error(exc: BaseException) -> OSError | None:
    """`exc` as an OSError (itself when it is one) when `fs_errno` finds an errno behind it, else None; the
    filename is kept where the error had one."""
    code = fs_errno(exc)
    if code is None:
        return None
    if isinstance(exc, OSError) and exc.errno == code:
        return exc
    err = OSError(code, os.strerror(code))
    err.filename = getattr(exc, "filename", None)
    return err
