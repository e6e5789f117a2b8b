"""The quantize stages' check reports `runs/<run>/checks/<kind>-<variant>.json` (kind `drafter` or `target`).

Written by `pipeline.quant.checks.write_report` (quantize-drafter through `pipeline.quant.drafter_checks`,
quantize-target through `check_target`), which calls `write`; read by evaluate (the paired calibrated vs
calibration-free comparison), the manifest (`quant_run_manifest.json` carries each report) and publish
through `read_report` / `load_report`, by the fields' one name:

- `TargetCheck`: kind, variant, checkpoint, scheme, reloaded, weight_error {layer: ||W_q - W|| / ||W||},
  weight_error_summary {mean, max, layers}.
- `DrafterCheck`: the same plus reference, observer, calibration, heldout_samples, heldout_anchors,
  heldout_sample_ids, layer_output_error_heldout / _summary, and, when held-apart rows were measured,
  `served` / `weights_only` (`Agreement`: KL and top-1 agreement with the bf16 drafter, per-row match bits),
  `served_rounding_band` (`RoundingBand`, activation-quantized schemes), `activation_error_heldout` /
  `activation_error_summary` and `activation_scale_search` (NVFP4 W4A4).

A report has no format version field: its bytes are pinned (manifests/tiny/outputs.sha256.json). Its format
is its field set: the reader refuses a report with a missing field or one it does not know, naming the file
and the field; an optional field the writer leaves out is absent, never null.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, read_json

FOLDER = "checks"
KINDS = ("drafter", "target")


@dataclass(frozen=True)
class Agreement:
    """The quantized drafter against the bf16 one on the held-apart rows (`drafter_checks._Agreement`)."""
    kl: float
    top1_agreement: float
    rows: int
    agreement_length: float
    blocks: int
    top1_match_bits: str  # one bit per row, in order (pipeline.quant.paired.pack_bits)
    reference_top1_sha256: str  # the bf16 drafter's argmax ids of those rows


@dataclass(frozen=True)
class RoundingBand:
    """`served` again with every activation global scale times each factor (`drafter_checks.compare`)."""
    factors: list[float]
    top1_agreement: list[float]
    agreement_length: list[float]
    top1_min: float
    top1_max: float


@dataclass(frozen=True)
class TargetCheck:
    kind: str
    variant: str
    checkpoint: str
    scheme: str
    reloaded: bool
    weight_error: dict[str, float]
    weight_error_summary: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DrafterCheck:
    kind: str
    variant: str
    checkpoint: str
    reference: str
    scheme: str
    observer: str | None
    calibration: str
    reloaded: bool
    heldout_samples: int
    heldout_anchors: int
    heldout_sample_ids: list[str]
    weight_error: dict[str, float]
    weight_error_summary: dict[str, float]
    layer_output_error_heldout: dict[str, float]
    layer_output_error_summary: dict[str, float]
    # measured only on held-apart rows (absent when there were none)
    served: Agreement | None = None
    weights_only: Agreement | None = None
    # activation-quantized schemes only
    served_rounding_band: RoundingBand | None = None
    activation_error_heldout: dict[str, Any] | None = None
    activation_error_summary: dict[str, Any] | None = None
    activation_scale_search: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        return {k: v for k, v in doc.items() if k not in OPTIONAL or v is not None}


OPTIONAL = ("served", "weights_only", "served_rounding_band", "activation_error_heldout", "activation_error_summary",
            "activation_scale_search")
CLASSES = {"drafter": DrafterCheck, "target": TargetCheck}
Report = DrafterCheck | TargetCheck


def name(kind: str, variant: str) -> str:
    return f"{kind}-{variant}.json"


def _fix(where: str) -> str:
    kind = where.split("/")[-1].split("-")[0]
    stage = "quantize-target" if kind == "target" else "quantize-drafter"
    return f"re-run `make {stage}` for that variant with this specquant"


def _exact(doc: Any, cls, where: str, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`doc` if it is an object with the fields of `cls` (the `optional` ones may be absent); else one sentence."""
    if not isinstance(doc, dict):
        raise bad_value(where, type(doc).__name__, "a check report is a JSON object", _fix(where))
    want = [f.name for f in dataclasses.fields(cls)]
    missing = [k for k in want if k not in doc and k not in optional]
    extra = sorted(k for k in doc if k not in want)
    if missing or extra:
        field = (missing or extra)[0]
        raise bad_value(f"{where} {field}", doc.get(field), "the check report "
                        + ("has no such field" if missing else "has a field this specquant does not know")
                        + f" (the {cls.__name__} fields are {', '.join(want)})", _fix(where))
    return doc


def from_json(doc: Any, where: str) -> Report:
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind not in CLASSES:
        raise bad_value(f"{where} kind", kind, f"a check report's kind is one of {', '.join(KINDS)}", _fix(where))
    if kind == "target":
        return TargetCheck(**_exact(doc, TargetCheck, where))
    d = dict(_exact(doc, DrafterCheck, where, OPTIONAL))
    for k in ("served", "weights_only"):
        if k in d:
            d[k] = Agreement(**_exact(d[k], Agreement, f"{where} {k}"))
    if "served_rounding_band" in d:
        d["served_rounding_band"] = RoundingBand(**_exact(d["served_rounding_band"], RoundingBand,
                                                          f"{where} served_rounding_band"))
    return DrafterCheck(**d)


def path_of(checks_dir: str | Path, kind: str, variant: str) -> Path:
    return Path(checks_dir) / name(kind, variant)


def write(checks_dir: str | Path, report: Report) -> Path:
    """`<checks_dir>/<kind>-<variant>.json`, canonical JSON, atomically."""
    path = path_of(checks_dir, report.kind, report.variant)
    atomic_write_json(path, report.to_json())
    return path


def read_report(path: str | Path) -> Report:
    """The report at `path`; refuses another field set, naming the file and the field."""
    path = Path(path)
    where = f"{FOLDER}/{path.name}"
    return from_json(read_json(path, where), where)


def load_report(checks_dir: str | Path, kind: str, variant: str) -> Report | None:
    """The report of one checkpoint of a run, or None when its quantize stage wrote none."""
    path = path_of(checks_dir, kind, variant)
    return read_report(path) if path.is_file() else None


__all__ = ["Agreement", "RoundingBand", "TargetCheck", "DrafterCheck", "Report", "from_json", "write",
           "read_report", "load_report", "path_of", "name"]
