"""Greedy speculative decoding with a DFlash drafter, and acceptance length (tau) measurement.

The loop follows z-lab's `dflash_generate` at temperature 0: prefill the target; then repeat
- draft a block `[last token, <mask> x (block_size-1)]` from the target's aux hidden states of
  the newly accepted tokens (the drafter keeps a KV cache of earlier context rows);
- the target verifies the block in one forward pass; the longest prefix of drafted tokens that
  equals the target's argmax is accepted, plus the target's own token after it (the bonus);
- tau for the step = accepted + 1.
A DFlash2 drafter with a candidate selector drafts its selector's greedy path (`draft_path`) instead
of the head's argmax, as it is served. The output is therefore exactly the target's plain greedy output.
Any module with the drafter's `draft_block` / `new_cache` / `config` interface can be passed (e.g. a
fake-quantized drafter), so evaluation can compare tau across drafter variants.

CLI: `python -m pipeline spec-decode --target DIR --drafter DIR --prompts DIR_OR_JSONL` (`pipeline.commands.spec_decode`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.core.errors import bad_value
from pipeline.models.target_steps import StepMemo, TargetSteps, aux_hidden, target_step  # noqa: F401 - re-exported
from pipeline.models.targets import decode_cache


@dataclass
class SpecResult:
    output_ids: list[int]  # prompt + generated tokens
    acceptance_lengths: list[int]  # tau per drafter call (accepted + 1)
    draft_calls: list[dict] = field(default_factory=list)  # cache_len_before, ctx_len, position_ids, draft_tokens
    drafted: list[int] = field(default_factory=list)  # per draft position k=1..B-1: how often drafted
    accepted: list[int] = field(default_factory=list)  # per draft position: how often accepted

    @property
    def mean_tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _finish(tokens: list[int], prompt_len: int, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    tokens = tokens[: prompt_len + max_new_tokens]
    for i in range(prompt_len, len(tokens)):
        if tokens[i] in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def greedy_generate(target, input_ids: list[int], max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Plain greedy decoding of the target with its KV cache (the reference for losslessness)."""
    dev = target.device
    cache = decode_cache(target).cache
    tokens = list(input_ids)
    ids = torch.tensor([tokens], device=dev)
    stop = set(stop_token_ids)
    for _ in range(max_new_tokens):
        logits, _ = target_step(target, ids, cache, False)
        nxt = int(logits[0, -1].argmax())
        tokens.append(nxt)
        if nxt in stop:
            break
        ids = torch.tensor([[nxt]], device=dev)
    return tokens


@torch.no_grad()
def spec_generate(target, drafter, input_ids: list[int], max_new_tokens: int, stop_token_ids=(),
                  block_size: int | None = None, trace: bool = False, memo: StepMemo | None = None) -> SpecResult:
    """Greedy speculative decoding; returns the tokens and per-step acceptance statistics. `memo`: target
    forwards of earlier decodes with this target, taken instead of running them again (same results;
    `pipeline.models.target_steps`)."""
    cfg = drafter.config
    bs = int(block_size or cfg.block_size)
    if not 2 <= bs <= cfg.block_size:
        raise bad_value("block_size", bs, f"the drafter drafts blocks of at most {cfg.block_size} tokens",
                        f"use 2 <= block_size <= {cfg.block_size}")
    dev, mask_id = target.device, int(cfg.mask_token_id)
    selector = bool(getattr(cfg, "has_selector", False)) and hasattr(drafter, "draft_path")  # DFlash2
    stop = set(stop_token_ids)
    prompt_len = len(input_ids)
    max_len = prompt_len + max_new_tokens
    steps, dcache = TargetSteps(target, decode_cache(target), list(cfg.aux_layer_ids), memo), drafter.new_cache()

    first, ctx = steps.prefill(list(input_ids))
    tokens = list(input_ids) + [first]
    res = SpecResult(output_ids=[], acceptance_lengths=[], drafted=[0] * (bs - 1), accepted=[0] * (bs - 1))
    start = prompt_len
    while start < max_len and tokens[start] not in stop:
        cache_len = len(dcache)
        block = torch.full((1, bs), mask_id, dtype=torch.long, device=dev)
        block[0, 0] = tokens[start]
        pos = torch.arange(cache_len, start + bs, device=dev)[None]
        if selector:
            draft = drafter.draft_path(ctx.to(drafter.fc.weight.dtype), block, pos, dcache).tokens[0]
        else:
            dlogits = drafter.draft_block(ctx.to(drafter.fc.weight.dtype), block, pos, dcache)
            draft = dlogits[0, 1:].argmax(-1)
        if trace:
            res.draft_calls.append({"cache_len_before": cache_len, "ctx_len": int(ctx.shape[1]),
                                    "position_ids": pos[0].tolist(), "draft_tokens": draft.tolist()})
        block[0, 1:] = draft
        posterior, acc, ctx = steps.verify(block, draft)
        tokens[start + 1:] = block[0, 1:acc + 1].tolist() + [int(posterior[acc])]
        for k in range(bs - 1):
            res.drafted[k] += 1
            res.accepted[k] += int(acc > k)
        res.acceptance_lengths.append(acc + 1)
        start += acc + 1
        if any(t in stop for t in tokens[start - acc:start + 1]):
            break
    res.output_ids = _finish(tokens, prompt_len, max_new_tokens, stop)
    return res


@torch.no_grad()
def is_target_greedy(target, output_ids: list[int], prompt_len: int) -> bool:
    """One teacher-forced forward: is every generated token the target's argmax after its prefix?

    Greedy decoding's output is the only sequence with this property, so this checks losslessness
    at the cost of one forward (tests also compare with `greedy_generate` token by token)."""
    if len(output_ids) <= prompt_len:
        return True
    ids = torch.tensor([output_ids[:-1]], device=target.device)
    pred = target(input_ids=ids).logits[0, prompt_len - 1:].argmax(-1)
    return pred.tolist() == output_ids[prompt_len:]


def load_prompts(path: str | Path, tokenizer, limit: int | None = None) -> dict[str, list[list[int]]]:
    """{set name: [chat-templated prompt ids]} from a *.jsonl file or a directory of them (field "prompt")."""
    p = Path(path)
    files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise bad_value("prompts", str(path), "no *.jsonl prompt files found", "point it at assets/tiny/eval or a .jsonl")
    sets: dict[str, list[list[int]]] = {}
    for f in files:
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        ids = []
        for row in rows[:limit]:
            enc = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                add_generation_prompt=True, tokenize=True)
            enc = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
            ids.append(list(enc))
        sets[f.stem] = ids
    return sets


def measure_tau(target, drafter, prompt_sets: dict[str, list[list[int]]], max_new_tokens: int,
                stop_token_ids=(), block_size: int | None = None, check_lossless: bool = False) -> dict:
    """Mean tau per prompt set and overall; `check_lossless` verifies each output is the target's greedy one."""
    report: dict = {"sets": {}, "max_new_tokens": max_new_tokens,
                    "block_size": int(block_size or drafter.config.block_size)}
    all_taus, mismatches = [], 0
    total = sum(len(v) for v in prompt_sets.values())
    bar = tqdm(total=total, desc="spec decode", disable=total < 2)
    for name, prompts in prompt_sets.items():
        taus, per_prompt = [], []
        for ids in prompts:
            r = spec_generate(target, drafter, ids, max_new_tokens, stop_token_ids, block_size)
            if check_lossless and not is_target_greedy(target, r.output_ids, len(ids)):
                mismatches += 1
            taus += r.acceptance_lengths
            per_prompt.append(round(r.mean_tau, 4))
            bar.update(1)
        report["sets"][name] = {"mean_tau": round(sum(taus) / max(len(taus), 1), 4), "steps": len(taus),
                                "per_prompt_tau": per_prompt}
        all_taus += taus
    bar.close()
    report["mean_tau"] = round(sum(all_taus) / max(len(all_taus), 1), 4)
    if check_lossless:
        report["lossless_mismatches"] = mismatches
    return report
