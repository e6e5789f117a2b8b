"""Targets by family, not by class: the one place that knows how a target model is laid out.

A stage asks this module, never `model.model.layers` or a class name, for
- `text_config(config)`: the decoder's config (a multimodal config keeps it in `text_config`);
- `family_of(config)`: the `Family` of a target config (by `model_type`, text config included);
- `decoder(model)`: the text decoder module holding `embed_tokens`, `layers` and `norm`, whichever wrapper
  (`*ForCausalLM`, the base model, `*ForConditionalGeneration` / its `language_model`) was loaded;
- `layer_types(config)`: each decoder layer's kind (`full_attention`, `linear_attention`, ...);
- `tensor_names(config)`, `multimodal(config)`, `model_class(config)`: the embedding / norm / head names of
  a checkpoint (`model.` or a multimodal wrapper's `model.language_model.`) and the class that keeps all of
  its towers; `carried(name, config)`: a tensor (MTP head) quantize-target copies through unchanged;
- `dense_modules(config)`: the llm-compressor ignore entries a family adds to quantize-target (the
  vision tower, the MTP head, the linear-attention gates: docs/hybrid.md);
- `decode_cache(model)`: the target's cache for (speculative) greedy decoding and the rollback after a
  rejected draft its family needs (`DecodeCache`: crop the K/V of a dense target; restore the recurrent
  and convolution states of a hybrid's linear-attention layers and re-run the accepted tokens);
A drafter whose aux layers or vocabulary do not fit the target is refused in one sentence by
`pipeline.models.compat.check_compatible` (from configs, any family; a hybrid's layer mix is named). Every field
of a target's own config.json (sizes, `layer_types`, sliding windows, a hybrid's linear-attention sizes) is checked
against the others and the checkpoint's tensors by its family's validator (`pipeline.models.validation`,
`TARGET_FAMILIES` by `Family.name`), before transformers' config class reads it.

Aux layer ids mean decoder layer outputs in HF `output_hidden_states` convention (0 = embeddings,
m = output of decoder layer m-1, L = the final norm's output) whatever the mix of layer types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import bad_value


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.model_type values (outer or text config)
    # module-name patterns (llm-compressor `re:` syntax) never run by the cache stage nor quantized
    never_run: tuple[str, ...] = ()
    # Linear layers kept dense by quantize-target beyond recipes.ALWAYS_IGNORE (embed_tokens, lm_head)
    dense_linears: tuple[str, ...] = ()
    hybrid: bool = False  # some decoder layers are not softmax attention
    # checkpoint tensor names (regex, full match) that no transformers class of the family loads: copied
    # unchanged by quantize-target, skipped when a written checkpoint is read back
    unloaded: tuple[str, ...] = ()
    # (text-only class, the image-text wrapper the family ships as): a vLLM that registers only the wrapper
    # (0.26) serves a text-only checkpoint in the wrapper's layout (pipeline.serving.layout)
    served_wrapper: tuple[str, str] | None = None
    # checkpoint-name prefixes of parts that are never the text decoder (an MTP head, a vision tower): a reader
    # looking for the embedding or the head by suffix skips them (`head_lookup`)
    foreign_prefixes: tuple[str, ...] = ()


DENSE = Family("dense", ("qwen3", "qwen2", "llama", "mistral"))
QWEN3_5 = Family(
    "qwen3_5", ("qwen3_5", "qwen3_5_text", "qwen3_next"),
    never_run=(r"re:(.*\.)?visual\..*", r"re:(.*\.)?mtp\..*"),
    # in_proj_a / in_proj_b make the decay and beta gates (one output per value head): kept dense, as
    # A_log, dt_bias, conv1d and the gated norm are (those are not Linear layers at all)
    dense_linears=(r"re:.*linear_attn\.in_proj_a$", r"re:.*linear_attn\.in_proj_b$"),
    hybrid=True, unloaded=(r"mtp\..*",),
    served_wrapper=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    foreign_prefixes=("mtp.", "model.visual."))
FAMILIES = (DENSE, QWEN3_5)


def _get(cfg: Any, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def text_config(config: Any) -> Any:
    """The decoder's config: `get_text_config()` of an HF config, `text_config` of a config.json dict."""
    if hasattr(config, "get_text_config"):
        return config.get_text_config()
    return _get(config, "text_config") or config


def family_of(config: Any) -> Family:
    """The target's family by model_type (outer, then text config); unknown types are treated as dense
    decoders, whose layout `decoder` still checks."""
    types = {_get(config, "model_type"), _get(text_config(config), "model_type")}
    for fam in FAMILIES:
        if types & set(fam.model_types):
            return fam
    return DENSE


def layer_types(config: Any) -> list[str]:
    tc = text_config(config)
    n = int(_get(tc, "num_hidden_layers"))
    kinds = _get(tc, "layer_types")
    return list(kinds) if kinds else ["full_attention"] * n


def num_layers(config: Any) -> int:
    return int(_get(text_config(config), "num_hidden_layers"))


def decoder(model) -> Any:
    """The text decoder (`embed_tokens`, `layers`, `norm`) inside whatever wrapper was loaded."""
    seen = []
    for path in ("", "model", "language_model", "model.language_model", "base_model", "base_model.language_model"):
        mod = model
        for part in filter(None, path.split(".")):
            mod = getattr(mod, part, None)
        if mod is None or any(mod is s for s in seen):
            continue
        seen.append(mod)
        if all(hasattr(mod, a) for a in ("layers", "norm", "get_input_embeddings")):
            return mod
    raise bad_value("target.path", getattr(getattr(model, "config", None), "name_or_path", "?"),
                    f"its model ({type(model).__name__}) has no text decoder with `layers`/`norm` to hook",
                    "use a decoder-only HF causal LM (Llama/Qwen family layout) or a Qwen3.5-family model")


def multimodal(config: Any) -> bool:
    """A wrapper with a vision tower (`*ForConditionalGeneration`, e.g. Qwen3.8-27B): its text weights are
    stored under `model.language_model.`, the vision tower under `model.visual.`."""
    return _get(config, "vision_config") is not None


def tensor_names(config: Any) -> dict[str, str]:
    """The checkpoint names of the text decoder's embedding, final norm and output head (what a drafter
    borrows and what a reader of target weights by name looks for), for a plain causal LM or a multimodal
    wrapper."""
    prefix = "model.language_model." if multimodal(config) else "model."
    return {"embed": f"{prefix}embed_tokens.weight", "norm": f"{prefix}norm.weight", "lm_head": "lm_head.weight"}


def head_lookup(config: Any) -> dict[str, Any]:
    """How a reader that cannot import the project (the serve-check worker, in vLLM's interpreter; it gets this
    in its job file) finds the target's embedding and head: the two names of `tensor_names`, and the prefixes a
    search by suffix skips (every family's `foreign_prefixes`: the checkpoint may be of any family's layout)."""
    names = tensor_names(config)
    return {"embed": names["embed"], "lm_head": names["lm_head"],
            "skip_prefixes": sorted({p for fam in FAMILIES for p in fam.foreign_prefixes})}


def model_class(config: Any):
    """The transformers auto class that keeps every tower of the checkpoint (quantize-target writes them
    all back): the image-text class for a multimodal wrapper, the causal LM otherwise. Stages that only run
    the text tower (cache, evaluate) load `AutoModelForCausalLM`/`AutoModel`, which read the text weights
    of either layout."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if multimodal(config) else AutoModelForCausalLM


def carried(name: str, config: Any) -> bool:
    """A checkpoint tensor of a part never run nor loaded by transformers' class (the MTP head `mtp.*`)
    that quantize-target copies into its output unchanged."""
    import re

    return any(re.fullmatch(p, name) for p in family_of(config).unloaded)


def dense_modules(config: Any) -> list[str]:
    """quantize-target's extra ignore entries for this family (none for a dense target)."""
    fam = family_of(config)
    return list(fam.never_run) + list(fam.dense_linears)


class DecodeCache:
    """A dense target's HF cache for greedy decoding: `cache` goes to the forward as `past_key_values`;
    `checkpoint()` before a verify forward, `keep(n, fed, target)` after it keeps the first `n` of the
    `fed` ids [1, F] (the accepted draft and its first token) and forgets the rest: K/V rows are cropped."""

    reusable = True  # rows per token: `tail` / `load_rows` rebuild it (pipeline.models.target_steps)

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    def checkpoint(self) -> None:
        """Nothing to save: attention K/V can be cropped."""

    def keep(self, n: int, fed, target) -> None:
        self.cache.crop(n - int(fed.shape[-1]))  # negative = tokens to drop (transformers >= 5.17)

    def tail(self, n: int) -> list:
        """[(keys, values)] per layer: copies of the last `n` rows."""
        return [(layer.keys[..., -n:, :].clone(), layer.values[..., -n:, :].clone()) for layer in self.cache.layers]

    def load_rows(self, layers: list) -> None:
        """The cache holding exactly `layers` ([(keys, values)] per layer, all rows)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=layers)


class RecurrentDecodeCache(DecodeCache):
    """A hybrid target's cache (built from its config: linear-attention layers hold a convolution and a
    recurrent state, not one row per token). A recurrent state cannot be cropped, so `checkpoint()` copies
    the linear-attention states before the verify forward and `keep` after a rejection puts them back,
    crops the attention layers' K/V to where they were and runs the `n` kept ids through the target again;
    a fully accepted block is kept as the verify forward left it."""

    reusable = False  # a recurrent state is not rows per token

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=model.config)
        self._saved: list = []

    def _linear(self):
        return [layer for layer in self.cache.layers if hasattr(layer, "recurrent_states")]

    def checkpoint(self) -> None:
        def copy(states: dict) -> dict:
            return {i: (t.clone() if t is not None else None) for i, t in states.items()}
        self._saved = [(copy(layer.conv_states), copy(layer.recurrent_states), dict(layer.has_previous_state))
                       for layer in self._linear()]

    def keep(self, n: int, fed, target) -> None:
        fed_len = int(fed.shape[-1])
        if n == fed_len:
            return
        linear = self._linear()
        for layer, (conv, rec, prev) in zip(linear, self._saved, strict=True):
            layer.conv_states, layer.recurrent_states = conv, rec
            layer.has_previous_state = prev
        for layer in self.cache.layers:
            if not any(layer is lin for lin in linear):
                layer.crop(-fed_len)
        target(input_ids=fed[:, :n], past_key_values=self.cache, use_cache=True)


def decode_cache(model) -> DecodeCache:
    """The decoding cache the target's family needs (see `DecodeCache`, `RecurrentDecodeCache`)."""
    return RecurrentDecodeCache(model) if family_of(model.config).hybrid else DecodeCache(model)


def describe(config: Any) -> str:
    """e.g. `qwen3_5: 3 linear_attention + 1 full_attention`."""
    kinds = layer_types(config)
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return f"{family_of(config).name}: " + " + ".join(f"{c} {k}" for k, c in counts.items())


__all__ = ["Family", "FAMILIES", "DENSE", "QWEN3_5", "text_config", "family_of", "layer_types", "num_layers",
           "decoder", "dense_modules", "multimodal", "tensor_names", "model_class", "carried", "describe", "DecodeCache", "RecurrentDecodeCache", "decode_cache"]
