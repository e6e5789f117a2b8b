"""What serve-check writes for other stages: `eval/serve_check.json`, its summary of every engine it ran.

`pipeline.stages.serve_check` is the one writer (`write`); the manifest, publish and the model card read it
through `read` (via `pipeline.serving.report.status_for`), never by opening the file themselves. The summary's
fields are `pipeline.serving.verdict.decide`'s (`pairs`, `load_probes`, `failures`, `versions`, `speed`, ...),
plus `format_version` (`FORMAT_VERSION`), added here. Version 1 named the load-and-probe verdicts after the one
family served that way (`dflash2`); version 2 (issue 46) names them `load_probes`, and a version-1 file is read
as version 2 (that field renamed, nothing else differs). A file without `format_version` is the version-1 summary
written before the field existed (serve-check of 2026-12-05 and earlier) and is read the same way; any other
version is refused in one sentence naming the file. serve-check needs vLLM, so this file is not among the
outputs pinned by manifests/tiny (tests/repro.py runs every stage but serve-check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, read_json

PATH = "eval/serve_check.json"  # inside a run directory
FORMAT_VERSION = 2
READABLE = (1, FORMAT_VERSION)  # the versions `read` reads (None, no field: version 1)
LEGACY_LOAD_PROBES = "dflash2"  # version 1's name of `load_probes` (its one load-and-probe family's)


def write(path: str | Path, summary: dict[str, Any]) -> None:
    """Write the summary atomically, with its `format_version`."""
    atomic_write_json(path, {**summary, "format_version": FORMAT_VERSION})


def read(path: str | Path) -> dict[str, Any] | None:
    """The summary in `path` (without `format_version`), or None when serve-check has not written one."""
    path = Path(path)
    if not path.is_file():
        return None
    doc = read_json(path, "serve-check summary")
    if not isinstance(doc, dict) or not isinstance(doc.get("pairs"), dict):
        raise bad_value("serve-check summary", str(path), "it is not a serve-check summary (no `pairs` object)",
                        "delete it and re-run `make serve-check`")
    version = doc.pop("format_version", None)
    if version is not None and version not in READABLE:
        raise bad_value("serve-check summary", str(path), f"its format_version is {version!r}, and this specquant "
                        f"reads versions {' and '.join(map(str, READABLE))} only",
                        "re-run `make serve-check` with this checkout")
    if version != FORMAT_VERSION and LEGACY_LOAD_PROBES in doc:  # version 1: the field's old name
        doc = {("load_probes" if k == LEGACY_LOAD_PROBES else k): v for k, v in doc.items()}
    return doc


__all__ = ["FORMAT_VERSION", "PATH", "READABLE", "read", "write"]
