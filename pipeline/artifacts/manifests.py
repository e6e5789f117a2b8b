"""The run's two manifests, `calibration_manifest.json` and `quant_run_manifest.json`: writer and reader.

Their fields are fixed by `manifests/<name>.schema.json` (JSON Schema, each with a `schema` version const:
`specquant.calibration_manifest/v1`, `specquant.quant_run_manifest/v1`); the bytes are canonical JSON
(`pipeline.core.io.dumps_json`) and pinned by `manifests/tiny/outputs.sha256.json`. The manifest stage
(`pipeline/stages/manifest.py`) builds the documents and writes both with `write` (validated first, so a
manifest is never written invalid); publish (the model card) and `verify` read them with
`read_calibration` / `read_quant_run` (or `parse_*` on JSON already loaded), which refuse another schema
version or a document that does not match its schema in one sentence naming the file and the field, and
return the dataclasses below: only what consumers read, every other field stays in the file.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_text, dumps_json, read_json

CALIBRATION = "calibration_manifest.json"
QUANT_RUN = "quant_run_manifest.json"
SCHEMAS = {CALIBRATION: "specquant.calibration_manifest/v1", QUANT_RUN: "specquant.quant_run_manifest/v1"}
SCHEMA_DIR = Path(__file__).resolve().parents[2] / "manifests"
FIX = "re-run `python -m pipeline manifest` to rewrite it"


@functools.cache
def _validator(name: str):
    import jsonschema

    stem = name.removesuffix(".json")
    schema = json.loads((SCHEMA_DIR / f"{stem}.schema.json").read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema)


def _first_error(doc: Any, name: str):
    errors = sorted(_validator(name).iter_errors(doc), key=lambda e: list(e.path))
    if not errors:
        return None
    e = errors[0]
    return "/".join(str(p) for p in e.path) or "(top level)", e.message


# ---------------------------------------------------------------- writer
def validate(doc: dict, schema_name: str) -> None:
    """Raise SpecquantError naming the first schema violation (a manifest must never be written invalid)."""
    err = _first_error(doc, f"{schema_name}.json")
    if err:
        where, message = err
        raise SpecquantError(f"{schema_name}.json does not match manifests/{schema_name}.schema.json at {where}: "
                             f"{message}; this is a bug in pipeline/stages/manifest.py, please report it.")


def write(root: str | Path, calibration: dict, quant_run: dict, scrub=None) -> dict[str, str]:
    """Validate both manifests, then write them into the run directory `root` as canonical JSON (`scrub`:
    applied to each text first); returns {file name: the text written}."""
    docs = {CALIBRATION: calibration, QUANT_RUN: quant_run}
    for name, doc in docs.items():
        validate(doc, name.removesuffix(".json"))
    texts = {name: dumps_json(doc) for name, doc in docs.items()}
    texts = {name: scrub(text) if scrub else text for name, text in texts.items()}
    for name, text in texts.items():
        atomic_write_text(Path(root) / name, text)
    return texts


# ---------------------------------------------------------------- what consumers read
@dataclass(frozen=True)
class Digest:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class CacheShard:
    file: str  # run-relative, e.g. cache/shard-00000.safetensors
    sha256: str
    bytes: int


@dataclass(frozen=True)
class CacheSection:
    aux_layer_ids: list[int] | None
    shards: list[CacheShard]


@dataclass(frozen=True)
class DataSource:
    name: str
    path: str | None
    hub_id: str | None
    revision: str | None
    sha256: str | None


@dataclass(frozen=True)
class CalibrationManifest:
    schema: str
    run_name: str
    sources: list[DataSource] | None  # None: the data stage had not run
    cache: CacheSection | None  # the bf16 target's cache; None: not run
    target_caches: dict[str, CacheSection]  # cache-<variant>/ by target variant


@dataclass(frozen=True)
class CheckpointEntry:
    kind: str  # drafter | target
    variant: str
    path: str  # run-relative folder, e.g. drafter/nvfp4
    scheme: str
    quant_config: dict[str, Any] | None
    observer: str | None
    observer_kwargs: dict[str, Any] | None
    group_size: int | None
    ignore: list[str] | None
    seeds: dict[str, Any]  # always holds "seed" (int or None); others as the stage reported them
    files: dict[str, Digest]  # relative to `path`
    # drafters: the vLLM range written and checked for (pipeline.serving.contract.Profile.record: profile,
    # versions, first, last, open_ended, quantized_qkv, is_causal_written, rules); None: not recorded
    vllm: dict[str, Any] | None = None


@dataclass(frozen=True)
class QuantRunManifest:
    schema: str
    run_name: str
    seed: int
    checkpoints: list[CheckpointEntry]

    def checkpoint(self, kind: str, variant: str) -> CheckpointEntry | None:
        return next((c for c in self.checkpoints if c.kind == kind and c.variant == variant), None)


# ---------------------------------------------------------------- reader
def _checked(doc: Any, name: str, where: str) -> dict:
    if not isinstance(doc, dict):
        raise bad_value(where, type(doc).__name__, "a manifest is a JSON object", FIX)
    if doc.get("schema") != SCHEMAS[name]:
        raise bad_value(f"{where} schema", doc.get("schema"), f"this specquant reads {SCHEMAS[name]} only",
                        f"{FIX} with this specquant, or read it with the specquant that wrote it")
    err = _first_error(doc, name)
    if err:
        field, message = err
        raise bad_value(f"{where} {field}", None, f"the file does not match manifests/{name.removesuffix('.json')}"
                        f".schema.json ({message})", FIX)
    return doc


def _cache(sec: dict | None) -> CacheSection | None:
    if sec is None:
        return None
    return CacheSection(aux_layer_ids=sec["aux_layer_ids"],
                        shards=[CacheShard(s["file"], s["sha256"], s["bytes"]) for s in sec["shards"]])


def parse_calibration(doc: Any, where: str = CALIBRATION) -> CalibrationManifest:
    """The calibration manifest in `doc` (parsed JSON of the file `where`), checked against its schema."""
    doc = _checked(doc, CALIBRATION, where)
    data = doc["data"]
    sources = None if data is None else [
        DataSource(s["name"], s.get("path"), s.get("hub_id"), s["revision"], s.get("sha256")) for s in data["sources"]]
    return CalibrationManifest(schema=doc["schema"], run_name=doc["run_name"], sources=sources,
                               cache=_cache(doc["cache"]),
                               target_caches={t: _cache(c) for t, c in (doc.get("target_caches") or {}).items()})


def parse_quant_run(doc: Any, where: str = QUANT_RUN) -> QuantRunManifest:
    """The quant run manifest in `doc` (parsed JSON of the file `where`), checked against its schema."""
    doc = _checked(doc, QUANT_RUN, where)
    return QuantRunManifest(schema=doc["schema"], run_name=doc["run_name"], seed=doc["seed"], checkpoints=[
        CheckpointEntry(kind=c["kind"], variant=c["variant"], path=c["path"], scheme=c["scheme"],
                        quant_config=c["quant_config"], observer=c["observer"], observer_kwargs=c["observer_kwargs"],
                        group_size=c["group_size"], ignore=c["ignore"], seeds=dict(c["seeds"]),
                        files={r: Digest(e["sha256"], e["bytes"]) for r, e in c["files"].items()},
                        vllm=c.get("vllm"))
        for c in doc["checkpoints"]])


def read_calibration(path: str | Path) -> CalibrationManifest:
    """`calibration_manifest.json` at `path`; one sentence naming the file for invalid JSON or another format."""
    return parse_calibration(read_json(path, CALIBRATION), CALIBRATION)


def read_quant_run(path: str | Path) -> QuantRunManifest:
    """`quant_run_manifest.json` at `path`; one sentence naming the file for invalid JSON or another format."""
    return parse_quant_run(read_json(path, QUANT_RUN), QUANT_RUN)


__all__ = ["CALIBRATION", "QUANT_RUN", "SCHEMAS", "validate", "write", "Digest", "CacheShard", "CacheSection",
           "DataSource", "CalibrationManifest", "CheckpointEntry", "QuantRunManifest", "parse_calibration",
           "parse_quant_run", "read_calibration", "read_quant_run"]
