"""Drafter/target compatibility, checked from configs (and the tokenizer) before any heavy work.

Each violation raises one `bad_value` sentence. The drafter's own fields are its family's validator's
(`pipeline.models.validation`: DFlash2's convolution group and taps, selector rank and top-K among them); here
they are checked against the target (hidden size, vocabulary, layers, the selector's top-K). The motivating case: a drafter built for another
model family (say a 256k-vocabulary Gemma drafter with another hidden size) paired with a Qwen
target must fail here, not as a shape error deep inside a forward pass.

CLI: `python -m pipeline.models.compat DRAFTER_DIR TARGET_DIR` prints "compatible" or the error.
"""

from __future__ import annotations

import sys
from pathlib import Path
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


def check_compatible(drafter_config, target_config, tokenizer=None, mask_token: str | None = None) -> None:
    """Raise `SpecquantError` (one sentence) if the drafter cannot run on this target/tokenizer."""
    from pipeline.core.errors import bad_value
    from pipeline.models.families import family_of
    from pipeline.models.validation import validate_drafter_config

    validate_drafter_config(drafter_config)  # the drafter's own fields (its family's validator)
    _check_hidden(drafter_config, target_config, bad_value)
    _check_vocab(drafter_config, target_config, tokenizer, bad_value)
    family_of(drafter_config).check_target(drafter_config, target_config)  # what the family adds (DFlash2's top-K)
    _check_layers(drafter_config, target_config, bad_value)
    _check_mask(drafter_config, tokenizer, mask_token, bad_value)



def check_checkpoints(drafter_path: str | Path, target_path: str | Path, fmt: str = "auto", revision: str | None = None,
               tokenizer=None, mask_token: str | None = None, where: str = "target"):
    """Both checkpoints validated (`check_target`, `check_drafter`), then the drafter against the target
    (`check_compatible`). Returns the drafter's light config."""
    from pipeline.models.validation import check_drafter, check_target

    target = check_target(target_path, revision, where)
    drafter = check_drafter(drafter_path, fmt)
    if target is not None:
        check_compatible(drafter, target, tokenizer, mask_token)
    return drafter


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

        tok = None
        tok_file = Path(args.target) / "tokenizer.json"
        if tok_file.is_file():  # the Rust tokenizer alone: no torch/transformers import, answers in < 1 s
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_file))
        from pipeline.models import validation

        validation.check_target(args.target)  # every field of both families, against their tensors' headers
        check_compatible(validation.check_drafter(args.drafter),
                         read_json(f"{args.target}/config.json", "target.path"), tok, args.mask_token)
    except SpecquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("compatible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
