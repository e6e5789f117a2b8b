"""Drafter/target compatibility, checked from configs (and the tokenizer) before any heavy work.

Each violation raises one `bad_value` sentence. A DFlash2 drafter also has its convolution's group size
checked against its hidden size, its taps against the block size and its selector's top-K against the
target's vocabulary (`_check_dflash2`). The motivating case: a drafter built for another
model family (say a 256k-vocabulary Gemma drafter with another hidden size) paired with a Qwen
target must fail here, not as a shape error deep inside a forward pass.

CLI: `python -m pipeline.models.compat DRAFTER_DIR TARGET_DIR` prints "compatible" or the error.
"""

from __future__ import annotations

import sys
from typing import Any


def _get(cfg: Any, key: str, default=None):
    """Field of an HF config object or a plain dict (multimodal targets keep it in text_config)."""
    if isinstance(cfg, dict):
        val = cfg.get(key, default)
        text = cfg.get("text_config")
    else:
        val = getattr(cfg, key, default)
        text = getattr(cfg, "text_config", None)
    if val is None and text is not None:
        return _get(text, key, default)
    return val


def _tok_len(tok) -> int:
    """Token count of an HF tokenizer or a bare `tokenizers.Tokenizer` (added tokens included)."""
    if hasattr(tok, "get_vocab_size"):
        return tok.get_vocab_size(with_added_tokens=True)
    return len(tok)


def _tok_id(tok, token: str):
    if hasattr(tok, "token_to_id"):
        return tok.token_to_id(token)
    found = tok.convert_tokens_to_ids(token)
    return None if found == getattr(tok, "unk_token_id", object()) and token != tok.unk_token else found


def _check_shapes(d, err) -> None:
    if d.block_size is None or int(d.block_size) < 2:
        raise err("block_size", d.block_size, "a DFlash block holds the bonus token plus at least one mask token",
                  "use block_size >= 2 (z-lab drafters use 16)")
    heads, kv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    if not heads or not kv or heads % kv:
        raise err("num_attention_heads", heads, f"it is not a multiple of num_key_value_heads={kv}",
                  "fix the drafter config's head counts")
    if not hd or hd % 2:
        raise err("head_dim", hd, "RoPE needs an even, positive head dimension", "fix the drafter config's head_dim")
    kinds = list(getattr(d, "layer_types", None) or [])
    other = [i for i, t in enumerate(kinds) if t not in ("full_attention", "sliding_attention")]
    if other:
        raise err("drafter.layer_types", kinds, f"layers {other} are neither full_attention nor sliding_attention, "
                  "which this drafter implementation does not support", "use a drafter with attention layers only")
    window = getattr(d, "sliding_window", None)
    sliding = [i for i, t in enumerate(kinds) if t == "sliding_attention"]
    if sliding and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise err("drafter.sliding_window", window, f"layers {sliding} are sliding_attention layers and need a "
                  "positive window size", "set the drafter config's sliding_window (z-lab's DFlash2 drafters use 2048)")


def _check_hidden(d, t, err) -> None:
    h_t = _get(t, "hidden_size")
    n_aux = len(d.aux_layer_ids or [])
    h_aux = d.target_hidden_size or d.hidden_size  # what fc expects per aux layer
    if h_aux != h_t:
        raise err("drafter.target_hidden_size", h_aux,
                  f"the drafter's fc expects {n_aux} x {h_aux} target features but the target's "
                  f"hidden size is {h_t} (fc input = n_aux x H)", "use a drafter trained for this target")
    if d.hidden_size != h_t:
        raise err("drafter.hidden_size", d.hidden_size, f"the drafter borrows the target's embed_tokens/lm_head of "
                  f"width {h_t}", "use a drafter trained for this target (same hidden size)")


def _check_vocab(d, t, tokenizer, err) -> None:
    v_t = _get(t, "vocab_size")
    if d.vocab_size != v_t:
        raise err("drafter.vocab_size", d.vocab_size, f"the target's vocabulary has {v_t} tokens",
                  "use a drafter built for the target's tokenizer")
    if tokenizer is not None and _tok_len(tokenizer) > v_t:
        raise err("target.tokenizer", getattr(tokenizer, "name_or_path", "?"), f"it has {_tok_len(tokenizer)} tokens, "
                  f"more than the target's vocab_size {v_t}", "use the target's own tokenizer")


def _check_layers(d, t, err) -> None:
    n = _get(t, "num_hidden_layers")
    ids = list(d.aux_layer_ids or [])
    if not ids:
        raise err("drafter.aux_layer_ids", ids, "a DFlash drafter needs at least one target layer",
                  "set the aux layers (z-lab target_layer_ids / speculators aux_hidden_state_layer_ids)")
    bad = [m for m in ids if not 1 <= m <= n - 1]
    if bad:
        from pipeline.models.targets import describe, family_of

        mix = f" ({describe(t)})" if family_of(t).hybrid else ""  # a dense target's sentence is unchanged
        raise err("drafter.aux_layer_ids", ids, f"HF hidden-state indices {bad} are outside 1..{n - 1} for a "
                  f"{n}-layer target{mix} (z-lab target_layer_ids = these - 1)", "use a drafter trained for this target")
    if d.num_target_layers is not None and d.num_target_layers != n:
        raise err("drafter.num_target_layers", d.num_target_layers, f"the target has {n} layers",
                  "use a drafter trained for this target")


def _check_mask(d, tokenizer, mask_token, err) -> None:
    mid = d.mask_token_id
    if mid is None or not 0 <= mid < d.vocab_size:
        raise err("drafter.mask_token_id", mid, f"it is not a token id of the {d.vocab_size}-token vocabulary",
                  "set the drafter's mask_token_id to the tokenizer's mask token")
    if tokenizer is None:
        return
    if mid >= _tok_len(tokenizer):
        raise err("drafter.mask_token_id", mid, f"the tokenizer has only {_tok_len(tokenizer)} tokens",
                  "add the mask token to the tokenizer or use the target's tokenizer")
    if mask_token is not None:
        found = _tok_id(tokenizer, mask_token)
        if found != mid:
            raise err("drafter.mask_token", mask_token, f"the tokenizer maps it to {found}, but the drafter's "
                      f"mask_token_id is {mid}", "use the tokenizer the drafter was trained with")


def _check_dflash2(d, t, err) -> None:
    """DFlash2's convolution and selector against the drafter's own sizes and the target's vocabulary."""
    taps, group = getattr(d, "conv_kernel_size", None), getattr(d, "conv_group_size", None)
    rank, top_k = getattr(d, "selector_rank", None), getattr(d, "selector_top_k", None)
    if taps is None and rank is None:
        return  # a DFlash drafter
    h = d.hidden_size
    if not group or group < 1 or h % group:
        raise err("drafter.conv_group_size", group, f"it does not divide the drafter's hidden size {h} (the "
                  "convolution shares one dynamic coefficient per group of channels)",
                  f"use a conv_group_size that divides {h}")
    if not taps or not 1 <= taps <= d.block_size:
        raise err("drafter.conv_kernel_size", taps, f"the convolution runs inside one {d.block_size}-token block, so "
                  f"it needs between 1 and block_size={d.block_size} taps", "use a drafter exported with a valid "
                  "conv_kernel_size (DFlash2 uses 2)")
    if not rank or rank < 1:
        raise err("drafter.selector_rank", rank, "the candidate selector needs a positive rank",
                  "use a drafter exported with its selector_rank (DFlash2 uses 256)")
    v_t = _get(t, "vocab_size")
    if not top_k or not 1 <= top_k <= v_t:
        raise err("drafter.selector_top_k", top_k, f"the selector keeps the top-K candidates of the target's "
                  f"{v_t}-token vocabulary, so K must be between 1 and {v_t}",
                  "use a drafter whose selector_top_k fits this target's vocabulary")


def check_compatible(drafter_config, target_config, tokenizer=None, mask_token: str | None = None) -> None:
    """Raise `SpecquantError` (one sentence) if the drafter cannot run on this target/tokenizer."""
    from pipeline.core.errors import bad_value

    _check_shapes(drafter_config, bad_value)
    _check_hidden(drafter_config, target_config, bad_value)
    _check_vocab(drafter_config, target_config, tokenizer, bad_value)
    _check_dflash2(drafter_config, target_config, bad_value)
    _check_layers(drafter_config, target_config, bad_value)
    _check_mask(drafter_config, tokenizer, mask_token, bad_value)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pipeline.core.errors import SpecquantError
    from pipeline.core.io import read_json

    ap = argparse.ArgumentParser(prog="python -m pipeline.models.compat")
    ap.add_argument("drafter")
    ap.add_argument("target")
    ap.add_argument("--mask-token", default=None)
    args = ap.parse_args(argv)
    try:
        from pathlib import Path

        from pipeline.models.layout import light_config

        tok = None
        tok_file = Path(args.target) / "tokenizer.json"
        if tok_file.is_file():  # the Rust tokenizer alone: no torch/transformers import, answers in < 1 s
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_file))
        check_compatible(light_config(args.drafter), read_json(f"{args.target}/config.json", "target.path"),
                         tok, args.mask_token)
    except SpecquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("compatible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
