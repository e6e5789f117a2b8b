"""Hub repo ids: the one rule for "this names a Hugging Face Hub repo" (publish, pairing, the model card)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_id(value: str | None) -> str | None:
    """`value` if it names a Hub repo (not a local directory), else None."""
    if value and REPO_ID.match(str(value)) and not Path(str(value)).exists():
        return str(value)
    return None
