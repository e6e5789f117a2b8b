"""`python -m pipeline convert --to {zlab,speculators,native} SRC DST`: re-label a DFlash checkpoint.

Only config.json changes between formats (plus the explicit layer-id shift, see
`pipeline.models.formats`); the tensors are copied bit for bit. No target is needed, except that a
speculators checkpoint must name its verifier (`--verifier`, stored as given; we write paths
relative to the drafter directory, e.g. `../target`).

`--draft-vocab N --target DIR --counts-from RUN_DIR_OR_SAMPLES_JSONL` also trims the head
(`pipeline.models.draft_vocab`): the drafter gets its own `lm_head.weight` (the target's head rows of the N
ids most frequent among the assistant tokens of the run's `data/samples.jsonl`, in id order, in the
target's stored dtype), `d2t` (int64, target id = draft id + d2t) and `draft_vocab_size` = N, which vLLM
serves with an N-row head GEMM. A quantized (compressed-tensors) SRC, as quantize-drafter writes it, is
trimmed too (`--to speculators` only): its tensors and config are kept as they are, the new head stays
dense and the quantization_config's `ignore` is made to cover `lm_head`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.core.errors import bad_value


def check_empty_target(dst: Path) -> None:
    """DST must be new or an empty directory: a converted checkpoint never mixes with other files."""
    if dst.exists() and not dst.is_dir():
        raise bad_value("DST", str(dst), "it is a file, not a directory", "give a new or empty directory")
    if dst.is_dir():
        held = sorted(p.name for p in dst.iterdir())
        if held:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise bad_value("DST", str(dst), f"the directory is not empty (it holds {shown})",
                            "convert into a new or empty directory, or empty this one first")


def convert(src: str | Path, dst: str | Path, to: str, verifier: str | None = None,
            verifier_architectures: list[str] | None = None, draft_vocab: int | None = None,
            target: str | Path | None = None, counts_from: str | Path | None = None) -> Path:
    from pipeline.models.formats import (
        FORMATS,
        borrowed_keys,
        check_tensors,
        config_dict_for,
        load_drafter_config,
        read_tensors,
        write_checkpoint,
    )

    if to not in FORMATS:
        raise bad_value("--to", to, "unknown drafter format", f"use one of {', '.join(FORMATS)}")
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise bad_value("DST", str(dst), "it is the source directory", "write the converted checkpoint elsewhere")
    check_empty_target(dst)
    trim = draft_vocab is not None or target is not None or counts_from is not None
    if trim and (draft_vocab is None or target is None or counts_from is None):
        missing = [n for n, v in (("--draft-vocab", draft_vocab), ("--target", target),
                                  ("--counts-from", counts_from)) if v is None]
        raise bad_value(missing[0], None, "a trimmed head needs --draft-vocab, --target and --counts-from together",
                        f"add {' and '.join(missing)}")
    from pipeline.models.checkpoint_info import CheckpointInfo

    quantized = (src / "config.json").is_file() and CheckpointInfo.read(src, "SRC").quantized
    if quantized and not trim:
        raise bad_value("SRC", str(src), "it is a quantized (compressed-tensors) checkpoint, which convert re-labels "
                        "only while trimming its head", "convert the full-precision drafter, or add --draft-vocab")
    from pipeline.models import validation

    validation.check_drafter(src)  # every field of its family, against its tensors' headers
    if target is not None:  # and the target's whose head it borrows (the pair: `trimmed_head`)
        validation.check_target(target)
    cfg = load_drafter_config(src)
    if verifier is not None:
        cfg.verifier_name_or_path = verifier
        vdir = Path(verifier) if Path(verifier).is_absolute() else dst / verifier
        if verifier_architectures is None and (vdir / "config.json").is_file():
            verifier_architectures = list(CheckpointInfo.read(vdir, "--verifier").architectures) or None
    if verifier_architectures is not None:
        cfg.verifier_architectures = list(verifier_architectures)
    if trim:
        return write_trimmed(src, dst, to, cfg, int(draft_vocab), Path(target), counts_from, quantized)
    tensors = read_tensors(src)
    check_tensors(cfg, tensors, str(src))
    config = config_dict_for(cfg, to)  # fails (one sentence) before anything is written
    return write_checkpoint(tensors, config, dst, borrowed_keys(cfg))  # a trimmed head is the drafter's own


def check_target_vocab(target: Path, vocab: int) -> dict:
    """--target's config.json (a dict), refused in one sentence when its vocabulary is not the drafter's."""
    from pipeline.core.io import read_json
    from pipeline.models.targets import text_config

    if not (target / "config.json").is_file():
        raise bad_value("--target", str(target), "it is not a local target checkpoint directory (no config.json)",
                        "point it at the target whose head the drafter borrows")
    conf = read_json(target / "config.json", "--target")
    t_vocab = text_config(conf).get("vocab_size")
    if t_vocab != vocab:
        raise bad_value("--target", str(target), f"its vocabulary has {t_vocab} tokens but the drafter's has {vocab}",
                        "use the target the drafter was trained for")
    return conf


def trimmed_head(target: Path, vocab: int, n: int, counts_from: str | Path):
    """(kept ids, lm_head rows [n, hidden] in the target's stored dtype, d2t int64 [n], how many kept ids never
    occur in the counted text: those are the lowest ids left) for a head of n ids."""
    import torch

    from pipeline.models import draft_vocab
    from pipeline.models.formats import target_head_weights

    if not (target / "config.json").is_file():
        raise bad_value("--target", str(target), "it is not a local target checkpoint directory (no config.json)",
                        "point it at the target whose head the drafter borrows")
    check_target_vocab(target, vocab)
    if not 1 <= n < vocab:
        raise bad_value("--draft-vocab", n, f"a trimmed head keeps 1 to {vocab - 1} of the target's {vocab} tokens",
                        f"give N in 1..{vocab - 1} (without --draft-vocab the target's head is borrowed whole)")
    counts = draft_vocab.assistant_counts(draft_vocab.load_count_samples(counts_from), vocab, str(counts_from))
    kept = draft_vocab.kept_ids(counts, n)
    unseen = sum(1 for i in kept if counts[i] == 0)
    _, head = target_head_weights(target)
    if tuple(head.shape) != (vocab, head.shape[1]):
        raise bad_value("--target", str(target), f"its lm_head is {tuple(head.shape)}, not {vocab} rows",
                        "point it at a complete causal LM checkpoint")
    index = torch.tensor(kept, dtype=torch.long)
    d2t = torch.tensor(draft_vocab.d2t_offsets(kept), dtype=torch.long)
    return kept, head.index_select(0, index).contiguous(), d2t, unseen


HEAD_IGNORE = r"re:(.*\.)?lm_head$"  # the entry quantize-drafter writes for the borrowed head


def _ignores_head(qc: dict) -> bool:
    from pipeline.serving import contract

    return contract.matches("lm_head", qc.get("ignore") or [])


def write_trimmed(src: Path, dst: Path, to: str, cfg, n: int, target: Path, counts_from, quantized: bool) -> Path:
    """Write SRC with a head trimmed to `n` ids to DST in one rename (`atomic_dir`)."""
    from pipeline.core.io import atomic_dir, read_json
    from pipeline.models import families, validation
    from pipeline.models.checkpoint_info import CheckpointInfo
    from pipeline.models.compat import check_compatible
    from pipeline.models.formats import check_tensors, config_dict_for, read_tensors, write_checkpoint

    # the drafter against the target whose head it takes (vocabulary, then sizes and aux layers): configs only
    check_compatible(validation.check_drafter(src), check_target_vocab(target, int(cfg.vocab_size)))
    if cfg.has_draft_vocab:
        raise bad_value("SRC", str(src), f"its head is already trimmed to {cfg.draft_vocab_size} tokens",
                        "trim the full-vocabulary drafter instead")
    family = families.family_of(cfg)
    if family.head_trim_refusal:
        raise bad_value("SRC", str(src), f"it is a {family.card_name} drafter, {family.head_trim_refusal}",
                        "trim a DFlash drafter's head only")
    if quantized and to != "speculators":
        raise bad_value("--to", to, "a quantized drafter is written in speculators layout only (where vLLM reads its "
                        "quantization_config)", "use --to speculators")
    if quantized and CheckpointInfo.read(src, "SRC").format != "speculators":
        raise bad_value("SRC", str(src), "it is a quantized checkpoint not in speculators layout",
                        "trim the checkpoint quantize-drafter wrote (runs/<run>/drafter/<variant>)")
    tensors = read_tensors(src)
    if not quantized:
        check_tensors(cfg, tensors, str(src))
    own = {"lm_head.weight", "d2t"} & tensors.keys()
    if own:
        raise bad_value("SRC", str(src), f"it already stores {sorted(own)}", "trim the full-vocabulary drafter instead")
    kept, rows, d2t, unseen = trimmed_head(target, int(cfg.vocab_size), n, counts_from)
    tensors["lm_head.weight"], tensors["d2t"] = rows, d2t
    cfg.draft_vocab_size = n
    if quantized:  # the source's own config (quantize-drafter's, serving contract included) plus the new head
        config = read_json(src / "config.json", "SRC")
        config["draft_vocab_size"] = n
        verifier = config.setdefault("speculators_config", {}).setdefault("verifier", {})
        if cfg.verifier_name_or_path:  # --verifier / --verifier-arch, as for a dense drafter
            verifier["name_or_path"] = cfg.verifier_name_or_path
        if cfg.verifier_architectures:
            verifier["architectures"] = list(cfg.verifier_architectures)
        for qc in (config.get("quantization_config"), (config.get("transformer_layer_config") or {}).get(
                "quantization_config")):
            if qc is not None and not _ignores_head(qc):
                qc["ignore"] = [*(qc.get("ignore") or []), HEAD_IGNORE]  # the trimmed head is dense (bf16)
    else:
        config = config_dict_for(cfg, to)  # fails (one sentence) before anything is written
        check_tensors(cfg, tensors, str(src))  # the written tensors fit the trimmed config
    with atomic_dir(dst) as tmp:
        write_checkpoint(tensors, config, tmp, borrowed=("embed_tokens.weight",))
    print(f"kept {n} of {cfg.vocab_size} ids (the most frequent assistant tokens of {counts_from}); "
          f"ids {kept[0]}..{kept[-1]}")
    if unseen:
        print(f"warning: {unseen} of the {n} kept ids never occur in that text (the lowest unused ids fill the "
              f"head); count a larger blend or give a smaller --draft-vocab")
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline convert", description=__doc__.splitlines()[0])
    ap.add_argument("--to", required=True, choices=["zlab", "speculators", "native"])
    ap.add_argument("--verifier", default=None, help="speculators verifier name_or_path (target path or Hub id)")
    ap.add_argument("--verifier-arch", action="append", default=None, help="e.g. Qwen3ForCausalLM")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="trim the head to the N most frequent assistant tokens (needs --target and --counts-from)")
    ap.add_argument("--target", default=None, help="the target directory whose lm_head rows the trimmed head copies")
    ap.add_argument("--counts-from", default=None, metavar="RUN_DIR_OR_SAMPLES_JSONL",
                    help="a run directory (its data/samples.jsonl) or a samples.jsonl whose assistant tokens are counted")
    ap.add_argument("src")
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    out = convert(args.src, args.dst, args.to, args.verifier, args.verifier_arch, args.draft_vocab, args.target,
                  args.counts_from)
    print(f"wrote {args.to} drafter to {out}")
    return 0
