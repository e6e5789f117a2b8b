"""The data stage's files, `data/samples.jsonl`, `data/counts.json`, `data/meta.json`: writer and reader.

    samples.jsonl  one sample per line, blend order, compact sorted-key JSON:
                   {"id": "<source>/<row index in source>", "source": "<name>", "input_ids": [int], "loss_mask": [0|1]}
    counts.json    {source name: SourceCounts} (requested, available, examined, kept, dropped by reason, ...)
    meta.json      DataMeta: format_version, seed, max_seq_len, totals, samples_sha256, tokenizer, sources

`meta.json`'s `format_version` is the version of all three files (counts.json carries none of its own);
a reader refuses any other version, a missing or extra key, and a samples.jsonl whose sha256 is not
the one meta.json records. meta.json is written last, so a data directory with a readable meta.json
is complete.

Samples stay plain dicts (typed as `Sample`, a TypedDict): `json.loads` builds them anyway, every
consumer indexes `s["input_ids"]` once per sample, and an object per sample on top of that would
only add allocation and a conversion pass over blends of 10^5 samples x thousands of tokens for no
check the key test below does not already make.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypedDict

from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import HashingWriter, atomic_open, atomic_write_json, read_json, sha256_file

FORMAT_VERSION = 1
SAMPLES, COUNTS, META = "samples.jsonl", "counts.json", "meta.json"
SAMPLE_KEYS = frozenset({"id", "source", "input_ids", "loss_mask"})
FIX = "re-run `make data` with this version of specquant"


class Sample(TypedDict):
    id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass(frozen=True)
class TokenizerRecord:
    """The tokenizer the blend was rendered with: where, and the sha256 of its own files (None if not local)."""

    name_or_path: str
    revision: str | None
    files: dict[str, str] | None
    sha256: str | None
    vocab_size: int


@dataclass(frozen=True)
class SourceRecord:
    """One configured source, as the config named it."""

    name: str
    path: str | None
    hub_id: str | None
    revision: str | None
    split: str
    format: str
    weight: float


@dataclass(frozen=True)
class SourceCounts:
    """What one source gave: rows requested, available, examined, kept, and the drops by reason."""

    requested: int
    available: int
    examined: int
    kept: int
    dropped: dict[str, int]
    dropped_examples: dict[str, list[str]]  # up to a few "<file or hub id@revision>:<line>" per reason
    location: str
    revision: str | None
    format: str
    weight: float


@dataclass(frozen=True)
class DataMeta:
    seed: int
    max_seq_len: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    samples_sha256: str
    tokenizer: TokenizerRecord
    sources: list[SourceRecord]
    blend_name: str | None
    format_version: int = FORMAT_VERSION


# ---------------------------------------------------------------- writer


def sample_line(sample: Mapping[str, Any]) -> bytes:
    """One line of samples.jsonl: compact JSON, keys sorted, ASCII (the format's bytes)."""
    if set(sample) != SAMPLE_KEYS:
        raise ValueError(f"a sample must have exactly the keys {sorted(SAMPLE_KEYS)}, not {sorted(sample)}")
    return (json.dumps(sample, sort_keys=True, separators=(",", ":")) + "\n").encode()


def write(data_dir: str | Path, samples: Iterable[Mapping[str, Any]], counts: Mapping[str, SourceCounts], *,
          seed: int, max_seq_len: int, tokenizer: TokenizerRecord, sources: Sequence[SourceRecord],
          blend_name: str | None) -> DataMeta:
    """Write samples.jsonl (hashed as written), counts.json, then meta.json, each atomically."""
    data_dir = Path(data_dir)
    num_samples = num_tokens = num_loss = 0
    with atomic_open(data_dir / SAMPLES) as raw:
        fh = HashingWriter(raw)
        for s in samples:
            fh.write(sample_line(s))
            num_samples += 1
            num_tokens += len(s["input_ids"])
            num_loss += sum(s["loss_mask"])
    meta = DataMeta(seed=int(seed), max_seq_len=int(max_seq_len), num_samples=num_samples, num_tokens=num_tokens,
                    num_loss_tokens=num_loss, samples_sha256=fh.hexdigest(), tokenizer=tokenizer,
                    sources=list(sources), blend_name=blend_name)
    atomic_write_json(data_dir / COUNTS, {name: asdict(c) for name, c in counts.items()})
    atomic_write_json(data_dir / META, asdict(meta))
    return meta


# ---------------------------------------------------------------- reader


def _build(cls, obj: Any, where: str, field: str):
    """`cls(**obj)`, refusing anything but an object with exactly the dataclass's keys."""
    names, label = {f.name for f in fields(cls)}, f"{where}:{field}" if field else where
    if not isinstance(obj, dict):
        raise bad_value(label, obj, f"it must be a JSON object with the keys {sorted(names)}", FIX)
    extra, missing = sorted(set(obj) - names), sorted(names - set(obj))
    if extra or missing:
        what = "; ".join(x for x in (f"unknown key(s) {extra}" if extra else "",
                                     f"missing key(s) {missing}" if missing else "") if x)
        raise bad_value(label, sorted(obj), f"its keys do not match data format version "
                        f"{FORMAT_VERSION} ({what})", FIX)
    return cls(**obj)


def load_meta(data_dir: str | Path) -> DataMeta:
    """meta.json as a `DataMeta`; refuses a format version other than FORMAT_VERSION first."""
    path = Path(data_dir) / META
    raw = read_json(path, f"data/{META}")
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version != FORMAT_VERSION:
        raise bad_value(f"{path}:format_version", version, f"this reader knows data format version "
                        f"{FORMAT_VERSION} only", FIX)
    meta = _build(DataMeta, raw, str(path), "")
    tokenizer = _build(TokenizerRecord, meta.tokenizer, str(path), "tokenizer")
    if not isinstance(meta.sources, list):
        raise bad_value(f"{path}:sources", meta.sources, "it must be a list of sources", FIX)
    sources = [_build(SourceRecord, s, str(path), f"sources[{i}]") for i, s in enumerate(meta.sources)]
    return DataMeta(**{**{f.name: getattr(meta, f.name) for f in fields(DataMeta)},
                       "tokenizer": tokenizer, "sources": sources})


def load_counts(data_dir: str | Path) -> dict[str, SourceCounts]:
    """counts.json as {source name: SourceCounts} (its version is meta.json's, checked first)."""
    load_meta(data_dir)
    path = Path(data_dir) / COUNTS
    raw = read_json(path, f"data/{COUNTS}")
    if not isinstance(raw, dict):
        raise bad_value(str(path), type(raw).__name__, "it must be a JSON object {source name: counts}", FIX)
    return {name: _build(SourceCounts, c, str(path), name) for name, c in raw.items()}


def load_samples(data_dir: str | Path, meta: DataMeta | None = None) -> list[Sample]:
    """samples.jsonl, refused unless its sha256 is meta.json's and every line holds exactly the sample keys."""
    data_dir = Path(data_dir)
    meta = meta or load_meta(data_dir)
    path = data_dir / SAMPLES
    if not path.is_file():
        raise bad_value(f"data/{SAMPLES}", str(path), "the file does not exist", "run `make data` first")
    actual = sha256_file(path)
    if actual != meta.samples_sha256:
        raise SpecquantError(f"`data/{SAMPLES}` = {str(path)!r}: its sha256 {actual[:12]}... does not match "
                             f"meta.json ({meta.samples_sha256[:12]}...); re-run `make data`.")
    samples = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or row.keys() != SAMPLE_KEYS:
                raise bad_value(f"{path}:{line_no}", sorted(row) if isinstance(row, dict) else row,
                                f"a sample must have exactly the keys {sorted(SAMPLE_KEYS)}", FIX)
            samples.append(row)
    if len(samples) != meta.num_samples:
        raise bad_value(f"{path}", len(samples), f"it holds a different number of samples than meta.json's "
                        f"num_samples ({meta.num_samples})", "re-run `make data`")
    return samples


__all__ = ["FORMAT_VERSION", "Sample", "TokenizerRecord", "SourceRecord", "SourceCounts", "DataMeta",
           "sample_line", "write", "load_meta", "load_counts", "load_samples"]
