"""User-facing errors: one sentence naming the field, the value and the fix."""

from __future__ import annotations


class SpecquantError(Exception):
    """An error caused by the user's input or environment, printed as one line without a traceback."""


class DiskFullError(SpecquantError, OSError):
    """The disk (or quota, or file-size limit) ran out while writing a file; still an OSError for callers."""


def bad_value(field: str, value: object, problem: str, fix: str) -> SpecquantError:
    """Build the house error sentence: `field` = value: problem; fix."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    problem = problem.rstrip(".")
    fix = fix.rstrip(".")
    return SpecquantError(f"`{field}` = {shown}: {problem}; {fix}.")
