"""DFlash config.json layouts parsed without torch (fast: compatibility checks run before heavy imports).

Layer ids (the one-off between formats, made explicit here):
- our `aux_layer_ids` and speculators `aux_hidden_state_layer_ids` are HF `output_hidden_states`
  indices: m = output of target decoder layer m-1 (index 0 = embeddings);
- z-lab `dflash_config.target_layer_ids` are decoder-layer indices: l = output of layer l
  (z-lab reads `hidden_states[l + 1]`), so m = l + 1.
vLLM (after vllm#40727) maps speculators ids back with `target_layer_ids = [m - 1]`, which agrees.

DFlash2 (same family, `DFLASH2_FIELDS` set): z-lab writes `architectures ["DFlash2DraftModel"]`, a top-level
`is_causal: false` and the conv/selector fields inside `dflash_config`; speculators (>= 0.8) writes
`speculators_model_type "dflash2"` with the same fields flat at top level. Both are read here into the
same keyword arguments.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from pipeline.core.errors import bad_value
from pipeline.core.io import read_json

MODEL_TYPE = "specquant_dflash"
FORMATS = ("zlab", "speculators", "native")
# DFlash2's config fields, the same names in z-lab's dflash_config, speculators' top level and ours
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SPECULATORS_TYPES = ("dflash", "dflash2")
ZLAB_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# Qwen3 layer fields shared by every format (rope is handled separately)
LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                "rms_norm_eps", "attention_bias", "attention_dropout", "use_sliding_window", "sliding_window",
                "max_window_layers", "layer_types", "tie_word_embeddings", "pad_token_id", "bos_token_id",
                "eos_token_id")


def zlab_to_hf_ids(target_layer_ids: list[int]) -> list[int]:
    """z-lab `target_layer_ids` (decoder layer l) -> HF hidden_states index l+1."""
    return [int(i) + 1 for i in target_layer_ids]


def hf_to_zlab_ids(aux_layer_ids: list[int]) -> list[int]:
    return [int(i) - 1 for i in aux_layer_ids]


def _rope_from(d: dict) -> dict:
    if d.get("rope_parameters"):
        return dict(d["rope_parameters"])
    scaling = dict(d.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    return {"rope_type": rope_type, "rope_theta": float(d.get("rope_theta", 1e6)), **scaling}


def _layer_fields(d: dict) -> dict:
    out = {k: d[k] for k in LAYER_FIELDS if k in d}
    out["rope_parameters"] = _rope_from(d)
    return out


def detect_format(d: dict, path: str = "") -> str:
    if d.get("speculators_model_type"):
        if d["speculators_model_type"] not in SPECULATORS_TYPES:
            raise bad_value("drafter.path", path, f"it is a speculators `{d['speculators_model_type']}` checkpoint, "
                            "not a DFlash or DFlash2 drafter", "point drafter.path at a DFlash checkpoint")
        return "speculators"
    if d.get("model_type") == MODEL_TYPE:
        return "native"
    if "dflash_config" in d or set(ZLAB_ARCHITECTURES) & set(d.get("architectures") or []):
        return "zlab"
    raise bad_value("drafter.path", path, "its config.json is neither a z-lab DFlash (`dflash_config`) nor a "
                    "speculators DFlash (`speculators_model_type: dflash`) config",
                    "point drafter.path at a DFlash drafter checkpoint")


def _dflash2_fields(src: dict, path: str, where: str) -> dict:
    """The DFlash2 fields of a config (all of them, or none for a DFlash drafter)."""
    got = {k: src[k] for k in DFLASH2_FIELDS if src.get(k) is not None}
    if got and len(got) != len(DFLASH2_FIELDS):
        missing = [k for k in DFLASH2_FIELDS if k not in got]
        raise bad_value("drafter.path", path, f"its DFlash2 config sets {sorted(got)} in {where} but not {missing}",
                        "re-export the drafter with all four DFlash2 fields")
    return {k: int(v) for k, v in got.items()}


def draft_vocab_size(d: dict, vocab, path: str = "") -> int | None:
    """A top-level `draft_vocab_size` below the vocabulary (a trimmed head, `pipeline.models.draft_vocab`), else
    None (absent, or equal to the vocabulary: the target's head is borrowed)."""
    n = d.get("draft_vocab_size")
    if n is None or n == vocab:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or vocab is None or not 1 <= n < int(vocab):
        raise bad_value("drafter.path", path, f"its draft_vocab_size {n!r} is not a count of 1 to {vocab} tokens "
                        "(the vocabulary)", "re-export the drafter (`python -m pipeline convert --draft-vocab N`)")
    return n


def config_from_zlab(d: dict, path: str = "") -> dict:
    dc = d.get("dflash_config") or {}
    block_size = d.get("block_size", dc.get("block_size"))
    # z-lab's _draft_value: dflash_config first, then the top level
    extra = _dflash2_fields({**{k: d.get(k) for k in DFLASH2_FIELDS}, **{k: v for k, v in dc.items() if v is not None}},
                            path, "dflash_config")
    if "DFlash2DraftModel" in (d.get("architectures") or []) and not extra:
        raise bad_value("drafter.path", path, "its architecture is DFlash2DraftModel but its dflash_config has no "
                        f"{', '.join(DFLASH2_FIELDS)}", "re-export the drafter with its DFlash2 fields")
    layer = _layer_fields(d)
    # vLLM takes a layer's window from dflash_config.swa_window_size before the top-level sliding_window, and
    # dflash_config.use_swa makes every layer sliding when layer_types names none (0.32 qwen3_dflash.py:154-173)
    if dc.get("swa_window_size") is not None:
        layer["sliding_window"] = dc["swa_window_size"]
    if dc.get("use_swa") and "sliding_attention" not in (layer.get("layer_types") or []):
        raise bad_value("drafter.dflash_config.use_swa", dc["use_swa"], "vLLM then serves every draft layer with a "
                        "sliding window, which the config's layer_types does not say",
                        "write layer_types with one sliding_attention entry per draft layer instead")
    trimmed = draft_vocab_size(d, layer.get("vocab_size"), path)
    if trimmed is not None:
        extra["draft_vocab_size"] = trimmed
    return dict(**layer, block_size=int(block_size), mask_token_id=dc.get("mask_token_id"),
                        aux_layer_ids=zlab_to_hf_ids(dc.get("target_layer_ids") or []),
                        num_target_layers=d.get("num_target_layers"), dtype=d.get("dtype", d.get("torch_dtype")),
                        **extra)


def config_from_speculators(d: dict, path: str = "") -> dict:
    tlc = d.get("transformer_layer_config") or {}
    if not tlc:
        raise bad_value("drafter.path", path, "its speculators config has no `transformer_layer_config`",
                        "re-export the drafter with speculators or `python -m pipeline convert`")
    draft_vocab = draft_vocab_size(d, tlc.get("vocab_size"), path)
    verifier = (d.get("speculators_config") or {}).get("verifier") or {}
    extra = {}
    if d.get("speculators_model_type") == "dflash2":
        extra = _dflash2_fields(d, path, "its top level")
        if not extra:
            raise bad_value("drafter.path", path, "its speculators `dflash2` config has no "
                            f"{', '.join(DFLASH2_FIELDS)}", "re-export the drafter with its DFlash2 fields")
    if draft_vocab is not None:
        extra["draft_vocab_size"] = draft_vocab
    return dict(**_layer_fields(tlc), block_size=int(d["block_size"]), mask_token_id=d.get("mask_token_id"),
                        aux_layer_ids=list(d.get("aux_hidden_state_layer_ids") or []),
                        target_hidden_size=d.get("target_hidden_size"),
                        num_target_layers=tlc.get("num_target_layers"),
                        verifier_name_or_path=verifier.get("name_or_path"),
                        verifier_architectures=verifier.get("architectures"),
                        dtype=d.get("dtype", tlc.get("dtype")), **extra)




def not_local(path: str, field: str = "drafter.path") -> None:
    """Refuse a drafter path that is not a directory, in its own sentence: a Hub id that is not in the local
    Hugging Face cache (with the `hf download` that fetches it), a Hub id that is (the drafter is read from a
    directory: its snapshot's), or a path that does not exist."""
    from pipeline.core.hub import hub_id
    from pipeline.core.loading import download_hint, local_snapshot

    name = str(path).rsplit("/", 1)[-1]
    if not hub_id(path):
        raise bad_value(field, path, "no such directory", "point it at a drafter checkpoint directory")
    if str(path).split("/", 1)[0] == "downloads":  # the quickstart's directory-to-be, not a Hub id
        raise bad_value(field, path, "no such directory (nothing is downloaded at run time)",
                        f"download the drafter into it first: `hf download <the drafter's Hub id, e.g. "
                        f"z-lab/{name}> --local-dir {path}` (docs/quickstart.md, step 1)")
    try:
        snapshot = local_snapshot(path)
    except LookupError:
        raise bad_value(field, path, "it is not in the local Hugging Face cache (nothing is downloaded at run time)",
                        f"{download_hint(path)} and set {field}=downloads/{name}") from None
    raise bad_value(field, path, f"the drafter is read from a directory, and the Hub cache holds this repo at "
                    f"{snapshot}", f"set {field}={snapshot} (or `hf download {path} --local-dir downloads/{name}` "
                    f"and {field}=downloads/{name})")


def read_config_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        not_local(str(path))
    if not (p / "config.json").is_file():
        raise bad_value("drafter.path", str(path), "it has no config.json",
                        "point it at a drafter checkpoint directory")
    return read_json(p / "config.json", "drafter.path")


def drafter_kwargs(path: str | Path, fmt: str = "auto") -> tuple[str, dict]:
    """(format, DFlashConfig keyword arguments) read from a drafter directory's config.json."""
    if fmt not in ("auto", *FORMATS):
        raise bad_value("drafter.format", fmt, "unknown drafter format", f"use one of auto, {', '.join(FORMATS)}")
    d = read_config_json(path)
    found = detect_format(d, str(path))
    if fmt != "auto" and fmt != found:
        raise bad_value("drafter.format", fmt, f"{path} holds a {found} checkpoint",
                        f"set drafter.format={found} (or auto)")
    if found == "zlab":
        return found, config_from_zlab(d, str(path))
    if found == "speculators":
        return found, config_from_speculators(d, str(path))
    return found, d


def light_config(path: str | Path, fmt: str = "auto") -> SimpleNamespace:
    """The drafter config as a plain namespace (what `compat.check_compatible` reads), without torch."""
    _, kw = drafter_kwargs(path, fmt)
    kw = dict(kw)
    kw.setdefault("num_key_value_heads", kw.get("num_attention_heads"))
    if kw.get("head_dim") is None and kw.get("num_attention_heads"):
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    for key in ("target_hidden_size", "num_target_layers", "mask_token_id", "aux_layer_ids", "draft_vocab_size",
                *DFLASH2_FIELDS):
        kw.setdefault(key, None)
    return SimpleNamespace(**kw)
