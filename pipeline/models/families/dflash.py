"""DFlash (z-lab's block drafter, speculators `dflash`): the base drafter family.

Its config and model are `pipeline.models.dflash` (`DFlashConfig`, `DFlashDrafter`), its formats z-lab,
speculators and native (`pipeline.models.layout` reads them without torch, `pipeline.models.formats` writes them),
its calibration batches `pipeline.models.calibration.build_calibration_batch`. vLLM serves it with
`speculative_config.method: dflash` in an engine; every Linear it builds takes the draft's quant config.
"""

from __future__ import annotations

from typing import Any

from pipeline.core.errors import bad_value
from pipeline.models import layout
from pipeline.models.families.base import DrafterFamily, Shapes, field, register
from pipeline.models.fields import DRAFTER_LAYER_KINDS
from pipeline.models.fields import get as _get
from pipeline.models.fields import is_int as _is_int
from pipeline.models.fields import layer_ids as _layer_ids
from pipeline.models.fields import layer_kinds as _layer_kinds
from pipeline.models.fields import positive as _positive
from pipeline.models.fields import rows as _rows


def validate_dflash_config(cfg, tensors: Shapes | None = None) -> None:
    """A DFlash drafter's fields against each other and its checkpoint's tensors (`tensors`: {name: shape})."""
    err = bad_value
    fix = "use a drafter exported with a consistent config.json (or fix that field)"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _positive(cfg, key, "drafter", fix)
    bs = _get(cfg, "block_size")
    if not _is_int(bs) or bs < 2:  # the sentence test_bad_inputs and test_dflash2 know
        raise err("block_size", bs, "a DFlash block holds the bonus token plus at least one mask token",
                  "use block_size >= 2 (z-lab drafters use 16)")
    heads, kv, hd = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads"), _get(cfg, "head_dim")
    kv = heads if kv is None else kv  # DFlashConfig's defaults
    hd = _get(cfg, "hidden_size") // heads if hd is None else hd
    if not _is_int(kv) or kv < 1 or heads % kv:
        raise err("num_attention_heads", heads, f"it is not a multiple of num_key_value_heads={kv}",
                  "fix the drafter config's head counts")
    if not _is_int(hd) or hd < 1 or hd % 2:
        raise err("head_dim", hd, "RoPE needs an even, positive head dimension", "fix the drafter config's head_dim")
    n, vocab = _get(cfg, "num_hidden_layers"), _get(cfg, "vocab_size")
    kinds = _get(cfg, "layer_types")
    if kinds is not None:
        kinds = list(kinds) if isinstance(kinds, list | tuple) else kinds
        other = [i for i, t in enumerate(kinds) if t not in DRAFTER_LAYER_KINDS] if isinstance(kinds, list) else []
        if other:  # the sentence this had before issue 47
            raise err("drafter.layer_types", kinds, f"layers {other} are neither full_attention nor "
                      "sliding_attention, which this drafter implementation does not support",
                      "use a drafter with attention layers only")
        kinds = _layer_kinds("drafter", kinds, n, DRAFTER_LAYER_KINDS,
                             f"give one full_attention or sliding_attention entry per draft layer ({n})")
        window = _get(cfg, "sliding_window")
        sliding = [i for i, t in enumerate(kinds) if t == "sliding_attention"]
        if sliding and (not _is_int(window) or window < 1):
            raise err("drafter.sliding_window", window, f"layers {sliding} are sliding_attention layers and need a "
                      "positive window size", "set the drafter config's sliding_window (z-lab's DFlash2 drafters "
                      "use 2048)")
    mid = _get(cfg, "mask_token_id")
    if not _is_int(mid) or not 0 <= mid < vocab:
        raise err("drafter.mask_token_id", mid, f"it is not a token id of the {vocab}-token vocabulary",
                  "set the drafter's mask_token_id to the tokenizer's mask token")
    ids = _get(cfg, "aux_layer_ids")
    if not ids or not all(_is_int(m) for m in ids):
        raise err("drafter.aux_layer_ids", ids, "a DFlash drafter needs a list of target layer ids",
                  "set the aux layers (z-lab target_layer_ids / speculators aux_hidden_state_layer_ids)")
    if len(set(ids)) != len(ids):
        raise err("drafter.aux_layer_ids", list(ids), "it repeats a layer", "list each aux layer once")
    if tensors is not None:
        _against_tensors(cfg, tensors, heads, kv, hd, ids)


def _against_tensors(cfg, tensors: Shapes, heads: int, kv: int, hd: int, ids: list[int]) -> None:
    """`validate_dflash_config`'s second half: each field against the tensor shape that follows from it."""
    err = bad_value
    n, h, trimmed = _get(cfg, "num_hidden_layers"), _get(cfg, "hidden_size"), _get(cfg, "draft_vocab_size")
    norm = tensors.get("norm.weight")
    if norm and norm[0] != h:
        raise err("drafter.hidden_size", h, f"the checkpoint's norm.weight has {norm[0]} channels",
                  f"set hidden_size to {norm[0]} (the drafter's width)")
    layers = _layer_ids(tensors, "")
    if layers and layers[-1] + 1 != n:
        raise err("drafter.num_hidden_layers", n, f"the checkpoint holds {layers[-1] + 1} draft layers "
                  f"(layers.0 .. layers.{layers[-1]})", f"set num_hidden_layers to {layers[-1] + 1}")
    head_norm = tensors.get("layers.0.self_attn.q_norm.weight")
    if head_norm and head_norm[0] != hd:
        raise err("drafter.head_dim", hd, f"the checkpoint's per-head q_norm has {head_norm[0]} dimensions",
                  f"set head_dim to {head_norm[0]}")
    for proj, key, count in (("q_proj", "num_attention_heads", heads), ("k_proj", "num_key_value_heads", kv)):
        rows = _rows(tensors, f"layers.0.self_attn.{proj}.weight")
        if rows is not None and rows != count * hd:
            right = f"set {key} to {rows // hd}" if rows % hd == 0 else "use the config the drafter was exported with"
            raise err(f"drafter.{key}", count, f"the checkpoint's {proj} has {rows} rows, not {key} x head_dim = "
                      f"{count} x {hd}", right)
    rows = _rows(tensors, "layers.0.mlp.gate_proj.weight")
    if rows is not None and rows != _get(cfg, "intermediate_size"):
        raise err("drafter.intermediate_size", _get(cfg, "intermediate_size"), f"the checkpoint's mlp.gate_proj "
                  f"has {rows} rows", f"set intermediate_size to {rows}")
    fc = tensors.get("fc.weight")
    width = _get(cfg, "target_hidden_size") or h
    if fc and len(fc) == 2 and fc[1] != len(ids) * width:
        if fc[1] % width == 0:
            raise err("drafter.aux_layer_ids", list(ids), f"the checkpoint's fc reads {fc[1] // width} x {width} "
                      f"target features, so the drafter was trained on {fc[1] // width} aux layers, not {len(ids)}",
                      f"list the {fc[1] // width} target layers the drafter was trained on")
        raise err("drafter.target_hidden_size", _get(cfg, "target_hidden_size"), f"the checkpoint's fc reads "
                  f"{fc[1]} features, not {len(ids)} aux layers x {width}", "use the config the drafter was "
                  "exported with")
    if trimmed is not None:
        rows = _rows(tensors, "lm_head.weight")
        if rows is not None and rows != trimmed:
            raise err("drafter.draft_vocab_size", trimmed, f"the checkpoint's own lm_head has {rows} rows",
                      f"set draft_vocab_size to {rows}")


class DFlash(DrafterFamily):
    """DFlash: Qwen3 draft layers reading the target's aux hidden states through `fc`."""

    name = "dflash"
    card_name = "DFlash"
    vllm_method = "dflash"
    serve_mode = "engine"

    def detects(self, config: Any) -> bool:
        """A config.json in any DFlash layout (speculators `dflash`, z-lab `dflash_config` / `DFlashDraftModel`,
        native `specquant_dflash`); a parsed drafter config (the layout readers make only DFlash ones) always."""
        if not isinstance(config, dict):
            return field(config, "block_size") is not None
        return (config.get("speculators_model_type") == "dflash" or config.get("model_type") == layout.MODEL_TYPE
                or "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or []))

    def validate(self, config: Any, tensors: Shapes | None = None) -> None:
        validate_dflash_config(config, tensors)

    def config_class(self) -> type:
        from pipeline.models.dflash import DFlashConfig

        return DFlashConfig

    def model_class(self) -> type:
        from pipeline.models.dflash import DFlashDrafter

        return DFlashDrafter

    def read_config(self, path, fmt: str = "auto"):
        from pipeline.models.formats import load_drafter_config

        return load_drafter_config(path, fmt)

    def config_dict(self, config, fmt: str) -> dict:
        from pipeline.models.formats import config_dict_for

        return config_dict_for(config, fmt)

    def save(self, model, out_dir, fmt: str):
        from pipeline.models import formats

        savers = {"zlab": formats.save_zlab, "speculators": formats.save_speculators, "native": formats.save_native}
        if fmt not in savers:
            raise bad_value("format", fmt, "unknown drafter format", f"use one of {', '.join(savers)}")
        return savers[fmt](model, out_dir)

    def calibration_batch(self, samples: list[dict], anchors_per_sequence: int, block_size: int,
                          mask_token_id: int, generator) -> dict:
        from pipeline.models.calibration import build_calibration_batch

        return build_calibration_batch(samples, anchors_per_sequence, block_size, mask_token_id, generator)


DFLASH = register(DFlash())
