"""Every config field of every drafter and target family, checked before any work (issue 47).

One validator per family, a self-contained function of (config, tensors):
- drafters (each in its family's module, `pipeline.models.families`, picked by `families.family_of`):
  `validate_dflash_config` (DFlash: layer sizes, layer types and sliding windows, block size, mask id, aux layers)
  and `validate_dflash2_config` (DFlash's checks, then the convolution's group and taps and the selector's rank
  and top-K), re-exported here;
- targets (`TARGET_FAMILIES`, keyed by `pipeline.models.targets.Family.name`): `validate_dense_config`
  (Qwen3/Llama-style decoders) and `validate_qwen3_5_config` (the Qwen3.5 hybrid: its `layer_types` and
  linear-attention sizes as well).
`cfg` is the config as read from config.json (a target's dict; a drafter's `layout.light_config`); `tensors` is
{name: shape} from the checkpoint's safetensors headers (`tensor_shapes`: no weight is read), or None when no
header can be read (the loaders then refuse the files in their own sentence). A field is checked against the
other fields first, then against the tensors that carry it; a tensor a checkpoint does not store under its plain
name (a compressed-tensors `weight_packed`) is not looked at. The shared field checks are `pipeline.models.fields`. Each bad field is one `bad_value` sentence naming
the field, its value and the fix.

The stages call `check_drafter`, `check_target` and `compat.check_checkpoints` (the two, then the pair's
`compat.check_compatible`) where they first read a checkpoint, before any weight is loaded or anything is written:
cache, quantize-drafter, quantize-target, evaluate, serve-check and convert. Nothing here imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import bad_value
from pipeline.models.families import family_of
from pipeline.models.families.dflash import validate_dflash_config
from pipeline.models.families.dflash2 import validate_dflash2_config
from pipeline.models.fields import (  # noqa: F401 - MAX_HEADER_BYTES, Shapes: the names this module always had
    DENSE_LAYER_KINDS,
    HYBRID_LAYER_KINDS,
    LEGACY_HYBRID_KINDS,
    MAX_HEADER_BYTES,
    Shapes,
    tensor_shapes,
)
from pipeline.models.fields import get as _get
from pipeline.models.fields import is_int as _is_int
from pipeline.models.fields import layer_ids as _layer_ids
from pipeline.models.fields import layer_kinds as _layer_kinds
from pipeline.models.fields import positive as _positive
from pipeline.models.fields import rows as _rows
from pipeline.models.fields import sliding_window as _sliding_window


# ---------------------------------------------------------------- drafters: each family's own validator
def drafter_family(cfg) -> str:
    """The name of the drafter family of `cfg` (`pipeline.models.families.family_of`)."""
    return family_of(cfg).name


def validate_drafter_config(cfg, tensors: Shapes | None = None) -> None:
    """The drafter family's validator (`DrafterFamily.validate`: `validate_dflash_config`,
    `validate_dflash2_config`, each in its family's module)."""
    family_of(cfg).validate(cfg, tensors)


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
           "validate_drafter_config", "validate_dense_config", "validate_qwen3_5_config",
           "validate_target_config", "TARGET_FAMILIES", "check_drafter", "check_target"]
