"""What a vocabulary-trimmed draft head costs in acceptance length (tau).

    python -m bench.draft_vocab --run runs/tiny --fractions 1.0,0.5,0.25,0.21,0.125,0.0625 \
        --variants bf16,w4a16 --json bench/results/<date>-tiny-draft-vocab.json

vLLM can serve a DFlash drafter whose config has `draft_vocab_size` = N < the target's vocabulary: the
drafter ships its own `lm_head.weight` [N, hidden] (the target's head rows of the N kept tokens) and `d2t`
(int64 [N], target id = draft id + d2t[draft id]), so it can never propose a token outside those N. The
reference loop's equivalent, measured here: the drafter's logits restricted to the kept ids (every other id
-inf, a forward hook on the drafter's `lm_head`; `restricted_head`) before its argmax; the target verifies
as before (greedy, so the output must stay the target's own).

Kept ids: the N = round(f x vocab) most frequent ids (ties: lower id first) among the assistant tokens
(loss mask 1) of the run's calibration blend, `data/samples.jsonl` (the tokens the drafter is trained to
propose; EAGLE-3 and speculators build `d2t` from the same counts). vocab is the target config's.

Everything else is the evaluate stage's, read from the run: its config and target as recorded in
`eval/results.json`, its prompt sets (`pipeline.evaluation.prompts.load_prompt_sets`), the target loaded by
`pipeline.evaluation.fakequant.load_target`, each drafter variant by `load_drafter_variant`, the greedy
reference by `evaluate._greedy_reference`, the loop `spec_generate`, tau by `evaluate.subset_stats`. f = 1.0
(always run, added when not asked for) must reproduce the evaluate stage's tau of each variant exactly; the
bench stops with exit 1 when it does not. Bad input: one sentence, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from pipeline.core.errors import SpecquantError, bad_value
from pipeline.models.draft_vocab import assistant_counts, kept_ids  # the rule `convert --draft-vocab` writes

FULL = 1.0


class ReproductionError(Exception):
    """f = 1.0 did not reproduce the evaluate stage's tau (a measurement failure, not bad input: exit 1)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own complaints: one sentence, exit 2, like every other refusal
        self.exit(2, f"error: {message}; see `python -m bench.draft_vocab --help`.\n")


# ---------------------------------------------------------------- arguments, checked before any heavy import
def parse_fractions(text: str) -> list[float]:
    """'1.0,0.5' -> [1.0, 0.5] (order kept, duplicates dropped); every value in (0, 1]."""
    out: list[float] = []
    for part in str(text).split(","):
        try:
            f = float(part)
        except ValueError:
            raise bad_value("--fractions", text, f"{part.strip()!r} is not a number",
                            "give comma-separated fractions in (0, 1], e.g. 1.0,0.5,0.25") from None
        if not 0.0 < f <= 1.0:
            raise bad_value("--fractions", text, f"{part.strip()} is outside (0, 1]",
                            "give comma-separated fractions in (0, 1], e.g. 1.0,0.5,0.25")
        if f not in out:
            out.append(f)
    return out


def keep_size(fraction: float, vocab: int) -> int:
    """N = round(fraction x vocab), at least one token."""
    n = int(round(fraction * vocab))
    if n < 1:
        raise bad_value("--fractions", fraction, f"it keeps round({fraction} x {vocab}) = 0 tokens",
                        f"use a fraction >= {1 / (2 * vocab):.3g}")
    return n


def check_run(run: Path) -> None:
    """The run directory holds the data stage's blend and the evaluate stage's results."""
    if not run.is_dir():
        raise bad_value("--run", str(run), "no such run directory", "run `make all` first or point it at runs/<run_name>")
    if not (run / "data" / "meta.json").is_file():
        raise bad_value("--run", str(run), "it has no calibration blend (data/meta.json)", "run `make data` for it first")
    if not (run / "eval" / "results.json").is_file():
        raise bad_value("--run", str(run), "it has no eval/results.json", "run `make evaluate` for it first")


def check_variants(wanted: list[str], have: list[str]) -> None:
    unknown = [v for v in wanted if v not in have]
    if unknown or not wanted:
        raise bad_value("--variants", ",".join(wanted), f"{unknown or 'nothing'} is not a drafter variant the "
                        f"evaluate stage measured (have {','.join(have)})", "pick from that list")


# ---------------------------------------------------------------- token counts and kept sets
def coverage(counts: list[int], keep: set[int]) -> float:
    total = sum(counts)
    return sum(counts[i] for i in keep) / total if total else 0.0


def token_histogram(seqs, vocab: int) -> list[int]:
    counts = [0] * vocab
    for seq in seqs:
        for t in seq:
            counts[t] += 1
    return counts


# ---------------------------------------------------------------- the restricted draft head
@contextlib.contextmanager
def restricted_head(drafter, keep: list[int]):
    """The drafter's lm_head logits with every id outside `keep` set to -inf (as a head of `len(keep)` rows
    plus vLLM's d2t map proposes: argmax over the kept rows). Removed on exit."""
    import torch

    head = drafter.get_output_embeddings()
    mask = torch.ones(head.weight.shape[0], dtype=torch.bool, device=head.weight.device)
    mask[torch.tensor(keep, dtype=torch.long, device=mask.device)] = False

    def hook(_module, _inputs, logits):
        return logits.masked_fill(mask, float("-inf"))

    handle = head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def measure(target, drafter, subsets, greedy, max_new: int, stop, block_size: int, keep: set[int] | None,
            desc: str) -> dict:
    """The reference loop over every prompt: tau per subset and overall (evaluate's `subset_stats`), lossless
    mismatches against the target alone, and how many drafted tokens fell outside `keep`."""
    from tqdm import tqdm

    from pipeline.models.spec_decode import spec_generate
    from pipeline.stages.evaluate import subset_stats

    runs, mismatches, proposed, outside = {}, {}, 0, 0
    bar = tqdm(total=sum(len(s.prompts) for s in subsets), desc=desc, unit="prompt", leave=False)
    for s in subsets:
        runs[s.name], mismatches[s.name] = [], 0
        for i, ids in enumerate(s.prompts):
            r = spec_generate(target, drafter, ids, max_new, stop, trace=True)
            mismatches[s.name] += int(r.output_ids != greedy[s.name][i])
            for call in r.draft_calls:
                proposed += len(call["draft_tokens"])
                if keep is not None:
                    outside += sum(t not in keep for t in call["draft_tokens"])
            runs[s.name].append(r)
            bar.update(1)
    bar.close()
    per = {name: subset_stats(rs, block_size) for name, rs in runs.items()}
    overall = subset_stats([r for rs in runs.values() for r in rs], block_size)
    return {"tau": {**{k: v["tau"] for k, v in per.items()}, "all": overall["tau"]},
            "steps": overall["steps"], "acceptance_rate": overall["acceptance_rate"],
            "position_acceptance": overall["position_acceptance"],
            "lossless": all(n == 0 for n in mismatches.values()), "lossless_mismatches": mismatches,
            "proposed_tokens": proposed, "proposals_outside_kept": outside}


# ---------------------------------------------------------------- the bench
def _eval_cfg(config: dict):
    from omegaconf import OmegaConf

    return OmegaConf.create(config["eval"])


def _drafter_path(run: Path, variant: str, recorded: str) -> Path:
    """The run's own drafter/<variant>/ (the run may have been moved), else the path evaluate recorded."""
    own = run / "drafter" / variant
    return own if (own / "config.json").is_file() else Path(recorded)


def bench(run: Path, fractions: list[float], variants: list[str], threads: int | None = None) -> dict:
    """Measure every (variant, fraction); returns the results document (see `main`)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.artifacts import eval_results
    from pipeline.artifacts import samples as samples_file
    from pipeline.core.dtypes import TORCH_DTYPES
    from pipeline.core.io import hash_tree
    from pipeline.core.seeding import seed_everything
    from pipeline.evaluation.fakequant import load_drafter_variant, load_target
    from pipeline.evaluation.prompts import load_prompt_sets
    from pipeline.models.targets import text_config
    from pipeline.stages.evaluate import REFERENCE, _greedy_reference

    if threads:
        torch.set_num_threads(int(threads))
    results = eval_results.read_results(run / "eval").to_json()
    cfg = results["config"]
    check_variants(variants, list(results["variant_order"]))
    if FULL not in fractions:
        fractions = [FULL, *fractions]

    tcfg = cfg["target"]
    target_path = results["target"]["path"]
    revision = tcfg.get("revision") if results["target"]["variant"] == REFERENCE else None
    trust = bool(tcfg.get("trust_remote_code"))
    vocab = int(text_config(AutoConfig.from_pretrained(target_path, revision=revision,
                                                       trust_remote_code=trust)).vocab_size)
    sizes = {f: keep_size(f, vocab) for f in fractions}

    meta = samples_file.load_meta(run / "data")
    counts = assistant_counts(samples_file.load_samples(run / "data", meta), vocab)
    keeps = {f: kept_ids(counts, n) for f, n in sizes.items()}

    tokenizer = AutoTokenizer.from_pretrained(tcfg.get("tokenizer") or tcfg["path"],
                                              revision=tcfg.get("revision") if not tcfg.get("tokenizer") else None)
    scratch = tempfile.mkdtemp(prefix="draft-vocab-hf-datasets-")  # nothing written into the run directory
    subsets = load_prompt_sets(_eval_cfg(cfg), tokenizer, cache_dir=scratch)

    seed_everything(int(cfg["seed"]))
    dtype, device = TORCH_DTYPES[tcfg["dtype"]], str(tcfg["device"])
    target = load_target(target_path, dtype, device, revision, trust, tcfg.get("attn_implementation"))
    stop, max_new, block_size = list(results["stop_token_ids"]), int(results["max_new_tokens"]), int(results["block_size"])
    greedy, _ = _greedy_reference(target, subsets, max_new, stop, device)
    generated = {s.name: [out[len(p):] for out, p in zip(greedy[s.name], s.prompts)] for s in subsets}
    eval_counts = {name: token_histogram(seqs, vocab) for name, seqs in generated.items()}
    eval_all = [sum(c[i] for c in eval_counts.values()) for i in range(vocab)]

    rows = []
    for f in fractions:
        keep = set(keeps[f])
        rows.append({"fraction": f, "n": sizes[f], "calibration_coverage": round(coverage(counts, keep), 6),
                     "eval_coverage": round(coverage(eval_all, keep), 6),
                     "eval_coverage_per_subset": {k: round(coverage(c, keep), 6) for k, c in eval_counts.items()}})

    out_variants = {}
    for v in variants:
        rec = results["variants"][v]
        path = _drafter_path(run, v, rec["path"])
        files = {k: e["sha256"] for k, e in hash_tree(path).items()}
        if rec.get("files") is not None and files != rec["files"]:
            raise bad_value("--variants", v, f"the checkpoint {path} is not the one eval/results.json measured "
                            "(its files' sha256 differ)", "re-run `make evaluate` for this run")
        drafter, _ = load_drafter_variant(path, target, dtype, device)
        evaluated = {**{s: st["tau"] for s, st in rec["subsets"].items()}, "all": rec["overall"]["tau"]}
        measured = []
        for f in fractions:
            keep = keeps[f]
            with restricted_head(drafter, keep):
                m = measure(target, drafter, subsets, greedy, max_new, stop, block_size, set(keep),
                            f"{v} f={f:g} N={sizes[f]}")
            measured.append({"fraction": f, "n": sizes[f], **m})
            if f == FULL:
                print(f"[draft-vocab] {v} f=1.0: tau {m['tau']} | evaluate stage {evaluated}", flush=True)
                if m["tau"] != evaluated:
                    raise ReproductionError(f"variant {v!r} at f=1.0 measured tau {m['tau']} but eval/results.json "
                                            f"records {evaluated}; the bench does not reproduce the evaluate stage "
                                            "(same threads/device as `make evaluate`? try --threads)")
        full_tau = measured[fractions.index(FULL)]["tau"]["all"]
        for m in measured:
            m["tau_ratio_to_full"] = round(m["tau"]["all"] / full_tau, 6) if full_tau else None
        out_variants[v] = {"path": str(path), "evaluate_tau": evaluated, "rows": measured}
        del drafter

    return {"bench": "draft_vocab", "run": str(run), "target": target_path, "vocab": vocab,
            "device": device, "dtype": tcfg["dtype"], "threads": torch.get_num_threads(), "seed": int(cfg["seed"]),
            "max_new_tokens": max_new, "block_size": block_size,
            "kept_set": "the N most frequent ids among the calibration blend's assistant tokens (loss_mask 1), "
                        "ties by lower id; N = round(fraction x vocab)",
            "calibration": {"file": "data/samples.jsonl", "samples_sha256": meta.samples_sha256,
                            "samples": meta.num_samples, "assistant_tokens": sum(counts),
                            "distinct_ids": sum(c > 0 for c in counts)},
            "eval": {"subsets": {s.name: len(s.prompts) for s in subsets}, "generated_tokens": sum(eval_all),
                     "distinct_ids": sum(c > 0 for c in eval_all)},
            "fractions": rows, "variants": out_variants}


def table(doc: dict) -> str:
    """Markdown: fraction, N, coverages, tau per variant (and its ratio to f = 1.0), lossless."""
    vs = list(doc["variants"])
    head = ["fraction", "N", "calib cov", "eval cov", *[f"tau {v}" for v in vs], "lossless"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(doc["fractions"]):
        taus = [doc["variants"][v]["rows"][i] for v in vs]
        cells = [f"{r['fraction']:g}", str(r["n"]), f"{r['calibration_coverage']:.4f}", f"{r['eval_coverage']:.4f}",
                 *[f"{m['tau']['all']:.4f} ({m['tau_ratio_to_full']:.3f})" for m in taus],
                 "yes" if all(m["lossless"] and m["proposals_outside_kept"] == 0 for m in taus) else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m bench.draft_vocab", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the run directory, e.g. runs/tiny (after `make all`)")
    p.add_argument("--fractions", default="1.0,0.5,0.25,0.125,0.0625",
                   help="comma-separated shares of the target's vocabulary to keep, each in (0, 1]")
    p.add_argument("--variants", default="bf16", help="comma-separated drafter variants of the run's evaluation")
    p.add_argument("--json", default=None, help="where the results JSON goes (default: print only)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default torch's own, as `make evaluate` ran)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        fractions = parse_fractions(a.fractions)
        run = Path(a.run)
        check_run(run)
        if a.threads is not None and a.threads < 1:
            raise bad_value("--threads", a.threads, "it must be a positive number of threads", "use 1 or more")
        variants = [v.strip() for v in a.variants.split(",") if v.strip()]
        from pipeline.artifacts import eval_results

        check_variants(variants, list(eval_results.read_results(run / "eval").variant_order))
        doc = bench(run, fractions, variants, a.threads)
    except SpecquantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ReproductionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    doc = {"date": datetime.date.today().isoformat(),
           "command": "python -m bench.draft_vocab " + " ".join(sys.argv[1:] if argv is None else argv),
           **doc, "wall_s": round(time.perf_counter() - t0, 1)}
    print(table(doc))
    print(f"[draft-vocab] wall {doc['wall_s']} s")
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"[draft-vocab] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
