"""The building blocks of the config validators (`pipeline.models.validation` for targets, each drafter family's
own in `pipeline.models.families`): a checkpoint's tensor shapes from its safetensors headers (`tensor_shapes`, no
weight read) and the field checks every validator shares. Nothing here imports torch."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value

Shapes = dict[str, tuple[int, ...]]
DRAFTER_LAYER_KINDS = ("full_attention", "sliding_attention")
DENSE_LAYER_KINDS = ("full_attention", "sliding_attention")
HYBRID_LAYER_KINDS = ("full_attention", "linear_attention")
LEGACY_HYBRID_KINDS = {"attention": "full_attention", "mamba": "linear_attention"}  # transformers' remap
MAX_HEADER_BYTES = 100 << 20


# ---------------------------------------------------------------- the checkpoint's tensors, from headers only
def tensor_shapes(path: str | Path) -> Shapes | None:
    """{tensor name: shape} over every *.safetensors file of a directory, from the headers (8-byte length +
    JSON) alone; None when there is none or a header cannot be read (`pipeline.core.loading` names those)."""
    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    out: Shapes = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if not 0 < n <= MAX_HEADER_BYTES:
                    return None
                header = json.loads(fh.read(n))
            for name, entry in header.items():
                if name != "__metadata__":
                    out[name] = tuple(int(x) for x in entry["shape"])
        except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
            return None
    return out


def get(cfg: Any, key: str, default=None):
    """`key` of a config.json dict or of a parsed config object."""
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def positive(cfg, key: str, where: str, fix: str) -> int:
    """Field `key` of `cfg`, refused in one sentence (`<where>.<key>`) unless a positive integer."""
    v = get(cfg, key)
    if not is_int(v) or v < 1:
        raise bad_value(f"{where}.{key}", v, "it must be a positive integer", fix)
    return v


def layer_ids(tensors: Shapes, prefix: str) -> list[int]:
    """The layer indices that tensors named `<prefix>layers.<i>.` carry, sorted."""
    pat = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    return sorted({int(m.group(1)) for name in tensors if (m := pat.match(name))})


def rows(tensors: Shapes | None, name: str) -> int | None:
    """The first dimension of tensor `name` (None: not stored, or no headers)."""
    shape = (tensors or {}).get(name)
    return shape[0] if shape else None


def layer_kinds(where: str, kinds, n: int, allowed: tuple[str, ...], fix: str) -> list[str]:
    """`layer_types` checked: a list of `n` names, each in `allowed` (one sentence naming the first bad entry)."""
    if not isinstance(kinds, list | tuple) or not all(isinstance(k, str) for k in kinds):
        raise bad_value(f"{where}.layer_types", kinds, "it is not a list of layer type names", fix)
    if len(kinds) != n:
        raise bad_value(f"{where}.layer_types", list(kinds), f"it has {len(kinds)} entr{'y' if len(kinds) == 1 else 'ies'} but num_hidden_layers is "
                        f"{n} (one entry per decoder layer)", fix)
    other = [i for i, k in enumerate(kinds) if k not in allowed]
    if other:
        raise bad_value(f"{where}.layer_types", list(kinds), f"entry {other[0]} ({kinds[other[0]]!r}) is not one of "
                        f"{', '.join(allowed)}", fix)
    return list(kinds)


def sliding_window(cfg, where: str, kinds: list[str], fix: str) -> None:
    """A positive `sliding_window` wherever a layer (or `use_sliding_window`) slides."""
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    window = get(cfg, "sliding_window")
    if (sliding or get(cfg, "use_sliding_window") is True) and (not is_int(window) or window < 1):
        which = f"layers {sliding} are sliding_attention layers" if sliding else "use_sliding_window is true"
        raise bad_value(f"{where}.sliding_window", window, f"{which} and need a positive window size", fix)

