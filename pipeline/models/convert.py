"""`python -m pipeline convert --to {zlab,speculators,native} SRC DST`: re-label a DFlash checkpoint.

Only config.json changes between formats (plus the explicit layer-id shift, see
`pipeline.models.formats`); the tensors are copied bit for bit. No target is needed, except that a
speculators checkpoint must name its verifier (`--verifier`, stored as given; we write paths
relative to the drafter directory, e.g. `../target`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.core.errors import bad_value


def check_empty_target(dst: Path) -> None:
    """DST must be new or an empty directory: a converted checkpoint never mixes with other files."""
    if dst.exists() and not dst.is_dir():
        raise bad_value("DST", str(dst), "it is a file, not a directory", "give a new or empty directory")
    if dst.is_dir():
        held = sorted(p.name for p in dst.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise bad_value("DST", str(dst), f"the directory is not empty (it holds {shown})",
                            "convert into a new or empty directory, or empty this one first")


def convert(src: str | Path, dst: str | Path, to: str, verifier: str | None = None,
            verifier_architectures: list[str] | None = None) -> Path:
    from pipeline.core.io import read_json
    from pipeline.models.formats import (
        FORMATS,
        check_tensors,
        config_dict_for,
        load_drafter_config,
        read_tensors,
        write_checkpoint,
    )

    if to not in FORMATS:
        raise bad_value("--to", to, "unknown drafter format", f"use one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise bad_value("DST", str(dst), "it is the source directory", "write the converted checkpoint elsewhere")
    check_empty_target(dst)
    cfg = load_drafter_config(src)
    if verifier is not None:
        cfg.verifier_name_or_path = verifier
        vdir = Path(verifier) if Path(verifier).is_absolute() else dst / verifier
        if verifier_architectures is None and (vdir / "config.json").is_file():
            verifier_architectures = read_json(vdir / "config.json").get("architectures")
    if verifier_architectures is not None:
        cfg.verifier_architectures = list(verifier_architectures)
    tensors = read_tensors(src)
    check_tensors(cfg, tensors, str(src))
    config = config_dict_for(cfg, to)  # fails (one sentence) before anything is written
    return write_checkpoint(tensors, config, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline convert", description=__doc__.splitlines()[0])
    ap.add_argument("--to", required=True, choices=["zlab", "speculators", "native"])
    ap.add_argument("--verifier", default=None, help="speculators verifier name_or_path (target path or Hub id)")
    ap.add_argument("--verifier-arch", action="append", default=None, help="e.g. Qwen3ForCausalLM")
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    out = convert(args.src, args.dst, args.to, args.verifier, args.verifier_arch)
    print(f"wrote {args.to} drafter to {out}")
    return 0
