"""A folder's own file list `provenance/files.sha256.json`: format, writer and reader.

    {"files": {relative posix path: {"bytes", "sha256"[, "origin"]}}, "files_sha256": sha256 of the
     canonical JSON of the other fields, "kind": "run" | "published", "schema": "specquant.files/v1"}

Written as canonical JSON (`pipeline.core.io.dumps_json`) by `write` alone (the manifest stage for a run
directory and publish for a repo folder call it through `pipeline.provenance.record.write_file_list`, which
decides what is listed); read by `read` (publish, `verify`'s OK line) and, for a list that may have been
tampered with, `check` (`verify`: each problem as a clause, the list when it is still usable).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_json, dumps_json, read_json, sha256_bytes

PATH = "provenance/files.sha256.json"
SCHEMA = "specquant.files/v1"
KINDS = ("run", "published")
FIX = "re-run `python -m pipeline manifest` (a run directory) or publish (a published folder) to rewrite it"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int
    origin: str | None = None  # published folders: the run-relative path the file was copied from


@dataclass(frozen=True)
class FileList:
    kind: str
    files: dict[str, FileEntry]
    files_sha256: str
    schema: str = SCHEMA


def files_sha256_of(doc: dict[str, Any]) -> str:
    """sha256 of the list's canonical JSON without its own `files_sha256` field (a self-check)."""
    return sha256_bytes(dumps_json({k: v for k, v in doc.items() if k != "files_sha256"}).encode())


def file_list_doc(files: dict[str, dict[str, Any]], kind: str) -> dict[str, Any]:
    """The list's JSON object for `files` ({path: {"sha256", "bytes"[, "origin"]}})."""
    doc = {"schema": SCHEMA, "kind": kind, "files": files}
    return {**doc, "files_sha256": files_sha256_of(doc)}


def write(folder: str | Path, files: dict[str, dict[str, Any]], kind: str) -> FileList:
    """Write `<folder>/provenance/files.sha256.json` listing `files` (already hashed) as canonical JSON."""
    if kind not in KINDS:
        raise ValueError(f"a file list's kind is one of {KINDS}, not {kind!r}")
    doc = file_list_doc(files, kind)
    atomic_write_json(Path(folder) / PATH, doc)
    return parse(doc)


def _entry(rel: str, e: Any) -> FileEntry:
    if not isinstance(e, dict) or not isinstance(e.get("sha256"), str) or type(e.get("bytes")) is not int \
            or not isinstance(e.get("origin", ""), str):
        raise bad_value(f"{PATH} files.{rel}", e, "a listed file is {\"sha256\": hex string, \"bytes\": integer"
                        "[, \"origin\": run path]}", FIX)
    return FileEntry(e["sha256"], e["bytes"], e.get("origin"))


def _shape_ok(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("files"), dict) and doc.get("kind") in KINDS


def parse(doc: Any) -> FileList:
    """The list in `doc` (the parsed JSON); refuses another schema or a malformed entry in one sentence.
    The self-check (`files_sha256`) is `read`'s and `check`'s."""
    if not _shape_ok(doc):
        raise bad_value(PATH, type(doc).__name__, f"a file list is a JSON object with `files` and `kind` "
                        f"({' or '.join(KINDS)})", FIX)
    if doc.get("schema") != SCHEMA:
        raise bad_value(f"{PATH} schema", doc.get("schema"), f"this specquant reads file lists of schema {SCHEMA} only",
                        f"{FIX} with this specquant, or verify it with the specquant that wrote it")
    if not isinstance(doc.get("files_sha256"), str):
        raise bad_value(f"{PATH} files_sha256", doc.get("files_sha256"), "the list's own sha256 is missing", FIX)
    return FileList(kind=doc["kind"], files={rel: _entry(rel, e) for rel, e in doc["files"].items()},
                    files_sha256=doc["files_sha256"], schema=doc["schema"])


def read(path: str | Path) -> FileList:
    """The list at `path`, refused in one sentence when it is not valid JSON, not of this schema, or its
    content does not match its own `files_sha256`."""
    doc = read_json(path, PATH)
    listing = parse(doc)
    if files_sha256_of(doc) != listing.files_sha256:
        raise bad_value(f"{PATH} files_sha256", listing.files_sha256, f"{path} does not match its own sha256 (the "
                        "list was altered)", FIX)
    return listing


def check(doc: Any, data: bytes) -> tuple[FileList | None, list[str]]:
    """`verify`'s reading of a list that may have been tampered with (`doc` parsed from the bytes `data`):
    the list (None when it is unusable) and each problem as a clause to follow `provenance/files.sha256.json: `."""
    if not _shape_ok(doc):
        return None, ["not a specquant file list (no `files` or `kind`); it was altered"]
    problems = []
    if files_sha256_of(doc) != doc.get("files_sha256"):
        problems.append("its content does not match its own files_sha256; the list was altered")
    elif data != dumps_json(doc).encode():
        problems.append("its bytes are not the canonical JSON it was written as; it was altered")
    try:
        return parse(doc), problems
    except SpecquantError as exc:  # after an alteration already named, the list is just unusable
        return None, problems or [str(exc)]


__all__ = ["PATH", "SCHEMA", "FileEntry", "FileList", "files_sha256_of", "file_list_doc", "write", "parse", "read",
           "check"]
