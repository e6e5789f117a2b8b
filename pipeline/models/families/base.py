"""The drafter-family registry: `DrafterFamily` (what every family answers) and `register`, `get`, `family_of`.

A family is one drafter algorithm (DFlash, DFlash2, ...) as specquant reads, quantizes, checks, serves and publishes
it. Code outside `pipeline/models/` never asks "is this DFlash2?": it asks the family of the checkpoint
(`family_of(config)`, or `pipeline.models.checkpoint_info.CheckpointInfo.read(path).family`) for the behaviour.

Detection: families are asked newest-registered first, and the first whose `detects(config)` says yes is the
family; a family that extends another (DFlash2 extends DFlash) registers after it, so it is asked first. Nothing
here imports torch: the config and model classes are imported when asked for.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pipeline.core.errors import bad_value
from pipeline.models import layout

SERVE_MODES = ("engine", "load-and-probe")
Shapes = dict[str, tuple[int, ...]]


def field(config: Any, key: str, default=None):
    """`key` of a config.json dict or of a parsed config (`layout.light_config`, `DFlashConfig`)."""
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def num_draft_layers(config: Any) -> int:
    """The draft layer count of a config (a parsed config's, or a speculators config.json's, which keeps it in
    `transformer_layer_config`)."""
    tlc = field(config, "transformer_layer_config") or {}
    return int(field(config, "num_hidden_layers") or field(tlc, "num_hidden_layers") or 0)


class DrafterFamily:
    """What a drafter family answers; each registered family is one instance of a subclass.

    Class attributes every family sets: `name` (registry key, lower case), `card_name` (the model card's word),
    `vllm_method` (`speculative_config.method`), `serve_mode` (one of `SERVE_MODES`: serve-check runs the drafter
    in a vLLM engine, or builds vLLM's model class, loads the checkpoint and probes one draft block), `formats`
    (the checkpoint layouts it is read and written in, `layout.FORMATS`), `head_trim_refusal`."""

    name: ClassVar[str]
    card_name: ClassVar[str]
    vllm_method: ClassVar[str] = "dflash"
    serve_mode: ClassVar[str] = "engine"
    formats: ClassVar[tuple[str, ...]] = layout.FORMATS
    # why `convert --draft-vocab` cannot trim this family's head (None: it can), a clause after "it is a <card_name>
    # drafter, "
    head_trim_refusal: ClassVar[str | None] = None
    # the Linears vLLM builds outside the draft layers, by HF name (vLLM's adds `model.`): `contract.serving_ignore`
    # writes an exact one under both names, `contract.hf_shards` maps it back
    outer_linears: ClassVar[tuple[str, ...]] = ("fc",)
    # vLLM's class of this family serves each draft layer with its own sliding window, non-causally as written,
    # where the range lets `transformer_layer_config.is_causal: false` decide (else one causality flag for every
    # layer: `contract.checkpoint_problems` refuses sliding-window layers)
    own_windows: ClassVar[bool] = False

    # ---------------------------------------------------------------- reading a checkpoint
    def detects(self, config: Any) -> bool:
        """Whether `config` (a config.json dict or a parsed drafter config) is a drafter of this family."""
        raise NotImplementedError

    def validate(self, config: Any, tensors: Shapes | None = None) -> None:
        """Every field of a drafter config against the others and the safetensors headers (`tensors`: {name:
        shape}), one sentence per bad field (`pipeline.models.validation`)."""
        raise NotImplementedError

    def check_target(self, config: Any, target_config: Any) -> None:
        """What the family adds to `compat.check_compatible` (a drafter `config` against its target's config, from
        configs alone), one sentence per misfit."""

    def config_class(self) -> type:
        """The transformers config class of the family's drafters (imports torch)."""
        raise NotImplementedError

    def model_class(self) -> type:
        """The torch module class of the family's drafters (imports torch)."""
        raise NotImplementedError

    def read_config(self, path, fmt: str = "auto"):
        """The drafter config of the checkpoint folder `path` (imports torch)."""
        raise NotImplementedError

    def config_dict(self, config, fmt: str) -> dict:
        """config.json of `config` written in layout `fmt` (one of `formats`)."""
        raise NotImplementedError

    def save(self, model, out_dir, fmt: str):
        """Write `model` (the drafter's own tensors and config.json) to `out_dir` in layout `fmt`."""
        raise NotImplementedError

    def calibration_batch(self, samples: list[dict], anchors_per_sequence: int, block_size: int,
                          mask_token_id: int, generator) -> dict:
        """One calibration batch of cached samples for the family's calibration forward."""
        raise NotImplementedError

    # ---------------------------------------------------------------- quantizing it
    def dense_linears(self, config) -> list[str]:
        """The Linears (exact HF names) quantize-drafter keeps dense beside the scheme's ignore list."""
        return []

    def check_settings(self, q, config, field_name: str) -> None:
        """Quantization settings (`q`: the `quant` group) this family's drafter `config` cannot take, refused in one
        sentence before any weight is read."""

    def check_notes(self, config) -> dict[str, Any]:
        """Entries the family adds to quantize-drafter's record of its check (what the top-1 numbers compare)."""
        return {}

    # ---------------------------------------------------------------- serving it
    def refuse_profile(self, prof, field_name: str) -> None:
        """A vLLM range (a `pipeline.serving.contract.Profile`) that cannot serve this family, refused in one
        sentence before any work."""

    def profile_problems(self, prof) -> list[str]:
        """Why the range `prof` cannot build this family's drafters, as `contract.checkpoint_problems` words it
        (empty: it can); `refuse_profile` is the same fact as a settings refusal."""
        return []

    def range_cites(self, prof) -> dict[str, str]:
        """The wheel file:line of this family's own rules in the range `prof`, by the module name each pins
        (`kernel_projection`, ...): what `contract` cites beside `prof.cites`."""
        return {}

    def vllm_record(self, prof) -> dict[str, Any]:
        """The stage record's `vllm` entry of a checkpoint of this family written for the range `prof`."""
        return prof.record()

    def recorded_versions(self, record: dict[str, Any]) -> str | None:
        """The releases a `vllm_record` entry says serve this family's checkpoints, where narrower than the range's
        own `versions` (the card names them); None: the range's."""
        return None

    def vllm_linears(self, config: Any, num_target_layers: int) -> list[str]:
        """Every Linear vLLM builds for a drafter `config` (a speculators config.json dict or a parsed config),
        under vLLM's names: `model.fc`, each draft layer's (`vllm_layer_linears`; draft layer i is
        `model.layers.{i + num_target_layers}`), then the family's others (`vllm_extra_linears`)."""
        names = ["model.fc"]
        for i in range(num_draft_layers(config)):
            names += self.vllm_layer_linears(config, f"model.layers.{i + num_target_layers}")
        return names + self.vllm_extra_linears(config)

    def vllm_layer_linears(self, config: Any, prefix: str) -> list[str]:
        """The Linears of one draft layer named `prefix` (fused as vLLM builds them)."""
        return [f"{prefix}.self_attn.qkv_proj", f"{prefix}.self_attn.o_proj", f"{prefix}.mlp.gate_up_proj",
                f"{prefix}.mlp.down_proj"]

    def vllm_extra_linears(self, config: Any) -> list[str]:
        """The family's Linears outside the draft layers, after them (beside `model.fc`)."""
        return []

    def vllm_quantized_linears(self, config: Any, num_target_layers: int, prof) -> list[str]:
        """The Linears of `vllm_linears` that the range `prof` builds with the draft's quant config (each one
        quantized unless the checkpoint's `ignore` names it); the others it builds dense whatever is stored."""
        return self.vllm_linears(config, num_target_layers)

    def vllm_parameters(self, config: Any, num_target_layers: int) -> list[str]:
        """The bare Parameters (no Linear, no quant method) vLLM's class holds beside `vllm_linears`, by runtime
        name: what a load-and-probe expects untouched (`contract.load_probe_modules`)."""
        return []

    # ---------------------------------------------------------------- publishing it
    def card_lines(self) -> list[str]:
        """The model card's Quantization bullets this family adds (what it keeps dense beside `ignore`)."""
        return []

    def __repr__(self) -> str:
        return f"<drafter family {self.name}>"


_REGISTRY: dict[str, DrafterFamily] = {}


def register(family: DrafterFamily) -> DrafterFamily:
    """Add `family` to the registry (asked before every family registered earlier); returns it."""
    if not isinstance(family, DrafterFamily):
        raise TypeError(f"{family!r} is not a DrafterFamily")
    if family.name in _REGISTRY:
        raise ValueError(f"a drafter family named {family.name!r} is already registered")
    if family.serve_mode not in SERVE_MODES:
        raise ValueError(f"drafter family {family.name!r}: serve_mode {family.serve_mode!r} is not one of "
                         f"{', '.join(SERVE_MODES)}")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove the family called `name` (a test's own family, registered for one test)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered families' names, in registration order."""
    return tuple(_REGISTRY)


def families() -> tuple[DrafterFamily, ...]:
    """The registered families, in registration order."""
    return tuple(_REGISTRY.values())


def get(name: str, field_name: str = "drafter.family") -> DrafterFamily:
    """The family called `name`; an unknown name is one sentence naming the registered ones."""
    if name not in _REGISTRY:
        raise bad_value(field_name, name, "it is not a registered drafter family",
                        f"use one of {', '.join(_REGISTRY)} (pipeline/models/families/)")
    return _REGISTRY[name]


def find(config: Any) -> DrafterFamily | None:
    """The family of `config` (a config.json dict or a parsed drafter config), newest-registered asked first;
    None when no family detects it."""
    for fam in reversed(list(_REGISTRY.values())):
        if fam.detects(config):
            return fam
    return None


def family_of(config: Any, path: str = "", field_name: str = "drafter.path") -> DrafterFamily:
    """The family of `config` (a config.json dict or a parsed drafter config); a config no family detects is one
    sentence naming `path` and the registered families."""
    fam = find(config)
    if fam is None:
        raise bad_value(field_name, path or "config.json", "its config.json is no drafter of a registered family "
                        f"({', '.join(_REGISTRY)})", "point it at a DFlash or DFlash2 drafter checkpoint")
    return fam

