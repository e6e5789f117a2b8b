"""Evaluation prompt sets: local json/jsonl files, saved dataset folders or pinned Hub datasets.

Every subset goes through `datasets` (`load_dataset("json", ...)`, `load_from_disk`, or
`load_dataset(hub_id, revision=...)`) so the local test path and the Hub path share code. Each
prompt is rendered with the TARGET's chat template (`add_generation_prompt=True`): the drafter is
evaluated on the token stream the served target sees.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.core.errors import bad_value

BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark (Windows editors write one): no content
# subset names become file names and shell function names (vllm_commands.sh)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class PromptSubset:
    name: str
    source: dict[str, Any]  # where the rows came from (path or hub id + revision, split, field)
    prompts: list[list[int]]  # chat-templated input ids, one list per prompt
    texts: list[str]  # the last user message of each prompt (what a serving benchmark sends)


def _open_rows(ps, i: int, cache_dir: str | None = None):
    """A `datasets.Dataset` for prompt set `ps` (no download unless a Hub id is configured); the Arrow
    tables `datasets` prepares go to `cache_dir` (None = its own cache, ~/.cache/huggingface/datasets)."""
    import datasets

    where = f"eval.prompt_sets[{i}]"
    if bool(ps.path) == bool(ps.hub_id):
        raise bad_value(f"{where}.path", ps.path, "exactly one of `path` and `hub_id` must be set",
                        "give a local .json/.jsonl file or folder, or a Hub dataset id with a pinned revision")
    if ps.hub_id:
        if not ps.revision:
            raise bad_value(f"{where}.revision", ps.revision, f"Hub dataset {ps.hub_id!r} has no pinned revision",
                            "set a commit sha or tag so the evaluation is reproducible")
        return datasets.load_dataset(ps.hub_id, revision=ps.revision, split=ps.split, cache_dir=cache_dir)
    path = Path(ps.path)
    if path.is_file() and path.suffix in {".json", ".jsonl"} and not path.read_bytes().removeprefix(BOM).strip():
        raise bad_value(f"{where}.path", ps.path, "the file is empty", "put one prompt per line in it, or drop the subset")
    if path.is_file() and path.suffix in {".json", ".jsonl"}:
        return datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=cache_dir)
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if ps.split not in ds:
                raise bad_value(f"{where}.split", ps.split, f"the saved dataset has splits {sorted(ds)}",
                                "choose one of them")
            ds = ds[ps.split]
        return ds
    raise bad_value(f"{where}.path", ps.path, "it is not a .json/.jsonl file or a folder written by save_to_disk",
                    "point it at an existing prompt file or saved dataset folder")


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    """One row's prompt as chat messages: a string, a list of turns (first used) or OpenAI messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [{"role": "user", "content": value[0]}]  # multi-turn sets (mt-bench): first turn only
    if isinstance(value, list) and value and all(isinstance(v, dict) and "role" in v for v in value):
        msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in value]
        while msgs and msgs[-1]["role"] == "assistant":  # the drafter must propose the answer
            msgs.pop()
        if msgs:
            return msgs
    raise bad_value(where, value, "it is neither a string, a list of strings nor a list of role/content messages",
                    "set `field` to the column holding the prompt text")


def render(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template `messages` with the generation prompt and tokenize without extra special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def scratch_dir(eval_cfg, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `datasets` may write its Arrow tables while the prompts are read: `cache_dir`, else
    `<run_dir>/.work/hf-datasets/<pid>` when `eval_cfg` is part of a whole run config, else a fresh
    temporary folder. `load_prompt_sets` removes it afterwards, so nothing is left in
    ~/.cache/huggingface/datasets nor in the run directory (whose files the manifests list)."""
    if cache_dir is not None:
        return Path(cache_dir)
    root = eval_cfg._get_root() if isinstance(eval_cfg, DictConfig) else None
    run_dir = OmegaConf.select(root, "run_dir", default=None) if root is not None else None
    if run_dir:
        return Path(str(run_dir)) / ".work" / "hf-datasets" / str(os.getpid())
    return Path(tempfile.mkdtemp(prefix="specquant-hf-datasets-"))


def load_prompt_sets(eval_cfg, tokenizer, cache_dir: str | os.PathLike | None = None) -> list[PromptSubset]:
    """Every configured subset, `eval_cfg.limit` prompts each (None = all), in file order.

    `datasets`' Arrow tables go to `scratch_dir(eval_cfg, cache_dir)`, removed before returning (every
    prompt is read into memory first); Hub files themselves stay in the Hub client's cache."""
    scratch = scratch_dir(eval_cfg, cache_dir)
    try:
        return _load_prompt_sets(eval_cfg, tokenizer, str(scratch))
    finally:
        remove_scratch(scratch)


def remove_scratch(scratch: Path) -> None:
    """Remove a `scratch_dir`, and the run dir's .work/hf-datasets/ (and .work/) once they are empty."""
    shutil.rmtree(scratch, ignore_errors=True)
    if scratch.parent.name == "hf-datasets":
        for empty in (scratch.parent, scratch.parent.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()


def _load_prompt_sets(eval_cfg, tokenizer, cache_dir: str) -> list[PromptSubset]:
    if not eval_cfg.prompt_sets:
        raise bad_value("eval.prompt_sets", [], "no prompt set is configured", "add at least one subset")
    limit = eval_cfg.limit
    if limit is not None and int(limit) < 1:
        raise bad_value("eval.limit", limit, "it must be a positive number of prompts per subset",
                        "use a value >= 1, or null for every prompt")
    names = [ps.name for ps in eval_cfg.prompt_sets]
    for i, name in enumerate(names):
        if not _NAME.match(str(name)):
            raise bad_value(f"eval.prompt_sets[{i}].name", name, "a subset name may hold only letters, digits, "
                            "'.', '_' and '-'", "rename the subset")
    if len(set(names)) != len(names):
        raise bad_value("eval.prompt_sets", names, "two subsets share a name", "give every subset its own name")
    if not getattr(tokenizer, "chat_template", None):
        raise bad_value("target.tokenizer", getattr(tokenizer, "name_or_path", None), "the tokenizer has no chat "
                        "template, and prompts are rendered with the target's chat template as it is served",
                        "point target.tokenizer at the target's own tokenizer (with its chat_template)")
    subsets = []
    for i, ps in enumerate(eval_cfg.prompt_sets):
        rows = _open_rows(ps, i, cache_dir)
        if ps.field not in rows.column_names:
            raise bad_value(f"eval.prompt_sets[{i}].field", ps.field,
                            f"subset {ps.name!r} has columns {rows.column_names}", "set `field` to one of them")
        if limit is not None:
            rows = rows.select(range(min(int(limit), len(rows))))
        chats = [_messages(v, f"eval.prompt_sets[{i}].field") for v in rows[ps.field]]
        prompts = [render(tokenizer, m) for m in chats]
        texts = [next(x["content"] for x in reversed(m) if x["role"] == "user") if any(
            x["role"] == "user" for x in m) else m[-1]["content"] for m in chats]
        if not prompts:
            raise bad_value(f"eval.prompt_sets[{i}]", ps.name, "the subset has no prompts", "check its file or split")
        source = {"path": ps.path, "hub_id": ps.hub_id, "revision": ps.revision, "split": ps.split,
                  "field": ps.field}
        subsets.append(PromptSubset(name=ps.name, source=source, prompts=prompts, texts=texts))
    return subsets
