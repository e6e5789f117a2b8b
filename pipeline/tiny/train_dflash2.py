"""Train the tiny world's DFlash2 drafter (convolutions and candidate selector) on the tiny target.

Same data and anchored-block forward as the DFlash drafter (`pipeline.tiny.train_drafter`: the target's
greedy replies to every corpus prompt, its aux hidden states at HF layers [1, 3]), the same geometry plus
DFlash2's grouped dynamic convolution around every sublayer and its candidate selector. The loss adds,
to the decay-weighted cross-entropy of the head, the selector's: per draft slot the top-K candidates of
the head's logits are rescored (unary logit + pairwise score given the previous token of the target's
greedy path, teacher-forced: slot 1's previous token is the block's bonus token) and a cross-entropy over
those K scores is taken towards the target's token, on the slots where it is among the K (weighted as the
head's loss). Serving then drafts the selector's greedy path (`DFlashDrafter.draft_path`).

Trained from scratch with the DFlash drafter's settings (steps, schedule, batch, seed: `train_drafter.TRAIN`),
so the two are comparable; `training.json` records them, the README the measured loss and tau.

`python -m pipeline.tiny.train_dflash2 [--root assets/tiny] [--seed 0] [--steps N]`; `pipeline.tiny.build`
calls `main(root, seed=seed)` after the DFlash drafter (whose tau.json the README quotes beside this one's).
Output: `<root>/drafter-dflash2/` (speculators `dflash2` format: config.json + model.safetensors; training.json,
tau.json, README.md). Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.core.io import atomic_write_json, atomic_write_text
from pipeline.tiny import train_drafter as base

OUT = "drafter-dflash2"
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 8}
# the DFlash drafter's settings (same steps, schedule, batch and seed), plus the selector loss's weight
TRAIN = {**base.TRAIN, "selector_weight": 1.0}


def build_drafter(target, mask_token_id: int):
    """The DFlash drafter's geometry and fields (`train_drafter.build_drafter`) plus the DFlash2 fields."""
    from pipeline.models.dflash import DFlashConfig, DFlashDrafter

    dflash = base.build_drafter(target, mask_token_id)
    drafter = DFlashDrafter(DFlashConfig(**{**dflash.config.to_dict(), **DFLASH2}))
    drafter.attach_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter


def selector_loss(drafter, hidden: torch.Tensor, logits: torch.Tensor, batch: dict,
                  weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced selector cross-entropy over the top-K candidates of every draft slot.

    hidden [A*bs, H], logits [A*bs, V] of `forward`; weights [A*bs] (0 on bonus rows and masked slots).
    Returns the weighted mean loss and the fraction of weighted slots whose target token is in the top K."""
    from pipeline.models import calibration as C

    bs = drafter.config.block_size
    sel = drafter.candidate_selector
    anchors = batch["anchor_positions"][0]
    labels = C.block_labels(batch["input_ids"][0], anchors, bs).view(-1, bs)  # row k: token a+k
    previous = torch.cat([batch["input_ids"][0][anchors][:, None], labels[:, 1:-1]], 1)  # token a+k-1, k >= 1
    unary, candidates = logits.view(-1, bs, logits.shape[-1])[:, 1:].topk(sel.top_k, dim=-1)
    projected = sel.hidden_projection(hidden.view(-1, bs, hidden.shape[-1])[:, 1:])
    scores = unary + sel.pairwise(projected, previous, candidates).to(unary.dtype)  # [A, bs-1, K]
    hit = candidates == labels[:, 1:, None]
    w = weights.view(-1, bs)[:, 1:] * hit.any(-1).float()
    ce = F.cross_entropy(scores.reshape(-1, sel.top_k).float(), hit.float().argmax(-1).reshape(-1), reduction="none")
    coverage = w.sum() / weights.sum().clamp(min=1e-6)
    return (ce * w.reshape(-1)).sum() / w.sum().clamp(min=1e-6), coverage


def step_loss(drafter, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(total, head CE, selector CE) of one anchored batch; the head's loss is train_drafter's."""
    from pipeline.models import calibration as C

    bs = drafter.config.block_size
    anchors = batch["anchor_positions"][0]
    out = drafter(**batch)
    logits, hidden = out.logits[0], out.hidden_states[0]
    labels = C.block_labels(batch["input_ids"][0], anchors, bs)
    mask = C.aligned_loss_mask(batch["loss_mask"][0], anchors, batch["anchor_valid"][0], bs)
    k = torch.arange(mask.numel()) % bs
    w = mask * torch.exp(-(k - 1).clamp(min=0).float() / TRAIN["gamma"])
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    head = (ce * w).sum() / w.sum().clamp(min=1e-6)
    sel, _ = selector_loss(drafter, hidden, logits, batch, w)
    return head + TRAIN["selector_weight"] * sel, head, sel


def fit(drafter, samples: list[dict], seed: int, steps: int) -> dict[str, list[float]]:
    return base.fit_terms(drafter, samples, seed, steps, step_loss, ("total", "head", "selector"),
                          "train tiny DFlash2 drafter")


def measure(root: Path, target=None, tok=None, limit: int | None = None) -> dict:
    """Mean tau (block_size 8, greedy, the selector's path) of `<root>/drafter-dflash2`, checked lossless."""
    return base.measure(root, target, tok, limit=limit, drafter_dir=OUT)


def render_readme(report: dict, tau: dict, dflash_tau: dict | None) -> str:
    sets = "\n".join(f"| {name} | {s['mean_tau']} | "
                     f"{dflash_tau['sets'][name]['mean_tau'] if dflash_tau else '-'} | {s['steps']} | "
                     f"{len(s['per_prompt_tau'])} |" for name, s in tau["sets"].items())
    f = report["dflash2"]
    return "\n".join([
        "# Tiny DFlash2 drafter (speculators `dflash2` format)", "",
        f"A {report['arch']['num_hidden_layers']}-layer DFlash2 drafter (hidden {report['arch']['hidden_size']}, "
        f"block_size {report['block_size']}; the geometry of the DFlash drafter in `../drafter`) for the tiny",
        "target in `../target`: DFlash plus a grouped dynamic convolution",
        f"around every attention and MLP sublayer (`conv_kernel_size` {f['conv_kernel_size']}, `conv_group_size` "
        f"{f['conv_group_size']}) and a candidate selector (`selector_rank` {f['selector_rank']}, `selector_top_k` "
        f"{f['selector_top_k']}),",
        "trained on CPU by `pipeline/tiny/train_dflash2.py` on the same data as the DFlash drafter (the target's",
        "own hidden states and greedy replies to the corpus prompts).", "",
        "- Format: speculators `dflash2` (`speculators_model_type: dflash2`, the four DFlash2 fields flat);",
        "  codebooks bare (`candidate_selector.{predecessor,successor}_codebook`, no `.weight`); weights hold",
        "  only the drafter's own tensors - `embed_tokens` and `lm_head` come from the target at load time.",
        f"- Aux layers: `aux_hidden_state_layer_ids` = {report['aux_layer_ids']}; verifier "
        f"`{base.VERIFIER}` (from the checkout root).",
        "- Start: from scratch (DFlash2's convolutions start as the identity, its selector codebooks at",
        "  normal(0.02)), with the DFlash drafter's settings (steps, schedule, batch, seed).",
        "- Loss: the DFlash drafter's decay-weighted cross-entropy of the head, plus the selector's",
        "  cross-entropy over its top-K candidates' scores (unary logit + pairwise score given the previous",
        "  token of the target's path, teacher-forced) towards the target's token, where it is in the top K.",
        f"- Training: seed {report['seed']}, {report['train']['steps']} steps, {report['num_sequences']} sequences "
        f"({report['num_reply_tokens']:,} reply tokens);",
        f"  loss (head + selector) {report['first_loss']} -> {report['final_loss']}, head "
        f"{report['first_head_loss']} -> {report['final_head_loss']}, selector {report['first_selector_loss']} -> "
        f"{report['final_selector_loss']} (means of the last 50 steps). Settings in `training.json`.", "",
        "## Acceptance length", "",
        f"**Mean tau = {tau['mean_tau']}** (DFlash drafter: {dflash_tau['mean_tau'] if dflash_tau else '-'}; "
        "accepted drafted tokens + 1 per step; greedy, the selector's path,",
        f"block_size {tau['block_size']}, up to {tau['max_new_tokens']} new tokens, every prompt of "
        "`../eval/*.jsonl` chat-templated with the generation prompt).",
        "The speculative output equalled plain greedy decoding on every prompt (mismatches: "
        f"{tau['lossless_mismatches']}).", "",
        "| prompt set | mean tau | DFlash drafter | steps | prompts |", "|---|---|---|---|---|", sets, "",
        "Reproduce (prints the same JSON as `tau.json`):", "",
        "```bash",
        ".venv/bin/python -m pipeline spec-decode --target assets/tiny/target \\",
        f"    --drafter assets/tiny/{OUT} --prompts assets/tiny/eval --max-new-tokens "
        f"{base.EVAL['max_new_tokens']} --block-size {base.BLOCK_SIZE} --check-lossless",
        "```", "",
        "Rebuild: `.venv/bin/python -m pipeline.tiny.train_dflash2 --root assets/tiny --seed 0`",
        "(part of `make assets`, after the DFlash drafter).", "",
    ])


def train(root: str | Path, seed: int = 0, steps: int | None = None, max_prompts: int | None = None,
          eval_limit: int | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.core.io import read_json
    from pipeline.core.seeding import seed_everything
    from pipeline.models.formats import save_speculators
    from pipeline.tiny.tokenizer import MASK_TOKEN

    root = Path(root)
    steps = TRAIN["steps"] if steps is None else steps
    torch.set_num_threads(TRAIN["threads"])
    seed_everything(seed)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(root / "target")
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    samples = base.cache_samples(target, base.greedy_sequences(target, tok, base.training_prompts(root)[:max_prompts]))
    t_data = time.time() - t0
    drafter = build_drafter(target, tok.convert_tokens_to_ids(MASK_TOKEN))
    hist = fit(drafter, samples, seed, steps)
    t_train = time.time() - t0 - t_data
    save_speculators(drafter, root / OUT)

    def last(key: str) -> float:
        return round(sum(hist[key][-50:]) / len(hist[key][-50:]), 4)

    report = {"seed": seed, "arch": base.ARCH, "dflash2": DFLASH2, "aux_layer_ids": base.AUX_LAYER_IDS,
              "block_size": base.BLOCK_SIZE, "train": {**TRAIN, "steps": steps}, "generation": base.GEN,
              "num_sequences": len(samples),
              "num_reply_tokens": int(sum(int(s["loss_mask"].sum()) for s in samples)),
              "first_loss": round(hist["total"][0], 4), "final_loss": last("total"),
              "first_head_loss": round(hist["head"][0], 4), "final_head_loss": last("head"),
              "first_selector_loss": round(hist["selector"][0], 4), "final_selector_loss": last("selector")}
    atomic_write_json(root / OUT / "training.json", report)
    tau = measure(root, target, tok, limit=eval_limit)
    atomic_write_json(root / OUT / "tau.json", tau)
    dflash_tau = read_json(root / "drafter" / "tau.json") if (root / "drafter" / "tau.json").exists() else None
    atomic_write_text(root / OUT / "README.md", render_readme(report, tau, dflash_tau))
    # timings are printed, not saved, so a rebuild with the same seed writes the same bytes
    print(f"tiny DFlash2 drafter: data {t_data:.0f}s, {steps} steps {t_train:.0f}s, eval "
          f"{time.time() - t0 - t_data - t_train:.0f}s; loss {report['first_loss']} -> {report['final_loss']}; "
          f"mean tau {tau['mean_tau']} (mismatches {tau['lossless_mismatches']})")
    return {**report, "tau": tau}


def main(argv: list[str] | str | Path | None = None, seed: int | None = None) -> dict | int:
    """CLI `main(argv)`, or `main(root, seed=...)` as `pipeline.tiny.build` calls it."""
    if isinstance(argv, (str, Path)):
        return train(argv, seed=seed or 0)
    ap = argparse.ArgumentParser(prog="python -m pipeline.tiny.train_dflash2", description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=base.DEFAULT_ROOT)
    ap.add_argument("--seed", type=int, default=0 if seed is None else seed)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--max-prompts", type=int, default=None, help="train on the first N corpus prompts (smoke runs)")
    ap.add_argument("--eval-limit", type=int, default=None, help="prompts per eval set (smoke runs)")
    ap.add_argument("--measure-only", action="store_true", help="only re-measure tau of the saved drafter")
    args = ap.parse_args(argv)
    if args.measure_only:
        torch.set_num_threads(TRAIN["threads"])
        print(measure(args.root, limit=args.eval_limit))
        return 0
    train(args.root, args.seed, args.steps, args.max_prompts, args.eval_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
