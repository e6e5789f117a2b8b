"""What the evaluate stage writes for other stages: `eval/results.json` and `eval/vllm_commands.sh`.

`pipeline.stages.evaluate` is the one writer (`write_results`, `write_vllm_commands`); the manifest, publish
and the model card read through `read_results` / `read_vllm_commands` and use the fields by their one name:
`table` (flat rows {variant, subset, tau, relative_to_bf16}, subset "all" included), `calibration_comparison`
(the paired calibrated vs calibration-free statistics), `pairs` (`targets`, `served`, `matrix`
{target: {drafter variant: {calibration_target, subsets, overall, lossless_mismatches}}}, `warnings`,
`comparison`), `target` (`variant`, ...), `variants`, `variant_order`, ... (docs/ARCHITECTURE.md).

results.json carries no format version field: its bytes are pinned by manifests/tiny/outputs.sha256.json.
Its format is its field set: the reader refuses a document whose fields are not exactly these, naming the
file and the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_json, atomic_write_text, read_json

RESULTS = "results.json"
VLLM_COMMANDS = "vllm_commands.sh"
STAGE = "evaluate"


@dataclass(frozen=True)
class TauRow:
    """One cell of the acceptance table: mean acceptance length of `variant` on `subset` ("all": every prompt)."""
    variant: str
    subset: str
    tau: float
    relative_to_bf16: float | None


@dataclass(frozen=True)
class CalibrationComparison:
    """A calibrated variant against the calibration-free one of its scheme, paired (pipeline.quant.paired)."""
    calibrated: str
    calibration_free: str
    scheme: str | None
    what_is_calibrated: str | None
    layer_output_error_heldout: dict[str, Any]
    activation_scale: str | None
    top1_heldout: dict[str, Any] | None
    kl_heldout: dict[str, Any]
    top1_rounding_band: dict[str, Any] | None
    top1_rounding_band_calibrated: dict[str, Any] | None
    verdict: str
    tau: dict[str, Any]


@dataclass(frozen=True)
class EvalResults:
    stage: str
    config: dict[str, Any]
    block_size: int
    max_new_tokens: int
    stop_token_ids: list[int]
    reference_variant: str | None
    variant_order: list[str]
    variants: dict[str, dict[str, Any]]
    drafter: dict[str, Any]
    target: dict[str, Any]
    subsets: list[dict[str, Any]]
    table: list[TauRow]
    calibration_comparison: list[CalibrationComparison]
    pairs: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def measured_tau(self, variant: str) -> dict[str, float]:
        """{target variant: overall tau} of a drafter variant over every target it was measured with."""
        return {t: row[variant]["overall"]["tau"] for t, row in self.pairs["matrix"].items() if variant in row}

    def comparisons_for(self, variant: str) -> list[CalibrationComparison]:
        return [c for c in self.calibration_comparison if variant in (c.calibrated, c.calibration_free)]


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _exact(doc: Any, cls, where: str) -> dict[str, Any]:
    """`doc` if it is an object with exactly the fields of `cls`; else one sentence naming the first odd field."""
    if not isinstance(doc, dict):
        raise bad_value(where, type(doc).__name__, "it is not a JSON object", f"re-run `make {STAGE}`")
    want = _fields(cls)
    missing, extra = [k for k in want if k not in doc], sorted(k for k in doc if k not in want)
    if missing or extra:
        field = (missing or extra)[0]
        raise bad_value(f"{where} {field}", doc.get(field), "eval/results.json "
                        + ("has no such field" if missing else "has a field this specquant does not know")
                        + f" (evaluate writes exactly {', '.join(want)})",
                        f"re-run `make {STAGE}` with this specquant")
    return doc


def from_json(doc: Any, where: str = f"eval/{RESULTS}") -> EvalResults:
    d = dict(_exact(doc, EvalResults, where))
    if d["stage"] != STAGE:
        raise bad_value(f"{where} stage", d["stage"], f"results.json is written by the {STAGE} stage",
                        f"re-run `make {STAGE}`")
    d["table"] = [TauRow(**_exact(r, TauRow, f"{where} table[{i}]")) for i, r in enumerate(d["table"])]
    d["calibration_comparison"] = [CalibrationComparison(**_exact(c, CalibrationComparison,
                                                                 f"{where} calibration_comparison[{i}]"))
                                   for i, c in enumerate(d["calibration_comparison"])]
    return EvalResults(**d)


def write_results(eval_dir: str | Path, results: EvalResults) -> Path:
    path = Path(eval_dir) / RESULTS
    atomic_write_json(path, results.to_json())
    return path


def read_results(eval_dir: str | Path) -> EvalResults | None:
    """`<eval_dir>/results.json` (a run's eval/ or a published folder's), None when evaluate has not run."""
    path = Path(eval_dir) / RESULTS
    if not path.is_file():
        return None
    return from_json(read_json(path, f"eval/{RESULTS}"))


def write_vllm_commands(eval_dir: str | Path, text: str) -> Path:
    path = Path(eval_dir) / VLLM_COMMANDS
    atomic_write_text(path, text)
    path.chmod(0o755)
    return path


def read_vllm_commands(eval_dir: str | Path) -> str | None:
    path = Path(eval_dir) / VLLM_COMMANDS
    return path.read_text(encoding="utf-8") if path.is_file() else None


__all__ = ["RESULTS", "VLLM_COMMANDS", "TauRow", "CalibrationComparison", "EvalResults", "from_json",
           "write_results", "read_results", "write_vllm_commands", "read_vllm_commands"]
