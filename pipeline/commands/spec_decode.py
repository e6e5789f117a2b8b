"""`python -m pipeline spec-decode --target DIR --drafter DIR --prompts DIR_OR_JSONL`: the reference loop's tau.

Greedy speculative decoding through `pipeline.models.spec_decode` (the loop evaluate runs), the drafter loaded
as evaluate loads it (a compressed-tensors checkpoint dequantized by `pipeline.evaluation.fakequant`); prints the
report as JSON (what `tau.json` of the tiny worlds holds). Also `python -m pipeline.commands.spec_decode ...`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pipeline.models.spec_decode import load_prompts, measure_tau


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline spec-decode",
                                 description="Measure the drafter's mean acceptance length tau (greedy).")
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True, help="a .jsonl with a `prompt` field, or a directory of them")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="prompts per file")
    ap.add_argument("--check-lossless", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 reproduces the shipped tau.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from pipeline.core.loading import load_target
    from pipeline.evaluation.fakequant import load_drafter_variant, read_quantization_config
    from pipeline.models import validation
    from pipeline.models.compat import check_compatible
    from pipeline.models.formats import load_drafter, load_drafter_config

    validation.check_target(args.target)  # every field of both families, before the target is loaded
    validation.check_drafter(args.drafter)
    target = load_target(args.target, dtype=torch.float32, field="--target")
    tok = AutoTokenizer.from_pretrained(args.target)
    check_compatible(load_drafter_config(args.drafter), target.config, tok)
    if read_quantization_config(args.drafter) is None:
        drafter = load_drafter(args.drafter, target=target)
    else:  # a compressed-tensors checkpoint (quantize-drafter's, or one trimmed from it): dequantized as evaluate does
        drafter = load_drafter_variant(args.drafter, target, torch.float32, "cpu")[0]
    stop = [t for t in [tok.eos_token_id] if t is not None]
    report = measure_tau(target, drafter, load_prompts(args.prompts, tok, args.limit), args.max_new_tokens,
                         stop, args.block_size, args.check_lossless)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`main`, with bad input as one sentence (exit 2) instead of a traceback."""
    from pipeline.core.errors import SpecquantError

    try:
        return main(argv)
    except SpecquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
