"""Build the tiny hybrid world: `python -m pipeline.tiny.build_hybrid [--seed N] [--steps N] [--measure N]`.

A 4-layer `qwen3_5_text` model (`Qwen3_5ForCausalLM`: three Gated DeltaNet layers, then one gated
full-attention layer, as Qwen3.5 / Qwen3.8 interleave them 3:1), hidden 256, the tiny world's
tokenizer (assets/tiny/target, copied) and corpus, written to assets/tiny-hybrid/target. The weights
come from the seed alone; `--steps N` (default TRAIN_STEPS) trains it on the corpus with the dense
target's recipe (`pipeline.tiny.train_target.fit`, one thread) and `--measure N` only times N training
steps and prints the step time (nothing is written). Then the DFlash drafter for it is trained by
`pipeline.tiny.train_drafter` (the dense world's recipe, DRAFTER_STEPS steps, on the hybrid target's greedy
replies to the tiny corpus) into assets/tiny-hybrid/drafter, and its tau measured on assets/tiny/eval;
`--drafter-only` keeps the target as it is. assets/tiny/ is read, never written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.core.io import atomic_write_bytes, atomic_write_json, atomic_write_text, read_json

ROOT = Path(__file__).resolve().parents[2] / "assets"
DENSE_ROOT, DEFAULT_ROOT = ROOT / "tiny", ROOT / "tiny-hybrid"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
ARCH = {  # the dense tiny target's shape, with Qwen3.5's hybrid layer mix and its linear-attention heads
    "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False, "max_position_embeddings": 1024,
    "layer_types": LAYER_TYPES, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
}
DRAFTER_STEPS = 1800  # the dense drafter's (train_drafter.TRAIN); assets/tiny-hybrid/README.md has the time
TRAIN_STEPS = 150  # ~1.4 s/step on one CPU thread (dense: ~0.7): the dense 400 would take ~9 min; docs/hybrid.md


def build_model(tok) -> torch.nn.Module:
    """The untrained hybrid target (weights from the global seed; call seed_everything first)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    ids = {"bos_token_id": None, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
           "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>")}
    cfg = Qwen3_5TextConfig(vocab_size=len(tok), **ARCH, **ids)
    cfg._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(cfg).float()


def measure(seqs, pad_id: int, model, steps: int) -> list[float]:
    """Seconds per training step (forward + backward + AdamW), batch and lr as the dense recipe's."""
    from pipeline.tiny import train_target

    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        train_target.fit(model, seqs, pad_id, seed=s, steps=1)
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pipeline.core.seeding import seed_everything
    from pipeline.tiny import train_target

    ap = argparse.ArgumentParser(prog="python -m pipeline.tiny.build_hybrid", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TRAIN_STEPS, help="training steps (0: the seeded init)")
    ap.add_argument("--measure", type=int, default=0, help="only time this many training steps")
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--drafter-steps", type=int, default=DRAFTER_STEPS, help="drafter training steps (0: no drafter)")
    ap.add_argument("--drafter-only", action="store_true", help="train the drafter on the target already built")
    args = ap.parse_args(argv)
    if args.drafter_only:
        return build_drafter(args.root, args.seed, args.drafter_steps)
    torch.set_num_threads(1)
    seed_everything(args.seed)
    tok = AutoTokenizer.from_pretrained(DENSE_ROOT / "target")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(tok)
    if args.measure or args.steps:
        seqs = train_target._encode_corpus(DENSE_ROOT, tok)
    if args.measure:
        times = measure(seqs, pad_id, model, args.measure)
        tokens = sum(len(s) for s, _ in seqs) / len(seqs) * train_target.TRAIN["batch_size"]
        print(f"hybrid step times (s): {[round(t, 2) for t in times]}; ~{tokens:.0f} tokens/step; "
              f"{train_target.TRAIN['steps']} steps ~ {sum(times[1:]) / max(1, len(times) - 1) * train_target.TRAIN['steps'] / 60:.0f} min")
        return 0
    losses = train_target.fit(model, seqs, pad_id, args.seed, args.steps) if args.steps else []
    out = args.root / "target"
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        for p in sorted(Path(tmp).iterdir()):
            atomic_write_bytes(out / p.name, p.read_bytes())
    for name in TOKENIZER_FILES:
        if (DENSE_ROOT / "target" / name).exists():
            shutil.copyfile(DENSE_ROOT / "target" / name, out / name)
    atomic_write_json(out / "training.json", {
        "seed": args.seed, "arch": ARCH, "steps": args.steps, "num_params": model.num_parameters(),
        "first_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4) if losses else None})
    print(f"tiny hybrid target written to {out} ({model.num_parameters():,} parameters, {args.steps} steps)")
    return build_drafter(args.root, args.seed, args.drafter_steps) if args.drafter_steps else 0


def build_drafter(root: Path, seed: int, steps: int) -> int:
    """The DFlash drafter of the hybrid target (root/drafter), trained as the dense world's is."""
    from pipeline.tiny import train_drafter

    world = _checkout_relative(root)
    train_drafter.train(root, seed=seed, steps=steps, data_root=DENSE_ROOT, readme={
        "world": world, "data": _checkout_relative(DENSE_ROOT),
        "rebuild": f"python -m pipeline.tiny.build_hybrid --drafter-only --root {world} --seed {seed}"})
    atomic_write_text(Path(root) / "README.md", render_readme(Path(root)))
    return 0


def render_readme(root: Path) -> str:
    """assets/tiny-hybrid/README.md from the two training.json files and tau.json (no timings: same bytes)."""
    t, d = read_json(root / "target" / "training.json"), read_json(root / "drafter" / "training.json")
    tau = read_json(root / "drafter" / "tau.json")
    kinds = t["arch"]["layer_types"]
    mix = " + ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
    return "\n".join([
        "# The tiny hybrid world", "",
        "The tiny world's stand-in for a Qwen3.5 / Qwen3.8 target (issue 35, docs/hybrid.md), rebuilt by",
        "`make assets` (`python -m pipeline.tiny.build_hybrid --seed 0`, after `pipeline.tiny.build`); the same",
        "seed rebuilds byte-identical files. Corpus, tokenizer and eval prompts are `../tiny`'s (read, never written).", "",
        f"- `target/` - a `qwen3_5_text` `Qwen3_5ForCausalLM` ({mix}; hidden {t['arch']['hidden_size']}, "
        f"{t['num_params']:,} parameters, bfloat16), trained {t['steps']} steps on the tiny corpus with the dense",
        f"  target's recipe: loss {t['first_loss']} -> {t['final_loss']}.",
        f"- `drafter/` - its DFlash drafter ({d['arch']['num_hidden_layers']} layers, block_size {d['block_size']}, aux "
        f"layers {d['aux_layer_ids']}), trained by `pipeline.tiny.train_drafter` on this target's greedy replies",
        f"  and hidden states ({d['num_sequences']} sequences), {d['train']['steps']} steps (the dense drafter's "
        f"count): loss {d['first_loss']} -> {d['final_loss']}.",
        f"  **Mean tau {tau['mean_tau']}** (greedy, block_size {tau['block_size']}, up to {tau['max_new_tokens']} new "
        f"tokens, the {sum(len(s['per_prompt_tau']) for s in tau['sets'].values())} prompts of `../tiny/eval`; "
        f"lossless mismatches: {tau['lossless_mismatches']}). `drafter/README.md` has the table.", "",
        "Build time on the shared 2-core CPU machine, one thread: docs/hybrid.md.", "",
        "## License", "",
        "As `../tiny`: generated corpus and weights trained on it, dedicated to the public domain under CC0 1.0.", ""])


def _checkout_relative(path: Path) -> str:
    """`assets/tiny-hybrid` for the shipped world (the verifier path vLLM resolves from the checkout root)."""
    path = Path(path).resolve()
    try:
        return path.relative_to(ROOT.parent).as_posix()
    except ValueError:
        return path.as_posix()


if __name__ == "__main__":
    sys.exit(main())
