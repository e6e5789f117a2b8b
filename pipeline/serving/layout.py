"""The layout a target is served in, when the vLLM release at hand cannot build the checkpoint's own class.

vLLM 0.26.0 registers the Qwen3.5 family only as its image-text wrapper `Qwen3_5ForConditionalGeneration`
(`model_executor/models/registry.py:573`); its text-only `Qwen3_5ForCausalLM` class (`models/qwen3_5.py:378`)
is built only inside that wrapper (`:430-433`) and is not in the registry, so a text-only Qwen3.5 checkpoint
(the tiny hybrid world's target and every target quantize-target writes from it) cannot be loaded by name.
vLLM 0.32 registers `Qwen3_5ForCausalLM` itself (docs/hybrid.md).

`wrap_text_checkpoint` writes the text checkpoint in the wrapper's layout, which is how Qwen3.8-27B ships:
config.json with `text_config` (the checkpoint's own config) and a default `vision_config`, every text tensor
renamed `model.X` -> `model.language_model.X` (`lm_head.*` unchanged), bytes unchanged; no vision weights.
serve-check then runs the engine with `language_model_only=True` (0.26: `config/multimodal.py:77`,
`engine/arg_utils.py:557`), under which vLLM builds no vision tower (`models/interfaces.py:257-290`,
`_mark_tower_model`) and loads the same language model class with the same weights.
Which text class is served as which wrapper is the family's (`pipeline.models.targets.Family.served_wrapper`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_dir
from pipeline.models import targets as target_families

TEXT_PREFIX, WRAPPED_PREFIX = "model.", "model.language_model."
VISUAL_IGNORE = r"re:.*visual\..*"
# text-only class -> the wrapper class its family ships as
WRAPPERS = {f.served_wrapper[0]: f.served_wrapper[1] for f in target_families.FAMILIES if f.served_wrapper}


def wrapped_name(name: str) -> str:
    """A text checkpoint's tensor or module name in the wrapper's layout (`lm_head.*` and patterns unchanged)."""
    return WRAPPED_PREFIX + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name


def wrapper_for(config: dict) -> tuple[str, str] | None:
    """(text class, wrapper class) when `config` is a text-only checkpoint whose family ships a wrapper, else None."""
    if target_families.multimodal(config):
        return None
    fam = target_families.family_of(config)
    pair = fam.served_wrapper
    return pair if pair and pair[0] in (config.get("architectures") or []) else None


def wrapped_config(config: dict) -> dict:
    """config.json of the wrapper around text config `config` (quantization_config stays at the top, where
    vLLM and compressed-tensors read it)."""
    from transformers import AutoConfig

    _, wrapper = wrapper_for(config) or (None, None)
    if wrapper is None:
        raise bad_value("target", config.get("architectures"), "it is not a text-only checkpoint of a family "
                        "with an image-text wrapper", "serve it as it is")
    text = {k: v for k, v in config.items() if k not in ("architectures", "quantization_config", "auto_map")}
    outer_type = {"qwen3_5_text": "qwen3_5"}.get(text.get("model_type"), text.get("model_type"))
    outer = AutoConfig.for_model(outer_type, text_config=text, tie_word_embeddings=bool(config.get("tie_word_embeddings")))
    out = outer.to_dict()
    out["architectures"] = [wrapper]
    out["dtype"] = text.get("dtype") or text.get("torch_dtype")
    # vLLM builds the vision tower before text-only mode drops it (0.26 `models/interfaces.py:257-290`), with the
    # checkpoint's quant config: a small tower, kept dense by the ignore list (no weights of it are written)
    out["vision_config"].update(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                out_hidden_size=text.get("hidden_size"))
    if config.get("quantization_config"):
        q = json.loads(json.dumps(config["quantization_config"]))
        # plain module names move with their tensors (vLLM maps `model.language_model.` to its own prefix)
        q["ignore"] = [wrapped_name(x) for x in q.get("ignore") or []] + [VISUAL_IGNORE]
        out["quantization_config"] = q
    out.pop("transformers_version", None)
    return out


def wrap_text_checkpoint(src: Path, out: Path) -> Path:
    """Write `src` (a text-only checkpoint) in its family's wrapper layout at `out` (atomic), tensors
    renamed, bytes unchanged; other files (tokenizer, generation config) copied. Returns `out`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    conf = wrapped_config(config)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise bad_value("target", str(src), "it holds no *.safetensors file", "point at a saved checkpoint")
    with atomic_dir(out) as tmp:
        weight_map = {}
        for shard in shards:
            with safe_open(str(shard), "pt") as fh:
                meta = fh.metadata()
                tensors = {wrapped_name(k): fh.get_tensor(k) for k in fh.keys()}
            save_file(tensors, str(tmp / shard.name), metadata=meta)
            weight_map.update({k: shard.name for k in tensors})
        if (src / "model.safetensors.index.json").is_file():
            index = json.loads((src / "model.safetensors.index.json").read_text(encoding="utf-8"))
            index["weight_map"] = dict(sorted(weight_map.items()))
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
