"""Train the tiny world's DFlash drafter on the tiny target's own hidden states and greedy replies.

Recipe (CPU, 1 thread, fixed step count so the same seed gives the same bytes):
1. prompts = every corpus conversation up to each assistant turn, chat-templated with the
   generation prompt; the target's greedy continuation of each is generated (batched, left pad);
2. one target forward per sequence gives the aux hidden states (HF indices `AUX_LAYER_IDS`);
3. anchored-block training with `pipeline.models.calibration` batches (the same forward that
   calibration uses): cross-entropy on the target's greedy tokens for block slots 1..7, weighted
   exp(-(k-1)/gamma) as in DFlash;
4. saved in speculators format to `<root>/drafter` (verifier `assets/tiny/target`, from the
   checkout root), then mean tau (block_size 8) is measured on `<root>/eval/*.jsonl` and written to
   `tau.json` and `README.md`.

`python -m pipeline.tiny.train_drafter [--root assets/tiny] [--seed 0]`; `pipeline.tiny.build`
calls `main(root, seed=seed)`.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.core.io import atomic_write_json, atomic_write_text

ARCH = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}
AUX_LAYER_IDS = [1, 3]  # HF output_hidden_states indices (= z-lab target_layer_ids [0, 2]) of the 4-layer target
BLOCK_SIZE = 8
TRAIN = {"steps": 1800, "seqs_per_step": 2, "anchors_per_step": 64, "lr": 3e-3, "warmup_steps": 60,
         "weight_decay": 0.01, "gamma": 7.0,
         # one thread: on the shared 2-core machine two OpenMP threads ran 10x slower (oversubscribed)
         "threads": 1}
GEN = {"max_new_tokens": 120, "batch_size": 128}
EVAL = {"max_new_tokens": 120, "block_size": BLOCK_SIZE}
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "assets" / "tiny"


def training_prompts(root: Path) -> list[str]:
    """Each conversation up to each of its assistant turns, rendered with the generation prompt."""
    from pipeline.tiny.corpus import load_conversations
    from pipeline.tiny.tokenizer import render

    seen, out = set(), []
    for _, msgs in load_conversations(root):
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                text = render(msgs[:i], add_generation_prompt=True)
                if text not in seen:
                    seen.add(text)
                    out.append(text)
    return out


@torch.no_grad()
def greedy_sequences(target, tok, prompts: list[str]) -> list[tuple[list[int], int]]:
    """(prompt + greedy continuation ids, prompt length) per prompt; batched with left padding."""
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(enc)), key=lambda i: (len(enc[i]), i))
    pad, eos = target.config.pad_token_id, target.config.eos_token_id
    out: list = [None] * len(enc)
    bs = GEN["batch_size"]
    for s in tqdm(range(0, len(order), bs), desc="greedy replies", unit="batch"):
        idx = order[s:s + bs]
        width = max(len(enc[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(enc[i]):] = torch.tensor(enc[i])
            att[r, width - len(enc[i]):] = 1
        gen = target.generate(input_ids=ids, attention_mask=att, max_new_tokens=GEN["max_new_tokens"],
                              do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for r, i in enumerate(idx):
            cont = gen[r, width:].tolist()
            if eos in cont:
                cont = cont[: cont.index(eos) + 1]
            out[i] = (enc[i] + cont, len(enc[i]))
    return out


@torch.no_grad()
def cache_samples(target, seqs: list[tuple[list[int], int]], batch_size: int = 32) -> list[dict]:
    """Cache-reader-shaped samples: input_ids, loss_mask (1 on the reply), hidden_states [T, n_aux, H].

    Batched with right padding: under the causal mask real tokens never see the pads after them."""
    samples = []
    pad = target.config.pad_token_id
    for s in tqdm(range(0, len(seqs), batch_size), desc="target hidden states", unit="batch"):
        chunk = seqs[s:s + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        x = torch.full((len(chunk), width), pad, dtype=torch.long)
        for r, (ids, _) in enumerate(chunk):
            x[r, :len(ids)] = torch.tensor(ids)
        hs = target(input_ids=x, output_hidden_states=True).hidden_states
        for r, (ids, plen) in enumerate(chunk):
            aux = torch.stack([hs[m][r, :len(ids)] for m in AUX_LAYER_IDS], dim=1)
            mask = torch.zeros(len(ids), dtype=torch.long)
            mask[plen:] = 1
            samples.append({"input_ids": torch.tensor(ids), "loss_mask": mask, "hidden_states": aux.float().clone()})
    return samples


def _lr_at(step: int, steps: int) -> float:
    if step < TRAIN["warmup_steps"]:
        return TRAIN["lr"] * (step + 1) / TRAIN["warmup_steps"]
    frac = (step - TRAIN["warmup_steps"]) / max(1, steps - TRAIN["warmup_steps"])
    return TRAIN["lr"] * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def block_loss(drafter, batch: dict) -> torch.Tensor:
    """Decay-weighted CE of each block slot k >= 1 against the sequence's (greedy) token a+k."""
    from pipeline.models import calibration as C

    bs = drafter.config.block_size
    anchors = batch["anchor_positions"][0]
    logits = drafter(**batch).logits[0]
    labels = C.block_labels(batch["input_ids"][0], anchors, bs)
    mask = C.aligned_loss_mask(batch["loss_mask"][0], anchors, batch["anchor_valid"][0], bs)
    k = torch.arange(mask.numel()) % bs
    w = mask * torch.exp(-(k - 1).clamp(min=0).float() / TRAIN["gamma"])
    ce = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


# the target as vLLM and the pipeline find it from the checkout root (pipeline/serving/contract.py)
VERIFIER = "assets/tiny/target"


def build_drafter(target, mask_token_id: int, verifier: str = VERIFIER):
    from pipeline.models.dflash import DFlashConfig, DFlashDrafter

    tc = target.config
    # the drafter's RoPE rotates its whole head: a hybrid target's partial rotary (Qwen3.5: 0.25 of its head) is
    # the target's own; copied into the drafter's config vLLM would rotate only that part of the drafter's heads
    rope = {k: v for k, v in dict(tc.rope_parameters).items() if k not in ("partial_rotary_factor", "rope_dim")}
    cfg = DFlashConfig(**ARCH, vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps,
                       max_position_embeddings=tc.max_position_embeddings,
                       rope_parameters=rope, block_size=BLOCK_SIZE,
                       mask_token_id=mask_token_id, aux_layer_ids=AUX_LAYER_IDS,
                       num_target_layers=tc.num_hidden_layers, eos_token_id=tc.eos_token_id,
                       pad_token_id=tc.pad_token_id, verifier_name_or_path=verifier,
                       verifier_architectures=list(tc.architectures or ["Qwen3ForCausalLM"]), dtype="float32")
    drafter = DFlashDrafter(cfg)
    drafter.attach_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter


def fit_terms(drafter, samples: list[dict], seed: int, steps: int, loss_terms, names: tuple[str, ...],
              desc: str) -> dict[str, list[float]]:
    """The seeded training loop both tiny drafters share (AdamW, warmup + cosine, clipped): `loss_terms(drafter,
    batch)` returns one tensor per name, the first the one optimized; every term is recorded per step."""
    from pipeline.models.calibration import build_calibration_batch

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=TRAIN["lr"], weight_decay=TRAIN["weight_decay"], betas=(0.9, 0.95))
    order: list[int] = []
    hist: dict[str, list[float]] = {n: [] for n in names}
    drafter.train()
    for step in tqdm(range(steps), desc=desc, unit="step"):
        picked = []
        for _ in range(TRAIN["seqs_per_step"]):
            if not order:
                order = list(range(len(samples)))
                rng.shuffle(order)
            picked.append(samples[order.pop()])
        batch = build_calibration_batch(picked, TRAIN["anchors_per_step"], BLOCK_SIZE,
                                        drafter.config.mask_token_id, gen)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps)
        terms = loss_terms(drafter, batch)
        opt.zero_grad(set_to_none=True)
        terms[0].backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for n, v in zip(names, terms):
            hist[n].append(v.item())
    drafter.eval()
    return hist


def fit(drafter, samples: list[dict], seed: int, steps: int) -> list[float]:
    return fit_terms(drafter, samples, seed, steps, lambda d, b: (block_loss(d, b),), ("loss",),
                     "train tiny drafter")["loss"]


def measure(root: Path, target=None, tok=None, drafter=None, limit: int | None = None,
            eval_root: Path | None = None, drafter_dir: str = "drafter") -> dict:
    """Mean tau (block_size 8, greedy; a DFlash2 drafter drafts along its selector's path) of the saved drafter
    `<root>/<drafter_dir>` on (eval_root or root)/eval/*.jsonl, checked lossless."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.models.formats import load_drafter
    from pipeline.models.spec_decode import load_prompts, measure_tau

    tok = tok or AutoTokenizer.from_pretrained(root / "target")
    target = target or AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    drafter = drafter or load_drafter(root / drafter_dir, target=target)
    sets = load_prompts(Path(eval_root or root) / "eval", tok, limit)
    return measure_tau(target, drafter, sets, EVAL["max_new_tokens"], [tok.eos_token_id], EVAL["block_size"],
                       check_lossless=True)


def render_readme(report: dict, tau: dict, world: str = "assets/tiny", data: str = "assets/tiny",
                  rebuild: str = "python -m pipeline.tiny.train_drafter --root assets/tiny --seed 0") -> str:
    sets = "\n".join(f"| {name} | {s['mean_tau']} | {s['steps']} | {len(s['per_prompt_tau'])} |"
                     for name, s in tau["sets"].items())
    return "\n".join([
        "# Tiny DFlash drafter (speculators format)", "",
        f"A {ARCH['num_hidden_layers']}-layer DFlash drafter (hidden {ARCH['hidden_size']}, block_size "
        f"{BLOCK_SIZE}) for the tiny target in `../target`, trained on CPU by `pipeline/tiny/train_drafter.py`",
        "on the target's own hidden states and greedy replies to the corpus prompts.", "",
        "- Format: speculators (`speculators_model_type: dflash`); weights hold only the drafter's own",
        "  tensors - `embed_tokens` and `lm_head` come from the target at load time.",
        f"- Aux layers: `aux_hidden_state_layer_ids` = {AUX_LAYER_IDS} (HF `output_hidden_states` indices;",
        f"  z-lab `target_layer_ids` = {[m - 1 for m in AUX_LAYER_IDS]}).",
        f"- Verifier: `speculators_config.verifier.name_or_path` = `{world}/target`, the target's path from the",
        "  checkout root, where `vllm serve` and the pipeline run (vLLM resolves it against its working",
        "  directory; `pipeline.models.formats.load_drafter` tries the drafter's folder first, then the CWD).",
        f"- Training: seed {report['seed']}, {report['train']['steps']} steps, {report['num_sequences']} "
        f"sequences ({report['num_reply_tokens']:,} reply tokens); loss {report['first_loss']} -> "
        f"{report['final_loss']} (mean of the last 50 steps). Settings in `training.json`.", "",
        "## Acceptance length", "",
        f"**Mean tau = {tau['mean_tau']}** (accepted drafted tokens + 1 per step; greedy, block_size "
        f"{tau['block_size']}, up to {tau['max_new_tokens']} new tokens, every prompt of `../eval/*.jsonl`",
        "chat-templated with the generation prompt). The speculative output equalled plain greedy",
        f"decoding on every prompt (mismatches: {tau['lossless_mismatches']}).", "",
        "| prompt set | mean tau | steps | prompts |", "|---|---|---|---|", sets, "",
        "Reproduce (prints the same JSON as `tau.json`):", "",
        "```bash",
        f".venv/bin/python -m pipeline spec-decode --target {world}/target \\",
        f"    --drafter {world}/drafter --prompts {data}/eval --max-new-tokens "
        f"{EVAL['max_new_tokens']} --block-size {BLOCK_SIZE} --check-lossless",
        "```", "",
        f"Rebuild: `.venv/bin/{rebuild}`",
        "(part of `make assets`).", "",
    ])


def train(root: str | Path, seed: int = 0, steps: int | None = None, max_prompts: int | None = None,
          eval_limit: int | None = None, data_root: str | Path | None = None, readme: dict | None = None) -> dict:
    """Generate data, train, save, measure. `max_prompts` / `eval_limit` shrink it for smoke tests.

    `data_root` (default `root`) holds the corpus and eval prompts, `root` the target and the drafter written;
    `readme` overrides `render_readme`'s paths (world, data, rebuild) for another world (the hybrid one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    data_root = Path(data_root or root)
    readme = {"world": "assets/tiny", **(readme or {})}
    samples = cache_samples(target, greedy_sequences(target, tok, training_prompts(data_root)[:max_prompts]))
    t_data = time.time() - t0
    drafter = build_drafter(target, tok.convert_tokens_to_ids(MASK_TOKEN), f"{readme['world']}/target")
    losses = fit(drafter, samples, seed, steps)
    t_train = time.time() - t0 - t_data
    save_speculators(drafter, root / "drafter")
    report = {"seed": seed, "arch": ARCH, "aux_layer_ids": AUX_LAYER_IDS, "block_size": BLOCK_SIZE,
              "train": {**TRAIN, "steps": steps}, "generation": GEN, "num_sequences": len(samples),
              "num_reply_tokens": int(sum(int(s["loss_mask"].sum()) for s in samples)),
              "first_loss": round(losses[0], 4), "final_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)}
    atomic_write_json(root / "drafter" / "training.json", report)
    tau = measure(root, target, tok, limit=eval_limit, eval_root=data_root)
    atomic_write_json(root / "drafter" / "tau.json", tau)
    atomic_write_text(root / "drafter" / "README.md", render_readme(report, tau, **readme))
    # timings are printed, not saved, so a rebuild with the same seed writes the same bytes
    print(f"tiny drafter: data {t_data:.0f}s, {steps} steps {t_train:.0f}s, eval {time.time() - t0 - t_data - t_train:.0f}s;"
          f" loss {report['first_loss']} -> {report['final_loss']}; mean tau {tau['mean_tau']}")
    return {**report, "tau": tau}


def main(argv: list[str] | str | Path | None = None, seed: int | None = None) -> dict | int:
    """CLI `main(argv)`, or `main(root, seed=...)` as `pipeline.tiny.build` calls it."""
    if isinstance(argv, (str, Path)):
        return train(argv, seed=seed or 0)
    ap = argparse.ArgumentParser(prog="python -m pipeline.tiny.train_drafter", description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    ap.add_argument("--seed", type=int, default=0 if seed is None else seed)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--measure-only", action="store_true", help="only re-measure tau of the saved drafter")
    args = ap.parse_args(argv)
    if args.measure_only:
        torch.set_num_threads(TRAIN["threads"])
        print(measure(args.root))
        return 0
    train(args.root, args.seed, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
