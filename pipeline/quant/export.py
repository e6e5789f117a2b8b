"""Writing quantized checkpoints: whole directories appear atomically, byte-stable on re-runs.

A checkpoint is assembled in a sibling `.partial-*` directory (every file fsynced), then renamed
over the destination; a killed run leaves only a partial directory that the next run removes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from pipeline.io import atomic_write_json, hash_tree

PARTIAL_PREFIX = ".partial-"
# files a tokenizer directory may hold; copied beside a quantized target so `vllm serve <dir>` works
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "tokenizer.model", "generation_config.json")


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    with contextlib.suppress(OSError):
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def remove_partials(parent: Path) -> None:
    if parent.is_dir():
        for p in parent.iterdir():
            if p.name.startswith(PARTIAL_PREFIX) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty sibling directory; on clean exit it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(final.parent)
    tmp = final.parent / f"{PARTIAL_PREFIX}{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f"{PARTIAL_PREFIX}{final.name}-old-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_compressed(model, out_dir: Path) -> dict:
    """Compress with compressed-tensors and save (model.safetensors, config.json, recipe.yaml).

    Uses the save_pretrained that oneshot wrapped; it re-reads config.json from
    `model.config.name_or_path`, so that directory must still exist. Returns the written config.
    """
    model.save_pretrained(str(out_dir), save_compressed=True, max_shard_size="1000GB")
    return json.loads((out_dir / "config.json").read_text(encoding="utf-8"))


def copy_tokenizer(src: str | os.PathLike, out_dir: Path) -> list[str]:
    src = Path(src)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
            copied.append(name)
    return copied


def rewrite_config(out_dir: Path, config: dict) -> None:
    """Replace config.json with canonical JSON (sorted keys) so re-runs are byte-identical."""
    atomic_write_json(out_dir / "config.json", config)


def output_hashes(out_dir: Path) -> dict[str, str]:
    return {k: v["sha256"] for k, v in hash_tree(out_dir).items()}
