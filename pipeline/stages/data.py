"""Stage 1 - data: build the calibration blend.

Load each configured source (local JSON/JSONL in ShareGPT or OpenAI form, or a Hub
dataset at a pinned revision), keep well-formed conversations, render them with the
TARGET's chat template, mark assistant tokens in the loss mask, truncate, and draw a
seeded, weighted blend. Writes `data/samples.jsonl`, `data/counts.json`, `data/meta.json` through
`pipeline.artifacts.samples` (the format's writer and reader).
"""

from __future__ import annotations

import codecs
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.artifacts import samples as samples_file
from pipeline.artifacts.rundir import RunDir
from pipeline.core.errors import bad_value
from pipeline.core.io import dumps_json, sha256_bytes, sha256_file

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "system": "system",
}
FORMATS = ("auto", "sharegpt", "openai")
MAX_EXAMPLES = 5  # per drop reason, recorded with file and line in counts.json


class Dropped(Exception):
    """A row that cannot be used; `reason` is the counter key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason


# ---------------------------------------------------------------- reading rows


def _check_source_file(path: str | Path, field: str) -> None:
    """A local source must be a file: a directory is named as one, not as a missing file."""
    if Path(path).is_dir():
        raise bad_value(field, str(path), "it is a directory, not a file",
                        "point it at a .json or .jsonl file inside it")
    if not Path(path).is_file():
        raise bad_value(field, str(path), "the file does not exist", "point it at a .json or .jsonl file")


def _read_local_rows(path: Path, field: str) -> list[tuple[int, Any]]:
    """[(line number, raw bytes or parsed object)] - JSONL lines stay raw so a bad line is one drop."""
    _check_source_file(path, field)
    if path.suffix == ".jsonl":
        lines = path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n")  # a UTF-8 BOM is no part of row 1
        return [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise bad_value(field, str(path), f"it is not valid UTF-8 JSON ({exc})",
                            "fix the file or convert it to JSONL, one conversation per line") from None
        if not isinstance(rows, list):
            raise bad_value(field, str(path), "a .json source must hold a list of conversations",
                            "wrap the rows in a JSON list or use .jsonl")
        return [(i + 1, row) for i, row in enumerate(rows)]
    raise bad_value(field, str(path), "only .json and .jsonl files are supported",
                    "convert the file to JSONL with one conversation per line")


def _read_hub_rows(src, field: str) -> list[tuple[int, Any]]:
    """Every row of a Hub dataset, read into memory. `datasets` prepares its Arrow tables (and lock files) in
    the run's `.work/hf-datasets/<pid>/`, removed after, as for the evaluation prompts
    (pipeline.evaluation.prompts.scratch_dir), so nothing is left in ~/.cache/huggingface/datasets."""

    import datasets

    from pipeline.evaluation.prompts import remove_scratch, scratch_dir

    scratch = scratch_dir(src)
    try:
        ds = datasets.load_dataset(src.hub_id, revision=src.revision, split=src.split, cache_dir=str(scratch))
        return [(i + 1, row) for i, row in enumerate(ds)]
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; all mean "cannot load"
        raise bad_value(field, src.hub_id, f"datasets.load_dataset failed ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})",
                        "check the dataset id, revision and split, or pre-download it for offline use") from None
    finally:
        remove_scratch(scratch)


def _decode(raw: Any) -> Any:
    if not isinstance(raw, bytes | bytearray):
        return raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Dropped("not_utf8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise Dropped("malformed_json") from None


def to_messages(row: Any, fmt: str, max_turn_chars: int) -> list[dict[str, str]]:
    """Normalise one row to [{role, content}], or raise Dropped with the reason."""
    if not isinstance(row, dict):
        raise Dropped("not_an_object")
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in row else "openai" if "messages" in row else "unknown"
    if fmt == "sharegpt":
        turns, role_key, text_key = row.get("conversations"), "from", "value"
    elif fmt == "openai":
        turns, role_key, text_key = row.get("messages"), "role", "content"
    else:
        raise Dropped("unknown_format")
    if not isinstance(turns, list) or not turns:
        raise Dropped("wrong_format")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn:
            raise Dropped("missing_role")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise Dropped("unknown_role")
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise Dropped("missing_content")
        if not content.strip():
            raise Dropped("empty_turn")
        if len(content) > max_turn_chars:
            raise Dropped("oversized_turn")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise Dropped("no_assistant_turn")
    if messages[0]["role"] == "assistant":
        raise Dropped("starts_with_assistant")
    return messages


# ---------------------------------------------------------------- tokenizing


def not_downloaded(target_cfg, hub_repo: str | None = None) -> None:
    """Refuse a target (or tokenizer) that is neither a directory nor in the local Hub cache, in one sentence
    that prints the `hf download` to run (`hub_repo`: the Hub id to name when the path is a directory-to-be,
    e.g. publish.target_model), before transformers answers with its own offline error."""
    from pipeline.core.hub import hub_id
    from pipeline.core.loading import local_snapshot

    field = "target.tokenizer" if target_cfg.tokenizer else "target.path"
    name = str(target_cfg.tokenizer or target_cfg.path)
    if Path(name).is_dir():
        return
    try:
        local_snapshot(name, target_cfg.revision, partial_ok=True)
        return
    except LookupError:
        pass
    rev = f" --revision {target_cfg.revision}" if target_cfg.revision and target_cfg.revision != "main" else ""
    repo = hub_repo if hub_repo and hub_repo != name else None
    if repo or not hub_id(name):  # a directory that is not there yet: download into it
        fix = f"`hf download {repo or '<the target repo id>'}{rev} --local-dir {name}`"
    else:  # a Hub id: into the local Hub cache (or a directory, then point the key at it)
        fix = f"`hf download {name}{rev}`"
    raise bad_value(field, name, "there is no such directory, and no Hub repo of that id is in the local Hugging Face "
                    "cache (nothing is downloaded at run time)",
                    f"download the target first: {fix} (docs/quickstart.md, step 1), or fix the path")


def load_tokenizer(target_cfg, hub_repo: str | None = None):
    from transformers import AutoTokenizer

    not_downloaded(target_cfg, hub_repo)
    name = target_cfg.tokenizer or target_cfg.path
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=target_cfg.revision,
                                            trust_remote_code=bool(target_cfg.trust_remote_code))
    except (OSError, ValueError) as exc:
        raise bad_value("target.tokenizer", name, f"the tokenizer cannot be loaded ({str(exc).splitlines()[0]})",
                        "point target.tokenizer (or target.path) at a directory or repo with tokenizer files") from None
    if not getattr(tok, "chat_template", None):
        raise bad_value("target.tokenizer", name, "the tokenizer has no chat template",
                        "use the target's own tokenizer, which must define chat_template")
    if not getattr(tok, "is_fast", False):
        raise bad_value("target.tokenizer", name, "a fast tokenizer (with offset mapping) is required",
                        "provide tokenizer.json for this tokenizer")
    return tok


def tokenize_conversation(tok, messages: list[dict[str, str]], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Render with the chat template; loss mask = 1 on the tokens of assistant turns (incl. end-of-turn)."""
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(messages[:i], True)), len(render(messages[: i + 1], False))
        # the spans are only meaningful if every prefix renders as a prefix of the whole
        if not full.startswith(render(messages[: i + 1], False)):
            raise Dropped("chat_template_not_prefix_stable")
        spans.append((start, end))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [int(any(s <= a and b <= e and b > a for s, e in spans)) for a, b in offsets]
    return ids[:max_seq_len], mask[:max_seq_len]


# ---------------------------------------------------------------- blend


def _allocate(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of `total` by weights (deterministic)."""
    s = sum(weights)
    raw = [total * w / s for w in weights]
    base = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def _validate_cfg(cfg) -> None:
    d = cfg.data
    if not d.sources:
        raise bad_value("data.sources", [], "no calibration sources are configured", "add at least one source")
    if d.num_samples < 1:
        raise bad_value("data.num_samples", d.num_samples, "must be at least 1", "set a positive sample count")
    if d.max_seq_len < 8:
        raise bad_value("data.max_seq_len", d.max_seq_len, "is too short for a chat-templated sample",
                        "use at least 8 tokens (2048 for real targets)")
    names = set()
    for i, s in enumerate(d.sources):
        field = f"data.sources[{i}]"
        if (s.path is None) == (s.hub_id is None):
            raise bad_value(field, s.name, "exactly one of `path` and `hub_id` must be set",
                            "give a local file path or a Hub dataset id")
        if s.format not in FORMATS:
            raise bad_value(f"{field}.format", s.format, "unknown conversation format",
                            f"use one of {', '.join(FORMATS)}")
        if not s.weight > 0:
            raise bad_value(f"{field}.weight", s.weight, "weights must be positive", "use a weight > 0 or remove the source")
        if s.name in names:
            raise bad_value(f"{field}.name", s.name, "source names must be unique", "rename one of the sources")
        names.add(s.name)
        if s.path is not None:
            _check_source_file(s.path, f"{field}.path")


def _take_from_source(src, idx: int, want: int, tok, cfg, rng: random.Random
                      ) -> tuple[list[dict], samples_file.SourceCounts]:
    from tqdm import tqdm

    field = f"data.sources[{idx}]"
    rows = _read_local_rows(Path(src.path), f"{field}.path") if src.path else _read_hub_rows(src, f"{field}.hub_id")
    order = list(range(len(rows)))
    rng.shuffle(order)
    kept, dropped, examples = [], Counter(), {}
    where = src.path or f"{src.hub_id}@{src.revision}"
    for j in tqdm(order, desc=f"data:{src.name}", unit="row", leave=False, disable=None):
        if len(kept) >= want:
            break
        line, raw = rows[j]
        try:
            messages = to_messages(_decode(raw), src.format, cfg.data.max_turn_chars)
            if cfg.data.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": cfg.data.system_prompt}, *messages]
            ids, mask = tokenize_conversation(tok, messages, cfg.data.max_seq_len)
            if sum(mask) < cfg.data.min_assistant_tokens:
                raise Dropped("no_assistant_tokens_after_truncation")
        except Dropped as d:
            dropped[d.reason] += 1
            examples.setdefault(d.reason, [])
            if len(examples[d.reason]) < MAX_EXAMPLES:
                examples[d.reason].append(f"{where}:{line}")
            continue
        kept.append({"id": f"{src.name}/{line - 1}", "source": src.name, "input_ids": ids, "loss_mask": mask})
    counts = samples_file.SourceCounts(
        requested=want, available=len(rows), examined=len(kept) + sum(dropped.values()), kept=len(kept),
        dropped=dict(sorted(dropped.items())), dropped_examples=dict(sorted(examples.items())),
        location=where, revision=src.revision, format=src.format, weight=src.weight)
    if dropped:
        summary = ", ".join(f"{r}: {n} (e.g. {examples[r][0]})" for r, n in sorted(dropped.items()))
        print(f"[specquant] data: source {src.name!r} dropped {sum(dropped.values())} rows - {summary}")
    if not kept:
        raise bad_value(f"{field}", where, "no usable conversation was found (dropped: "
                        + ", ".join(f"{r}={n}" for r, n in sorted(dropped.items())) + ")",
                        "fix the rows or the source's `format`, or remove the source")
    return kept, counts


def tokenizer_hashes(name_or_path: str | Path, revision: str | None = None) -> dict[str, Any]:
    """{"files": {name: sha256}, "sha256": digest} of the tokenizer's own files as they are on disk
    (those of `TOKENIZER_FILES` present in the directory, or in the Hub cache's snapshot of
    `revision`; never re-saved, never downloaded). digest = sha256 of the canonical JSON of "files";
    both are None when the files cannot be found locally."""
    from pipeline.core.loading import local_snapshot
    from pipeline.quant.export import TOKENIZER_FILES

    try:
        root = local_snapshot(name_or_path, revision, partial_ok=True)
    except LookupError:
        return {"files": None, "sha256": None}
    files = {n: sha256_file(root / n) for n in sorted(TOKENIZER_FILES) if (root / n).is_file()}
    return {"files": files or None, "sha256": sha256_bytes(dumps_json(files).encode()) if files else None}


def tokenizer_sha256(tok_or_path, revision: str | None = None) -> str | None:
    """The digest of `tokenizer_hashes` for a tokenizer directory / Hub id, or a loaded tokenizer
    (its `name_or_path`)."""
    return tokenizer_hashes(getattr(tok_or_path, "name_or_path", tok_or_path), revision)["sha256"]


def build_blend(cfg) -> tuple[list[dict], dict[str, samples_file.SourceCounts], Any]:
    _validate_cfg(cfg)
    tok = load_tokenizer(cfg.target, cfg.publish.target_model)
    wants = _allocate(cfg.data.num_samples, [float(s.weight) for s in cfg.data.sources])
    samples, counts = [], {}
    for i, (src, want) in enumerate(zip(cfg.data.sources, wants)):
        kept, c = _take_from_source(src, i, want, tok, cfg, random.Random(f"{cfg.seed}:{src.name}"))
        samples += kept
        counts[src.name] = c
    random.Random(f"{cfg.seed}:blend").shuffle(samples)
    return samples, counts, tok


def run(cfg) -> dict:
    rd = RunDir.from_cfg(cfg)
    samples, counts, tok = build_blend(cfg)
    out = rd.data
    name = cfg.target.tokenizer or cfg.target.path
    tokenizer = samples_file.TokenizerRecord(name_or_path=name, revision=cfg.target.revision,
                                             **tokenizer_hashes(name, cfg.target.revision), vocab_size=len(tok))
    sources = [samples_file.SourceRecord(name=s.name, path=s.path, hub_id=s.hub_id, revision=s.revision,
                                         split=s.split, format=s.format, weight=s.weight) for s in cfg.data.sources]
    meta = samples_file.write(out, samples, counts, seed=int(cfg.seed), max_seq_len=int(cfg.data.max_seq_len),
                              tokenizer=tokenizer, sources=sources, blend_name=cfg.data.name)
    short = {k: v for k, v in counts.items() if v.kept < v.requested}
    for src, c in short.items():
        print(f"[specquant] data: source {src!r} had only {c.kept} usable of {c.requested} requested")
    print(f"[specquant] data: {len(samples)} samples, {meta.num_tokens} tokens "
          f"({meta.num_loss_tokens} assistant) -> {out}")
    return {"output": str(out), "num_samples": len(samples), "num_tokens": meta.num_tokens,
            "samples_sha256": meta.samples_sha256, "per_source_kept": {k: v.kept for k, v in counts.items()}}


__all__ = ["run", "build_blend", "to_messages", "tokenize_conversation", "load_tokenizer",
           "dumps_json"]
