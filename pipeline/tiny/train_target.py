"""Train the tiny world's target: a 4-layer Qwen3ForCausalLM fitted to the templated corpus on CPU.

A fixed number of steps (not a time budget) so the same seed gives the same weights; saved in
bfloat16 safetensors to keep the asset small (it loads fine with dtype=torch.float32).
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.core.io import atomic_write_bytes, atomic_write_json
from pipeline.tiny.corpus import SUBSETS, load_conversations, read_jsonl
from pipeline.tiny.tokenizer import render

ARCH = {  # the target's shape; vocab_size comes from the tokenizer
    "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False, "rope_theta": 1e6,
    "max_position_embeddings": 1024,
}
# one thread: on a shared 2-core machine a second thread mostly waits at barriers (measured 3-5x slower).
# loss on all tokens: on held-apart prompts it formed replies as well as assistant-only loss and
# copied function names more often (8/20 vs 6/20 at 400 steps)
TRAIN = {"steps": 400, "batch_size": 16, "lr": 3e-3, "warmup_steps": 30, "weight_decay": 0.01, "threads": 1,
         "loss_on": "all"}
MAX_NEW_TOKENS = 120
# Massive activations, as real LLMs have them (Sun et al. 2024, "Massive activations in large language
# models"): a few fixed residual-stream channels carry values of thousands at attention-sink tokens
# (the first token, delimiters), through every middle layer. Qwen models reach ~1e4, beyond the
# 448*6 = 2688 a fixed NVFP4 activation global scale of 1.0 can represent. Here the sink token's
# embedding carries them (held fixed through training), so the target learns with them in place and
# every aux-layer hidden state at a turn start has them.
MASSIVE = {"token": "<|im_start|>", "channels": {17: 9216.0, 201: -4608.0}}


def build_model(vocab_size: int, tok) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ids = {"bos_token_id": None, "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
           "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>")}
    cfg = Qwen3Config(vocab_size=vocab_size, **ARCH, **ids, attn_implementation="sdpa")
    return Qwen3ForCausalLM(cfg)


def encode_conversation(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one chat-rendered conversation; mask = 1 on assistant replies + <|im_end|>."""
    ids: list[int] = []
    mask: list[int] = []
    for m in messages:
        # pieces tokenize as the whole text does: special tokens and newlines are pre-token boundaries
        for piece, on in ((f"<|im_start|>{m['role']}\n", 0), (m["content"], 1), ("<|im_end|>", 1), ("\n", 0)):
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
            ids += piece_ids
            mask += [int(on and m["role"] == "assistant")] * len(piece_ids)
    return ids, mask


def _encode_corpus(root: Path, tok) -> list[tuple[list[int], list[int]]]:
    return [encode_conversation(tok, msgs) for _, msgs in load_conversations(root)]


def _batch(seqs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    # right padding needs no attention mask under a causal mask: pads only follow real tokens
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, mask) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        if TRAIN["loss_on"] == "all":
            mask = [1] * len(s)
        labels[i, : len(s)] = torch.where(torch.tensor(mask) == 1, torch.tensor(s), -100)
    return ids, labels


def _lr_at(step: int) -> float:
    if step < TRAIN["warmup_steps"]:
        return TRAIN["lr"] * (step + 1) / TRAIN["warmup_steps"]
    frac = (step - TRAIN["warmup_steps"]) / max(1, TRAIN["steps"] - TRAIN["warmup_steps"])
    return TRAIN["lr"] * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def _epoch_batches(seqs: list[tuple[list[int], list[int]]], rng: random.Random) -> list[list[int]]:
    """One shuffled epoch in batches of similar length (less padding: CPU time is the budget)."""
    order = list(range(len(seqs)))
    rng.shuffle(order)
    bs, batches = TRAIN["batch_size"], []
    for start in range(0, len(order), bs * 8):
        group = sorted(order[start:start + bs * 8], key=lambda i: (len(seqs[i][0]), i))
        batches += [group[k:k + bs] for k in range(0, len(group), bs)]
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def set_massive(model: torch.nn.Module, token_id: int) -> None:
    """Write MASSIVE's values into the sink token's embedding row (before training and after every step)."""
    row = model.get_input_embeddings().weight[token_id]
    for ch, value in MASSIVE["channels"].items():
        row[ch] = value


def fit(model: torch.nn.Module, seqs: list[tuple[list[int], list[int]]], pad_id: int, seed: int, steps: int,
        sink_id: int | None = None) -> list[float]:
    """Train on the assistant tokens (or all, per TRAIN["loss_on"]); returns the per-step loss.
    With `sink_id`, MASSIVE's values sit in that token's embedding from the start and stay there."""
    if sink_id is not None:
        set_massive(model, sink_id)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"],
                            betas=(0.9, 0.95))
    batches: list[list[int]] = []
    losses = []
    model.train()
    for step in tqdm(range(steps), desc="train tiny target", unit="step"):
        if not batches:
            batches = _epoch_batches(seqs, rng)
        picked = batches.pop()
        ids, labels = _batch([seqs[i] for i in picked], pad_id)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sink_id is not None:  # AdamW's decay and updates would shrink them: held fixed
            set_massive(model, sink_id)
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def greedy(model, tok, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """The target's greedy reply to one user prompt after the chat template's generation prompt."""
    text = render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False)


def _save_atomically(model, target_dir: Path) -> None:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        for p in sorted(Path(tmp).iterdir()):
            atomic_write_bytes(target_dir / p.name, p.read_bytes())
    model.to(torch.float32)


def main(root: str | Path, seed: int = 0, steps: int | None = None) -> dict:
    """Train and save the target into root/target (the tokenizer must already be there)."""
    from transformers import AutoTokenizer

    from pipeline.core.seeding import seed_everything

    root = Path(root)
    steps = TRAIN["steps"] if steps is None else steps
    torch.set_num_threads(TRAIN["threads"])
    seed_everything(seed)
    tok = AutoTokenizer.from_pretrained(root / "target")
    seqs = _encode_corpus(root, tok)
    model = build_model(len(tok), tok)
    t0 = time.time()
    losses = fit(model, seqs, tok.convert_tokens_to_ids("<|endoftext|>"), seed, steps,
                 tok.convert_tokens_to_ids(MASSIVE["token"]))
    wall = time.time() - t0
    _save_atomically(model, root / "target")
    samples = {s: {"prompt": (p := read_jsonl(root / "eval" / f"{s}.jsonl")[0]["prompt"]),
                   "greedy": greedy(model, tok, p)} for s in SUBSETS}
    report = {"seed": seed, "arch": ARCH, "train": {**TRAIN, "steps": steps}, "massive": MASSIVE,
              "num_params": model.num_parameters(),
              "num_sequences": len(seqs), "num_tokens": sum(len(s) for s, _ in seqs),
              "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "first_loss": round(losses[0], 4),
              "samples": samples}
    # wall time is printed, not saved, so a rebuild with the same seed writes the same bytes
    atomic_write_json(root / "target" / "training.json", report)
    print(f"tiny target: {steps} steps in {wall:.0f}s, loss {report['first_loss']} -> {report['final_loss']}")
    return report
