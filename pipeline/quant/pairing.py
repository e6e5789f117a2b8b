"""The served pair: which target's hidden states a drafter was calibrated on, and whether a pairing matches.

A drafter reads the hidden states of the target served beside it, and a quantized target's states
differ from the bf16 target's. quantize-drafter records the target its calibration cache came from
(`calibration_record`: variant, files sha256, Hub id when known, shape). evaluate, serve-check and
publish compare it with the target they pair the drafter with (`check_pair`):

- another checkpoint of the same shape -> a one-sentence warning (the pair is measured, but the
  drafter was calibrated for the other target);
- another vocab size, hidden size or layer count -> a refusal, before any weight is loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value

REFERENCE = "bf16"
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers")


def calibration_record(cfg, index: dict, used: bool) -> dict[str, Any]:
    """What quantize-drafter writes into its record: the target behind the cache it read."""
    variant = str(index.get("target_variant") or REFERENCE)
    target = (index.get("inputs") or {}).get("target") or {}
    from pipeline.core.hub import hub_id  # the one rule for "this names a Hub repo"

    hub = (cfg.publish.target_model or hub_id(cfg.target.path)) if variant == REFERENCE else None
    return {"variant": variant, "used": bool(used), "files_sha256": target.get("files_sha256"),
            "path": index.get("target_path"), "hub_id": hub, "shape": index.get("target_shape"),
            "cache_content_hash": index.get("content_hash")}


def drafter_record(rd, variant: str) -> dict[str, Any] | None:
    """The calibration target a drafter variant's stage record names (None: no record, e.g. bf16)."""
    from pipeline.artifacts.stage_record import load_record

    rec = load_record(rd.root, f"quantize-drafter-{variant}")
    return rec.result.get("calibration_target") if rec else None


def target_identity(path: str | Path, variant: str, revision: str | None = None,
                    trust_remote_code: bool = False, hashed: bool = True) -> dict[str, Any]:
    """The served target: variant name, files sha256 (the cache stage's rule; `hashed=False`: None) and
    shape, from its files."""
    from pipeline.core.io import dumps_json, sha256_text
    from pipeline.core.loading import checkpoint_hashes, load_config

    files = (checkpoint_hashes(path, revision) or {}) if hashed else {}
    from pipeline.models.targets import text_config

    conf = text_config(load_config(str(path), revision, trust_remote_code, "target.path"))
    return {"variant": variant, "path": str(path),
            "files_sha256": sha256_text(dumps_json({rel: e["sha256"] for rel, e in files.items()})) if files else None,
            "shape": {k: int(getattr(conf, k)) for k in SHAPE_KEYS if getattr(conf, k, None) is not None}}


def check_shape(variant: str, record: dict | None, served: dict) -> None:
    """Refuse a drafter calibrated against a target of another vocab size, hidden size or depth."""
    if not record:
        return
    shape, have = record.get("shape") or {}, served.get("shape") or {}
    diff = [k for k in SHAPE_KEYS if k in shape and k in have and shape[k] != have[k]]
    if diff:
        k = diff[0]
        raise bad_value(f"drafter/{variant}", variant, f"it was calibrated against target `{record['variant']}` "
                        f"with {k}={shape[k]}, but is paired with target `{served['variant']}` "
                        f"({served['path']}) with {k}={have[k]}",
                        "pair it with the target it was made for, or re-run cache and quantize-drafter "
                        "for this target")


def check_pair(variant: str, record: dict | None, served: dict) -> str | None:
    """Refuse a drafter calibrated against a target of another shape; the warning sentence (or None)
    for one calibrated against another checkpoint of the same shape."""
    if not record:
        return None
    check_shape(variant, record, served)
    if not record.get("used") or not record.get("files_sha256") or record["files_sha256"] == served.get("files_sha256"):
        return None
    return (f"drafter `{variant}` was calibrated on the hidden states of target `{record['variant']}` "
            f"(files {record['files_sha256'][:12]}) but is paired here with target `{served['variant']}` "
            f"(files {(served.get('files_sha256') or 'unknown')[:12]}); the pair is measured as served, but "
            f"quant.calibration_target={served['variant']} would calibrate a drafter for this target")


def warn(sentence: str | None, stage: str) -> None:
    if sentence:
        print(f"warning: {stage}: {sentence}", file=sys.stderr)


def check_pairs(rd, drafters: list[str], served: dict, stage: str) -> dict[str, str]:
    """check_pair for each drafter against one served target; prints each warning once, returns them."""
    out = {}
    for v in drafters:
        sentence = check_pair(v, drafter_record(rd, v), served)
        if sentence:
            warn(sentence, stage)
            out[v] = sentence
    return out


def calibration_target_name(cfg, record: dict | None) -> str | None:
    """The name a drafter calibrated on a quantized target variant is published for (its config's verifier,
    its card's target): `publish.quantized_target_models[<variant>]` when configured (a Hub id), else that
    variant's folder in the run (`<run_dir>/target/<variant>`, relative as run_dir is: where the serving
    commands run from). None for a drafter calibrated on the bf16 target (or on none): it names
    `publish.target_model` / `target.path` as before."""
    t = (record or {}).get("variant")
    if not record or not record.get("used") or not t or t == REFERENCE:
        return None
    configured = dict(cfg.publish.get("quantized_target_models") or {})
    return str(configured.get(t) or Path(str(cfg.run_dir)) / "target" / str(t))


def base_variant(variant: str, record: dict | None) -> str | None:
    """`w4a16-gptq` for `w4a16-gptq-on-w4a16` (calibrated on target w4a16): the same recipe on bf16 states."""
    from pipeline.core.config import PAIR_SUFFIX

    t = (record or {}).get("variant")
    suffix = f"{PAIR_SUFFIX}{t}"
    if not t or t == REFERENCE or not variant.endswith(suffix):
        return None
    return variant[: -len(suffix)]


PAIRINGS = ("calibrated", "all")


def pairs_for(rd, targets: list[str], drafters: list[str], mode: str, primary: str = REFERENCE,
              every_target: list[str] | tuple[str, ...] = ()) -> dict[str, list[str]]:
    """{target: the drafters paired with it}, in `drafters`' order. `all`: every drafter on every target.
    `calibrated`: the primary target pairs every drafter; another target pairs the drafters calibrated on its
    hidden states (`<quant>-on-<target>`), the bf16-calibrated recipe of each (the mismatched pair beside it),
    the bf16 drafter and the drafters matching an `every_target` glob, or every drafter when none was
    calibrated on it. One rule for evaluate (`eval.pairs`) and serve-check (`serve.pairs`)."""
    from fnmatch import fnmatchcase

    if mode == "all":
        return {t: list(drafters) for t in targets}
    others = [t for t in targets if t not in (primary, REFERENCE)]
    # each stage record read once, not once per target; none when every target is the primary
    recs = {v: drafter_record(rd, v) for v in drafters} if others and rd is not None else {}
    everywhere = {v for v in drafters if any(fnmatchcase(v, str(p)) for p in every_target)} | {REFERENCE}
    out = {}
    for t in targets:
        mine = [v for v, r in recs.items() if t in others and r is not None and r.get("variant") == t]
        keep = set(mine) | {base_variant(v, recs[v]) for v in mine} | everywhere
        out[t] = [v for v in drafters if v in keep] if mine else list(drafters)
    return out
