"""Every config field of every drafter and target family, checked before any work (issue 47).

One validator per family, a self-contained function of (config, tensors):
- drafters (`DRAFTER_FAMILIES`, picked by `drafter_family`): `validate_dflash_config` (DFlash: layer sizes,
  layer types and sliding windows, block size, mask id, aux layers) and `validate_dflash2_config` (DFlash's
  checks, then the convolution's group and taps and the selector's rank and top-K);
- targets (`TARGET_FAMILIES`, keyed by `pipeline.models.targets.Family.name`): `validate_dense_config`
  (Qwen3/Llama-style decoders) and `validate_qwen3_5_config` (the Qwen3.5 hybrid: its `layer_types` and
  linear-attention sizes as well).
`cfg` is the config as read from config.json (a target's dict; a drafter's `layout.light_config`); `tensors` is
{name: shape} from the checkpoint's safetensors headers (`tensor_shapes`: no weight is read), or None when no
header can be read (the loaders then refuse the files in their own sentence). A field is checked against the
other fields first, then against the tensors that carry it; a tensor a checkpoint does not store under its plain
name (a compressed-tensors `weight_packed`) is not looked at. Each bad field is one `bad_value` sentence naming
the field, its value and the fix.

The stages call `check_drafter`, `check_target` and `compat.check_checkpoints` (the two, then the pair's
`compat.check_compatible`) where they first read a checkpoint, before any weight is loaded or anything is written:
cache, quantize-drafter, quantize-target, evaluate, serve-check and convert. Nothing here imports torch.
"""

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


def _get(cfg: Any, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(cfg, key: str, where: str, fix: str) -> int:
    v = _get(cfg, key)
    if not _is_int(v) or v < 1:
        raise bad_value(f"{where}.{key}", v, "it must be a positive integer", fix)
    return v


def _layer_ids(tensors: Shapes, prefix: str) -> list[int]:
    pat = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    return sorted({int(m.group(1)) for name in tensors if (m := pat.match(name))})


def _rows(tensors: Shapes | None, name: str) -> int | None:
    shape = (tensors or {}).get(name)
    return shape[0] if shape else None


def _layer_kinds(where: str, kinds, n: int, allowed: tuple[str, ...], fix: str) -> list[str]:
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


def _sliding_window(cfg, where: str, kinds: list[str], fix: str) -> None:
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    window = _get(cfg, "sliding_window")
    if (sliding or _get(cfg, "use_sliding_window") is True) and (not _is_int(window) or window < 1):
        which = f"layers {sliding} are sliding_attention layers" if sliding else "use_sliding_window is true"
        raise bad_value(f"{where}.sliding_window", window, f"{which} and need a positive window size", fix)


# ---------------------------------------------------------------- drafters
def drafter_family(cfg) -> str:
    """`dflash2` where the config sets DFlash2's convolution/selector fields, else `dflash`."""
    from pipeline.models.layout import DFLASH2_FIELDS

    return "dflash2" if any(_get(cfg, k) is not None for k in DFLASH2_FIELDS) else "dflash"


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
    n, h, vocab = _get(cfg, "num_hidden_layers"), _get(cfg, "hidden_size"), _get(cfg, "vocab_size")
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
    trimmed = _get(cfg, "draft_vocab_size")
    if tensors is None:
        return
    # ---- against the tensors: each shape names the field it follows from
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


def validate_dflash2_config(cfg, tensors: Shapes | None = None) -> None:
    """A DFlash2 drafter: DFlash's checks, then its convolution (group size vs the hidden size, taps vs the block
    size) and candidate selector (rank, top-K vs the vocabulary), against each other and the tensors."""
    validate_dflash_config(cfg, tensors)
    err = bad_value
    h, bs, vocab = _get(cfg, "hidden_size"), _get(cfg, "block_size"), _get(cfg, "vocab_size")
    taps, group = _get(cfg, "conv_kernel_size"), _get(cfg, "conv_group_size")
    rank, top_k = _get(cfg, "selector_rank"), _get(cfg, "selector_top_k")
    if not _is_int(group) or group < 1 or h % group:
        raise err("drafter.conv_group_size", group, f"it does not divide the drafter's hidden size {h} (the "
                  "convolution shares one dynamic coefficient per group of channels)",
                  f"use a conv_group_size that divides {h}")
    if not _is_int(taps) or not 1 <= taps <= bs:
        raise err("drafter.conv_kernel_size", taps, f"the convolution runs inside one {bs}-token block, so "
                  f"it needs between 1 and block_size={bs} taps", "use a drafter exported with a valid "
                  "conv_kernel_size (DFlash2 uses 2)")
    if not _is_int(rank) or rank < 1:
        raise err("drafter.selector_rank", rank, "the candidate selector needs a positive rank",
                  "use a drafter exported with its selector_rank (DFlash2 uses 256)")
    if not _is_int(top_k) or not 1 <= top_k <= vocab:
        raise err("drafter.selector_top_k", top_k, f"the selector keeps the top-K candidates of the "
                  f"{vocab}-token vocabulary, so K must be between 1 and {vocab}",
                  f"set selector_top_k to at most {vocab} (the value the drafter was trained with)")
    if tensors is None:
        return
    base = tensors.get("layers.0.attention_conv.base_kernel")
    if base and len(base) == 3 and base[1] != taps:
        raise err("drafter.conv_kernel_size", taps, f"the checkpoint's convolution kernels have {base[1]} taps "
                  f"(layers.0.attention_conv.base_kernel is {list(base)})", f"set conv_kernel_size to {base[1]}")
    rows = _rows(tensors, "layers.0.attention_conv.kernel_projection.weight")
    if rows is not None and rows != 2 * taps * (h // group):
        groups = rows // (2 * taps) if rows % (2 * taps) == 0 else None
        right = f"set conv_group_size to {h // groups}" if groups and h % groups == 0 else \
            "use the config the drafter was exported with"
        raise err("drafter.conv_group_size", group, f"the checkpoint's convolutions make {groups or '?'} dynamic "
                  f"coefficients per tap, not hidden_size / conv_group_size = {h // group}", right)
    rows = _rows(tensors, "candidate_selector.hidden_projection.weight")
    if rows is not None and rows != rank:
        raise err("drafter.selector_rank", rank, f"the checkpoint's selector projects to rank {rows}",
                  f"set selector_rank to {rows}")
    for book in ("predecessor_codebook", "successor_codebook"):
        shape = tensors.get(f"candidate_selector.{book}") or tensors.get(f"candidate_selector.{book}.weight")
        if shape and shape[0] != vocab:
            raise err("drafter.vocab_size", vocab, f"the checkpoint's selector codebooks have {shape[0]} rows "
                      "(one per token)", "use the config the drafter was exported with")


DRAFTER_FAMILIES = {"dflash": validate_dflash_config, "dflash2": validate_dflash2_config}


def validate_drafter_config(cfg, tensors: Shapes | None = None) -> None:
    """The drafter family's validator (`DRAFTER_FAMILIES`)."""
    DRAFTER_FAMILIES[drafter_family(cfg)](cfg, tensors)


# ---------------------------------------------------------------- targets
def _decoder_fields(tc, where: str) -> dict:
    """The decoder fields every family shares, each a positive integer, heads a multiple of K/V heads."""
    fix = "use the target's own config.json"
    sizes = {k: _positive(tc, k, where, fix) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                        "num_attention_heads", "intermediate_size")}
    kv = _get(tc, "num_key_value_heads")
    kv = sizes["num_attention_heads"] if kv is None else kv
    if not _is_int(kv) or kv < 1 or sizes["num_attention_heads"] % kv:
        raise bad_value(f"{where}.num_key_value_heads", kv, f"num_attention_heads={sizes['num_attention_heads']} "
                        "is not a multiple of it", fix)
    hd = _get(tc, "head_dim")
    hd = sizes["hidden_size"] // sizes["num_attention_heads"] if hd is None else hd
    if not _is_int(hd) or hd < 1:
        raise bad_value(f"{where}.head_dim", hd, "it must be a positive integer", fix)
    return {**sizes, "num_key_value_heads": kv, "head_dim": hd}


def _decoder_tensors(s: dict, tensors: Shapes, prefix: str, where: str, q_rows: int) -> None:
    """Embedding, head, layer count, norm and the first attention layer's projections against the sizes."""
    embed = tensors.get(f"{prefix}embed_tokens.weight")
    if embed and len(embed) == 2:
        if embed[0] != s["vocab_size"]:
            raise bad_value(f"{where}.vocab_size", s["vocab_size"], f"the checkpoint's embed_tokens has {embed[0]} "
                            "rows (one per token)", f"set vocab_size to {embed[0]}")
        if embed[1] != s["hidden_size"]:
            raise bad_value(f"{where}.hidden_size", s["hidden_size"], f"the checkpoint's embed_tokens is "
                            f"{embed[1]} wide", f"set hidden_size to {embed[1]}")
    layers = _layer_ids(tensors, prefix)
    n = s["num_hidden_layers"]
    if layers and layers[-1] + 1 != n:
        raise bad_value(f"{where}.num_hidden_layers", n, f"the checkpoint holds {layers[-1] + 1} decoder layers",
                        f"set num_hidden_layers to {layers[-1] + 1}")
    hd = s["head_dim"]
    for i in layers:
        q = _rows(tensors, f"{prefix}layers.{i}.self_attn.q_proj.weight")
        if q is None:
            continue
        if q != q_rows:
            raise bad_value(f"{where}.num_attention_heads", s["num_attention_heads"], f"layer {i}'s q_proj has {q} "
                            f"rows, not the {q_rows} that num_attention_heads x head_dim ({hd}) make",
                            "use the target's own config.json")
        k = _rows(tensors, f"{prefix}layers.{i}.self_attn.k_proj.weight")
        if k is not None and k != s["num_key_value_heads"] * hd:
            raise bad_value(f"{where}.num_key_value_heads", s["num_key_value_heads"], f"layer {i}'s k_proj has {k} "
                            f"rows, not num_key_value_heads x head_dim ({hd})", "use the target's own config.json")
        break
    gate = _rows(tensors, f"{prefix}layers.0.mlp.gate_proj.weight")
    if gate is not None and gate != s["intermediate_size"]:
        raise bad_value(f"{where}.intermediate_size", s["intermediate_size"], f"the checkpoint's mlp.gate_proj has "
                        f"{gate} rows", f"set intermediate_size to {gate}")


def _prefix(cfg) -> str:
    from pipeline.models.targets import tensor_names

    return tensor_names(cfg)["embed"].removesuffix("embed_tokens.weight")


def validate_dense_config(cfg, tensors: Shapes | None = None, where: str = "target") -> None:
    """A dense decoder target (Qwen3, Qwen2, Llama, Mistral): sizes, layer types and sliding window. A model type
    the family does not name (`targets.family_of` treats it as dense) has its sizes and its `layer_types`' length
    checked, not which layer kinds it names nor its tensors' layout, which its own class decides."""
    from pipeline.models.targets import DENSE, text_config

    tc = text_config(cfg)
    s = _decoder_fields(tc, where)
    known = bool({_get(cfg, "model_type"), _get(tc, "model_type")} & set(DENSE.model_types))
    kinds = _get(tc, "layer_types")
    if kinds is not None:
        allowed = DENSE_LAYER_KINDS if known else tuple(k for k in kinds if isinstance(k, str))
        kinds = _layer_kinds(where, kinds, s["num_hidden_layers"], allowed,
                             f"give one full_attention or sliding_attention entry per layer "
                             f"({s['num_hidden_layers']}), or use the target's own config.json")
    _sliding_window(tc, where, kinds or [], "set sliding_window to the target's window, or use its own config.json")
    if tensors and known:
        _decoder_tensors(s, tensors, _prefix(cfg), where, s["num_attention_heads"] * s["head_dim"])


def validate_qwen3_5_config(cfg, tensors: Shapes | None = None, where: str = "target") -> None:
    """The Qwen3.5 hybrid: the shared sizes, `layer_types` (one full_attention / linear_attention entry per layer,
    and the kind each layer's tensors are), and the Gated DeltaNet sizes against the hidden size and tensors."""
    from pipeline.models.targets import text_config

    tc = text_config(cfg)
    s = _decoder_fields(tc, where)
    n = s["num_hidden_layers"]
    kinds = _get(tc, "layer_types")
    fix = f"give one linear_attention or full_attention entry per layer ({n}), as the target was trained"
    if kinds is not None:
        if isinstance(kinds, list):
            kinds = [LEGACY_HYBRID_KINDS.get(k, k) if isinstance(k, str) else k for k in kinds]
        kinds = _layer_kinds(where, kinds, n, HYBRID_LAYER_KINDS, fix)
    else:
        every = _get(tc, "full_attention_interval", 4)
        kinds = ["full_attention" if (i + 1) % int(every) == 0 else "linear_attention" for i in range(n)]
    lin = {k: _positive(tc, k, where, "use the target's own config.json") for k in
           ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
            "linear_conv_kernel_dim")} if "linear_attention" in kinds else {}
    if lin and lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise bad_value(f"{where}.linear_num_value_heads", lin["linear_num_value_heads"], "it is not a multiple of "
                        f"linear_num_key_heads={lin['linear_num_key_heads']} (each key head serves a group of value "
                        "heads)", "use the target's own config.json")
    if not tensors:
        return
    prefix = _prefix(cfg)
    # Qwen3.5's (and Qwen3-Next's) q_proj also makes the attention output gate: 2 x heads x head_dim rows
    _decoder_tensors(s, tensors, prefix, where, 2 * s["num_attention_heads"] * s["head_dim"])
    for i, kind in enumerate(kinds):
        has_linear = any(k.startswith(f"{prefix}layers.{i}.linear_attn.") for k in tensors)
        has_attn = any(k.startswith(f"{prefix}layers.{i}.self_attn.") for k in tensors)
        if (kind == "linear_attention" and has_attn and not has_linear) or \
                (kind == "full_attention" and has_linear and not has_attn):
            held = "self_attn (full_attention)" if has_attn else "linear_attn (linear_attention)"
            raise bad_value(f"{where}.layer_types", kinds, f"entry {i} says {kind} but the checkpoint's layer {i} "
                            f"holds {held} tensors", "list each layer's kind as the checkpoint stores it")
    first = next((i for i, k in enumerate(kinds) if k == "linear_attention"), None)
    if first is None:
        return
    la = f"{prefix}layers.{first}.linear_attn."
    nk, dk = lin["linear_num_key_heads"], lin["linear_key_head_dim"]
    nv, dv = lin["linear_num_value_heads"], lin["linear_value_head_dim"]
    a_log = tensors.get(f"{la}A_log")
    if a_log and a_log[0] != nv:
        raise bad_value(f"{where}.linear_num_value_heads", nv, f"the checkpoint's layer {first} has {a_log[0]} "
                        "value heads (linear_attn.A_log)", f"set linear_num_value_heads to {a_log[0]}")
    z = _rows(tensors, f"{la}in_proj_z.weight")
    if z is not None and z != nv * dv:
        right = f"set linear_value_head_dim to {z // nv}" if z % nv == 0 else "use the target's own config.json"
        raise bad_value(f"{where}.linear_value_head_dim", dv, f"the checkpoint's in_proj_z makes {z} values, not "
                        f"linear_num_value_heads x linear_value_head_dim = {nv} x {dv}", right)
    qkv = _rows(tensors, f"{la}in_proj_qkv.weight")
    if qkv is not None and qkv != 2 * nk * dk + nv * dv:
        keys = (qkv - nv * dv) // 2
        raise bad_value(f"{where}.linear_num_key_heads x linear_key_head_dim", [nk, dk], f"the checkpoint's "
                        f"in_proj_qkv makes {qkv} rows = 2 x {keys} query/key + {nv * dv} value channels, so "
                        f"linear_num_key_heads x linear_key_head_dim is {keys}, not {nk * dk}",
                        "use the target's own config.json")
    conv = tensors.get(f"{la}conv1d.weight")
    if conv and len(conv) == 3 and conv[2] != lin["linear_conv_kernel_dim"]:
        raise bad_value(f"{where}.linear_conv_kernel_dim", lin["linear_conv_kernel_dim"], f"the checkpoint's "
                        f"linear_attn.conv1d has {conv[2]} taps", f"set linear_conv_kernel_dim to {conv[2]}")


TARGET_FAMILIES = {"dense": validate_dense_config, "qwen3_5": validate_qwen3_5_config}


def validate_target_config(cfg, tensors: Shapes | None = None, where: str = "target") -> None:
    """The target family's validator (`TARGET_FAMILIES`, by `targets.family_of`)."""
    from pipeline.models.targets import family_of

    TARGET_FAMILIES[family_of(cfg).name](cfg, tensors, where)


# ---------------------------------------------------------------- what the stages call
def check_drafter(path: str | Path, fmt: str = "auto"):
    """A drafter checkpoint's config (as `layout.light_config`), every field validated against its tensors."""
    from pipeline.models.layout import light_config

    cfg = light_config(path, fmt)
    validate_drafter_config(cfg, tensor_shapes(path))
    return cfg


def _local_dir(path: str | Path, revision: str | None) -> Path | None:
    if Path(str(path)).is_dir():
        return Path(str(path))
    try:
        from pipeline.core.loading import local_snapshot

        return local_snapshot(path, revision)
    except Exception:  # noqa: BLE001 - not local, not in the Hub cache: the loaders say so in their sentence
        return None


def check_target(path: str | Path, revision: str | None = None, where: str = "target") -> dict | None:
    """A target checkpoint's config.json (a dict), every field validated against its tensors; None when the
    checkpoint is not local or has no readable config.json (the config loaders refuse those in one sentence)."""
    folder = _local_dir(path, revision)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    validate_target_config(cfg, tensor_shapes(folder), where)
    return cfg


__all__ = ["tensor_shapes", "drafter_family", "validate_dflash_config", "validate_dflash2_config",
           "validate_drafter_config", "DRAFTER_FAMILIES", "validate_dense_config", "validate_qwen3_5_config",
           "validate_target_config", "TARGET_FAMILIES", "check_drafter", "check_target"]
