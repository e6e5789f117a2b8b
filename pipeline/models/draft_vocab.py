"""A vocabulary-trimmed draft head: which target ids a drafter keeps, and the `d2t` map vLLM reads.

A drafter with config `draft_vocab_size` = N (< the target's vocabulary V) ships its own `lm_head.weight`
[N, hidden] (the target's head rows of the N kept ids, in id order) and `d2t` (int64 [N], target id =
draft id + d2t[draft id]); vLLM 0.26 (`qwen3_dflash.py` DFlashQwen3ForCausalLM) scatters its N logits into
a row of V with -inf elsewhere, so the drafter never proposes an id outside the kept set.

Kept ids: the N most frequent ids (ties: the lower id first) among the assistant tokens (loss mask 1) of
a run's calibration blend (`data/samples.jsonl`), as EAGLE-3 and speculators build `d2t`. Pure functions,
no torch: `bench.draft_vocab` measures the same sets by masking logits, `pipeline.commands.convert` writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.errors import bad_value


def assistant_counts(samples, vocab: int, source: str = "data/samples.jsonl") -> list[int]:
    """Occurrences of each id among the loss-masked (assistant) tokens of the calibration samples."""
    counts = [0] * vocab
    for s in samples:
        for t, m in zip(s["input_ids"], s["loss_mask"]):
            if m:
                if not 0 <= t < vocab:
                    raise bad_value(str(source), s["id"], f"it holds token id {t} outside the target's "
                                    f"vocabulary of {vocab}", "count samples made with the run's target tokenizer")
                counts[t] += 1
    return counts


def kept_ids(counts: list[int], n: int) -> list[int]:
    """The n most frequent ids, ties broken by the lower id; returned in id order."""
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    return sorted(order[:n])


def d2t_offsets(kept: list[int]) -> list[int]:
    """vLLM's `d2t` for kept ids in id order: target id = draft id + d2t[draft id]."""
    return [t - i for i, t in enumerate(kept)]


def load_count_samples(source: str | Path, field: str = "--counts-from") -> list[dict]:
    """The samples to count: a run directory (its `data/samples.jsonl`, checked against `data/meta.json`)
    or a samples.jsonl file itself (every line a sample with `input_ids` and `loss_mask`)."""
    p = Path(source)
    if p.is_dir():
        data = p / "data" if (p / "data" / "meta.json").is_file() else p
        if not (data / "meta.json").is_file():
            raise bad_value(field, str(source), "the directory holds no data/meta.json (no calibration blend)",
                            "point it at a run directory after `make data`, or at a samples.jsonl")
        from pipeline.artifacts import samples as samples_file

        return samples_file.load_samples(data)
    if not p.is_file():
        raise bad_value(field, str(source), "no such run directory or samples file",
                        "point it at runs/<run_name> (after `make data`) or at its data/samples.jsonl")
    out = []
    with open(p, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise bad_value(field, f"{source}:{line_no}", "the line is not JSON",
                                "give a samples.jsonl written by `make data`") from None
            if not isinstance(row, dict) or not {"input_ids", "loss_mask"} <= row.keys():
                raise bad_value(field, f"{source}:{line_no}", "the line has no `input_ids` and `loss_mask`",
                                "give a samples.jsonl written by `make data`")
            ids, mask = row["input_ids"], row["loss_mask"]
            if not (isinstance(ids, list) and isinstance(mask, list) and len(ids) == len(mask)
                    and all(type(t) is int for t in ids) and all(type(m) in (int, bool) for m in mask)):
                raise bad_value(field, f"{source}:{line_no}", "its `input_ids` and `loss_mask` are not integer lists "
                                "of one length", "give a samples.jsonl written by `make data`")
            row.setdefault("id", f"line {line_no}")
            out.append(row)
    if not out:
        raise bad_value(field, str(source), "the file holds no samples", "give a samples.jsonl written by `make data`")
    return out


__all__ = ["assistant_counts", "kept_ids", "d2t_offsets", "load_count_samples"]
