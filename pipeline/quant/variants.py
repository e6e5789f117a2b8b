"""Variant directories never change meaning silently.

A variant's directory is named by `quant.name` (`target_quant.name`); the presets set it. Asked to
write `drafter/<name>/` again with settings that change its bytes (scheme, algorithm, observer, group
size, calibration, seed, ...), a quantize stage refuses in one sentence naming both settings and the
override that keeps both, before any weight is read. The same settings (a re-run) are welcome.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value

# settings that only steer checks or where the work runs: they do not change the checkpoint's bytes
NOT_IN_BYTES = ("name", "device", "heldout_samples", "rounding_band_factors")


def _bytes_settings(quant: dict, seed: Any) -> dict:
    return {**{k: v for k, v in sorted(quant.items()) if k not in NOT_IN_BYTES}, "seed": seed}


def refuse_overwrite(record: Path, out_dir: Path, field: str, quant_cfg, seed: int) -> None:
    """Refuse when `out_dir` exists and `record` (its stage record) says it was made with other settings."""
    from omegaconf import OmegaConf

    from pipeline.artifacts.stage_record import read_record

    if not (out_dir.is_dir() and record.is_file()):
        return
    old_rec = read_record(record)
    old = _bytes_settings(old_rec.config(field), old_rec.seed)
    new = _bytes_settings(OmegaConf.to_container(quant_cfg, resolve=True), int(seed))
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if not diff:
        return
    was = ", ".join(f"{k}={old.get(k)!r}" for k in diff[:3])
    now = ", ".join(f"{k}={new.get(k)!r}" for k in diff[:3])
    suffix = "-".join(f"{k.replace('_', '')}{new.get(k)}" for k in diff[:2] if not isinstance(new.get(k), (dict, list)))
    name = str(quant_cfg.name)
    raise bad_value(f"{field}.name", name, f"{out_dir} was written with {was} and this run asks for {now}",
                    f"set {field}.name={name}-{suffix or 'v2'} to keep both, or delete {out_dir} to replace it")
