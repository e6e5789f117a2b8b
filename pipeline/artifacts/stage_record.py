"""The stage record `runs/<run>/stages/<stage>[-<variant>].json`: how one stage ran, captured when it ran.

`pipeline.stages.runner` is the one writer (`write_record`); every consumer (the manifest and provenance,
the variant and pairing rules, evaluate, publish) reads through `read_record` / `load_record` /
`load_records`, which refuse a record of an unknown format version or with a missing field in one sentence.

Fields (all written by the runner): `format_version`, `stage`, `argv`, `command`, `overrides`, `launcher`
{torchrun, world_size}, `resolved_config`, `started_utc`, `wall_time_s`, `seed`, `versions`, `git`
{commit, dirty}, `source_sha256`, `device`, the hashing figures `bytes_hashed`, `files_hashed`,
`hash_reused` {files, bytes}, `hashed_files` (pipeline/core/hashes.py), and `result` (the dict the
stage's `run(cfg)` returned). A record without `format_version` (written before the field existed) reads as
version 0: the same fields, the hashing figures None where it predates them. Stage records are no output of a run (not in manifests/tiny/outputs.sha256.json):
they hold start and wall times.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, read_json

FORMAT_VERSION = 1
FOLDER = "stages"


def is_late(name: str) -> bool:
    """The records written after the manifest (the manifest's and publish's own): never part of a run's provenance."""
    return name == "manifest" or name.startswith("publish")


@dataclass(frozen=True)
class StageRecord:
    stage: str
    argv: list[str]
    command: str
    overrides: list[str]
    launcher: dict[str, Any]
    resolved_config: dict[str, Any]
    started_utc: str
    wall_time_s: float
    seed: int
    versions: dict[str, str]
    git: dict[str, Any]
    source_sha256: str | None
    device: dict[str, Any]
    result: dict[str, Any]
    # None only in a record written before they were recorded (version 0, below)
    bytes_hashed: int | None
    files_hashed: int | None
    hash_reused: dict[str, int] | None
    hashed_files: dict[str, int] | None
    format_version: int = FORMAT_VERSION

    def config(self, group: str) -> dict[str, Any]:
        """One group of the resolved config (`quant`, `cache`, `eval`, ...); {} when the config has none."""
        return self.resolved_config.get(group) or {}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(StageRecord))
# version 0: the records written before `format_version` existed; they may lack the hashing figures
LEGACY_VERSION = 0
HASH_FIELDS = ("bytes_hashed", "files_hashed", "hash_reused", "hashed_files")


def record_path(run_dir: str | Path, name: str) -> Path:
    """`<run_dir>/stages/<name>.json`; `name` is `<stage>[-<variant>]` (`pipeline.stages.runner.stage_record_name`)."""
    return Path(run_dir) / FOLDER / f"{name}.json"


def write_record(run_dir: str | Path, name: str, record: StageRecord, scrub=None) -> Path:
    """Write the record atomically as canonical JSON (`scrub`: applied to the JSON object first)."""
    doc = record.to_json()
    path = record_path(run_dir, name)
    atomic_write_json(path, scrub(doc) if scrub else doc)
    return path


def read_record(path: str | Path) -> StageRecord:
    """The record at `path`; refuses an unknown format version or a missing field, naming the file."""
    path = Path(path)
    where = f"{FOLDER}/{path.name}"
    doc = read_json(path, where)
    if not isinstance(doc, dict):
        raise bad_value(where, type(doc).__name__, "a stage record is a JSON object",
                        f"delete {path} and re-run the stage that writes it")
    version = doc.get("format_version", LEGACY_VERSION)
    if version not in (FORMAT_VERSION, LEGACY_VERSION):
        raise bad_value(f"{where} format_version", version,
                        f"this specquant reads stage records of format version {FORMAT_VERSION} (and {LEGACY_VERSION}: "
                        "records without the field) only",
                        "re-run the stage with this specquant, or read the run with the specquant that wrote it")
    optional = ("format_version", *HASH_FIELDS) if version == LEGACY_VERSION else ()
    missing = [k for k in FIELDS if k not in doc and k not in optional]
    if missing:
        raise bad_value(f"{where} {missing[0]}", None, "the stage record has no such field (it was not written by "
                        "pipeline.stages.runner)", "re-run the stage that writes it")
    return StageRecord(**{k: doc.get(k) for k in FIELDS if k != "format_version"}, format_version=version)


def load_record(run_dir: str | Path, name: str) -> StageRecord | None:
    """The record `name` of a run, or None when that stage has not run."""
    path = record_path(run_dir, name)
    return read_record(path) if path.is_file() else None


def load_records(run_dir: str | Path, order: list[str] | tuple[str, ...] = ()) -> dict[str, StageRecord]:
    """{record name: record} of every stage record of a run but the manifest's and publish's own, in
    `order` of their stages (names of stages not in `order` last), then by name."""
    d = Path(run_dir) / FOLDER
    out = {p.stem: read_record(p) for p in (sorted(d.glob("*.json")) if d.is_dir() else [])
           if not is_late(p.stem)}

    def key(item: tuple[str, StageRecord]) -> tuple[int, str]:
        stage = item[1].stage
        return (list(order).index(stage) if stage in order else len(order), item[0])

    return dict(sorted(out.items(), key=key))


__all__ = ["FORMAT_VERSION", "StageRecord", "record_path", "write_record", "read_record", "load_record",
           "load_records"]
