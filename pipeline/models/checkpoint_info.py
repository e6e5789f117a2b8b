"""`CheckpointInfo`: the facts of a checkpoint folder, read once from its config.json, without torch.

    info = CheckpointInfo.read(path)        # a drafter (any family, any layout) or a target
    info.kind, info.family, info.format      # "drafter" / "target"; "dflash2" / "qwen3_5"; "speculators" / "hf"
    info.scheme, info.weight_only, info.fp4_activation, info.quantized, info.ignore
    info.architectures, info.num_layers, info.num_target_layers
    info.block_size, info.verifier              # a drafter's block size and the target its config names
    info.drafter_family                      # the registered DrafterFamily (pipeline.models.families)

`scheme` is the name `pipeline.quant.recipes.SCHEMES` gives the checkpoint's quantization (nvfp4, nvfp4a16, w4a16,
fp8, fp8-dynamic, fp8-block), read off its first config group (`scheme_of`: the one parser of a
`quantization_config`; `tests/test_families.py` checks it against every preset); None for a dense checkpoint or
a quantization no preset writes. A speculators drafter's `quantization_config` is the one inside
`transformer_layer_config` (what vLLM reads; specquant writes the same dict at the top level too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.io import read_json
from pipeline.models import families, layout, targets

# FP8 weights' strategy -> recipes scheme (FP8: per-tensor, FP8_DYNAMIC: per-channel, FP8_BLOCK: 128x128 blocks)
FP8_SCHEMES = {"tensor": "fp8", "channel": "fp8-dynamic", "block": "fp8-block"}


def _args(group: dict, key: str) -> dict | None:
    """A config group's weights / input_activations with compressed-tensors' defaults filled in (int, 8 bits; the
    strategy its validator infers when unset)."""
    a = group.get(key)
    if not a:
        return None
    strategy = a.get("strategy") or ("block" if a.get("block_structure") else
                                     "group" if a.get("group_size") else "tensor")
    return {"type": str(a.get("type") or "int"), "num_bits": int(a.get("num_bits") or 8), "strategy": str(strategy)}


def groups_of(quantization_config: dict | None) -> list[dict]:
    """The config groups of a `quantization_config` (raw config.json, or `fakequant.describe`'s `groups`)."""
    q = quantization_config or {}
    return list((q.get("config_groups") or q.get("groups") or {}).values())


def scheme_of(quantization_config: dict | None) -> str | None:
    """The recipes scheme name a `quantization_config` amounts to (its first config group), or None (dense, or
    nothing a preset writes)."""
    groups = groups_of(quantization_config)
    if not groups:
        return None
    w, a = _args(groups[0], "weights") or {}, _args(groups[0], "input_activations")
    if w.get("type") == "float" and w.get("num_bits") == 4:
        return "nvfp4" if a else "nvfp4a16"
    if w.get("type") == "int" and w.get("num_bits") == 4 and not a:
        return "w4a16"
    if w.get("type") == "float" and w.get("num_bits") == 8 and a:  # FP8 W8A8 (issue 45)
        return FP8_SCHEMES.get(w.get("strategy"))
    return None


def weight_format(quantization_config: dict | None) -> str | None:
    """`fp4`, `int4`, `fp8`, ... of the first config group's weights (recipes' `Scheme.number_format`), or None."""
    groups = groups_of(quantization_config)
    w = _args(groups[0], "weights") if groups else None
    return f"{'fp' if w['type'] == 'float' else 'int'}{w['num_bits']}" if w else None


def weight_only(quantization_config: dict | None) -> bool:
    """Whether a `quantization_config` quantizes weights alone (some config group, none with input activations)."""
    groups = groups_of(quantization_config)
    return bool(groups) and not any(_args(g, "input_activations") for g in groups)


def fp4_activations(quantization_config: dict | None) -> bool:
    """Whether some config group quantizes input activations to FP4 (NVFP4 W4A4)."""
    return any((a := _args(g, "input_activations")) is not None and a["type"] == "float" and a["num_bits"] == 4
               for g in groups_of(quantization_config))


def drafter_quantization(config: dict) -> dict | None:
    """A drafter config.json's `quantization_config`: inside `transformer_layer_config` first (what vLLM reads)."""
    return (config.get("transformer_layer_config") or {}).get("quantization_config") or \
        config.get("quantization_config")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint is, from its config.json alone (see the module docstring)."""

    path: str
    kind: str  # "drafter" or "target"
    family: str  # a drafter family's name (`families.names()`) or a target family's (`targets.FAMILIES`)
    format: str  # a drafter's layout (`layout.FORMATS`); "hf" for a target
    architectures: tuple[str, ...]
    num_layers: int | None  # draft layers, or the target's decoder layers
    num_target_layers: int | None  # the target layer count a drafter's config records (None: not recorded)
    quantized: bool
    scheme: str | None  # recipes vocabulary; None: dense, or no preset's quantization
    weight_format: str | None  # fp4 / int4 / fp8 (None: dense)
    weight_only: bool  # quantized weights, dense activations
    fp4_activation: bool  # activations quantized to FP4 (NVFP4 W4A4)
    ignore: tuple[str, ...] = ()
    # tokens a drafter proposes per step + 1 (speculators: top level; z-lab: `dflash_config`); None for a target
    block_size: int | None = None
    # the target a speculators drafter names (`speculators_config.verifier.name_or_path`); None when it names none
    verifier: str | None = None
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the config.json read

    @property
    def drafter_family(self) -> families.DrafterFamily:
        """The registered family of a drafter checkpoint."""
        if self.kind != "drafter":
            raise bad_value("checkpoint", self.path, f"it is a {self.family} target, not a drafter",
                            "point it at a drafter checkpoint")
        return families.get(self.family)

    @property
    def quantization_config(self) -> dict | None:
        """The `quantization_config` the checkpoint is served with (None: dense)."""
        return drafter_quantization(self.config) if self.kind == "drafter" else self.config.get("quantization_config")

    @classmethod
    def read(cls, path: str | Path, field_name: str = "checkpoint") -> CheckpointInfo:
        """The facts of the checkpoint folder `path`; a folder without a readable config.json is one sentence
        naming `field_name`."""
        p = Path(path)
        if not (p / "config.json").is_file():
            raise bad_value(field_name, str(path), "it has no config.json", "point it at a checkpoint directory")
        config = read_json(p / "config.json", field_name)
        if not isinstance(config, dict):
            raise bad_value(field_name, str(path), "its config.json is not a JSON object",
                            "re-export the checkpoint")
        return cls.from_config(config, str(path))

    @classmethod
    def from_config(cls, config: dict, path: str = "") -> CheckpointInfo:
        """The facts of a config.json already read (`path` only names it)."""
        fam = families.find(config)
        if fam is not None:
            fmt = layout.detect_format(config, path)
            tlc = config.get("transformer_layer_config") or {}
            n = config.get("num_hidden_layers", tlc.get("num_hidden_layers"))
            n_target = config.get("num_target_layers", tlc.get("num_target_layers"))
            kind, family, qc = "drafter", fam.name, drafter_quantization(config)
            block = config.get("block_size") or (config.get("dflash_config") or {}).get("block_size")
            verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        else:
            fmt, kind, family, qc = "hf", "target", targets.family_of(config).name, config.get("quantization_config")
            n, n_target = targets.text_config(config).get("num_hidden_layers"), None
            block = verifier = None
        groups = groups_of(qc)
        return cls(path=path, kind=kind, family=family, format=fmt,
                   architectures=tuple(config.get("architectures") or ()),
                   num_layers=int(n) if n is not None else None,
                   num_target_layers=int(n_target) if n_target is not None else None,
                   quantized=bool(groups), scheme=scheme_of(qc), weight_format=weight_format(qc),
                   weight_only=weight_only(qc),
                   fp4_activation=fp4_activations(qc), ignore=tuple((qc or {}).get("ignore") or ()),
                   block_size=int(block) if block else None, verifier=verifier, config=config)
