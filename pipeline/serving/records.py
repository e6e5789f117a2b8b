"""serve-check's records: the jobs the stage hands a worker, the result a worker hands back, and the summary the
verdict builds. Jobs and results cross a process boundary as JSON (the worker runs in vLLM's interpreter), so each
record is a dataclass with `to_json` / `from_json` giving exactly the JSON the worker reads and writes (the files
are written with sorted keys, so the order of the fields is free); a key this
record does not name (a bench job's `compilation_config`, a result's figures) rides along in `extra`, unchanged.
A record also reads like that JSON (`job["name"]`, `result.get("ok")`: a read-only mapping of `to_json()`), so
code written against the JSON reads a record as well. Standard library only.

The summary (`ServeSummary`, `PairVerdict`) is a typed dict: it is written as it is to `eval/serve_check.json`
(`pipeline.artifacts.serve_results`) and read back as JSON by publish, the manifest and the card.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypedDict

# the `kind` of a load-and-probe job (no engine: vLLM's model class loaded and probed); the worker's side names it
# `worker_load_probe.LOAD_PROBE` (it imports nothing from here)
LOAD_PROBE = "load_probe"


class _JsonRecord(Mapping):
    """to_json / from_json over the dataclass fields in order; `None` in an `OPTIONAL` field is left out of the
    JSON (the key is absent, as the stage always wrote it); `extra` holds the keys no field names."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (f.name in self.OPTIONAL and value is None):
                continue
            out[f.name] = value
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   extra={k: v for k, v in data.items() if k not in names})

    # the record read as its JSON
    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass
class EngineJob(_JsonRecord):
    """One vLLM engine (`pipeline.serving.worker_engine.run_job`): a target alone (`drafter` None) or a target
    with a DFlash drafter, the evaluate stage's prompts as token ids ({subset: [ids]})."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"num_speculative_tokens", "speed", "served_as",
                                                    "language_model_only"})
    # what this engine serves
    name: str
    target_variant: str
    target: str
    drafter: str | None
    variant: str | None
    linear_backend: str
    prompts: dict[str, list[list[int]]]
    # the engine's settings, the same for every job of a run
    max_tokens: int
    stop_token_ids: list[int]
    max_model_len: int
    kv_cache_memory_bytes: int
    seed: int
    dtype: str
    kv_cache_dtype: str
    gpu_memory_utilization: float
    cpu_nvfp4_emulation: bool
    cpu_int4_emulation: bool
    attention_backend: str | None
    additional_config: dict[str, Any]
    enforce_eager: bool
    tokenizer: str
    num_speculative_tokens: int | None = None  # a pair: the drafter's block size - 1
    speed: dict[str, Any] | None = None  # {"batches", "max_tokens"}: timed on a GPU (worker_speed)
    served_as: dict[str, Any] | None = None  # a target served from a copy in its wrapper's layout (serving.layout)
    language_model_only: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadProbeJob(_JsonRecord):
    """One drafter of a load-and-probe family (DFlash2) loaded by vLLM's own model class and probed, no engine
    (`pipeline.serving.worker_load_probe.run_load_probe`); `probe`, `probe_out` and `target_head` are set
    once the reference's inputs are written (`pipeline.serving.references.load_probe_inputs`)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"probe", "probe_out", "target_head"})
    name: str
    variant: str
    target_variant: str
    target: str
    drafter: str
    dtype: str
    seed: int
    num_speculative_tokens: int
    max_model_len: int
    cpu_nvfp4_emulation: bool
    cpu_int4_emulation: bool
    kind: str = LOAD_PROBE
    probe: str | None = None
    probe_out: str | None = None
    target_head: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerResult(_JsonRecord):
    """What a worker writes (or the stage, for a worker that wrote nothing): `ok`, the job as run (prompts and
    the head's lookup left out), and on failure `error` (type and first line) and `traceback`; every figure of
    the run (subsets, layers, versions, speed, modules, ...) in `extra`, as the worker wrote it."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"kind", "error", "traceback"})
    ok: bool
    name: str
    job: dict[str, Any]
    kind: str | None = None
    error: str | None = None
    traceback: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def load_probe(self) -> bool:
        return self.kind == LOAD_PROBE


def pair_key(target: str, variant: str | None, backend: str = "auto") -> str:
    """`target/variant`, `/backend` added where the drafter ran on another linear backend than vLLM's own."""
    return f"{target}/{variant}" + ("" if backend == "auto" else f"/{backend}")


def job_from_json(data: Mapping[str, Any]) -> EngineJob | LoadProbeJob:
    """The job record a job file holds."""
    return (LoadProbeJob if data.get("kind") == LOAD_PROBE else EngineJob).from_json(data)


@dataclass(frozen=True)
class Criteria:
    """What a pair must meet (`serve.*`): tau at least `min_tau` and `min_tau_ratio` of the bf16 drafter's,
    lossless where `require_lossless`, differences within `lossless_tie` of the reference's logits a near-tie."""
    min_tau_ratio: float
    min_tau: float
    require_lossless: bool = True
    lossless_tie: float = 0.0


@dataclass(frozen=True)
class ReferenceTau:
    """The reference loop's tau (evaluate): {variant: {subset|all: tau}} with `target`, and per target of its pair
    matrix ({target: {variant: ...}})."""
    target: str | None = None
    tau: dict[str, dict[str, float]] | None = None
    matrix: dict[str, dict[str, dict[str, float]]] | None = None


class PairVerdict(TypedDict, total=False):
    """One drafter with one target (`pipeline.serving.verdict.summarize`): the figures and the verdict."""
    target: str
    variant: str
    linear_backend: str
    ok: bool
    problems: list[str]
    warnings: list[str]
    error: str | None
    unsupported: str
    emulated: dict[str, str]
    load_s: float | None
    generate_s: float | None
    peak_gpu_bytes: int | None
    versions: dict[str, Any] | None
    drafter_kernel: str | None
    target_kernel: str | None
    layers: dict[str, Any]
    kernel_log: list[str] | None
    lossless: dict[str, Any]
    tau: dict[str, float | None]
    acceptance_per_position: dict[str, list]
    drafts: int
    reference_tau: dict[str, float]
    tau_minus_reference: dict[str, float]
    tau_ratio_to_bf16: float


class ServeSummary(TypedDict, total=False):
    """`eval/serve_check.json` (less its `format_version`): every pair's verdict, the targets alone, the
    load-and-probe verdicts (DFlash2), the failures, the engine's versions, the speed rows, and what the check ran with."""
    schema: str
    versions: dict[str, Any]
    engine: str
    min_tau_ratio: float
    min_tau: float
    require_lossless: bool
    lossless_tie: float
    reference_target: str | None
    unsupported: list[str]
    pairs: dict[str, PairVerdict]
    targets_alone: dict[str, dict[str, Any]]
    failures: list[str]
    tie_logits: dict[str, dict]
    load_probes: dict[str, dict]
    speed: dict[str, Any]
    pairing_warnings: list[str]
    pair_comparison: list[dict]
    probe: dict[str, Any]
    served_layouts: dict[str, dict]
    settings: dict[str, Any]
