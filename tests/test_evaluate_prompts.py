"""Evaluation prompt sets through `datasets` (local json/jsonl, save_to_disk folders), chat-templated."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest


def _eval_cfg(*sets, limit=None):
    return SimpleNamespace(prompt_sets=[SimpleNamespace(**{"path": None, "hub_id": None, "revision": None,
                                                           "split": "test", "field": "prompt", **s}) for s in sets],
                           limit=limit)


@pytest.fixture(scope="module")
def tok(chat_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_tokenizer)


def test_jsonl_and_saved_dataset_load_through_datasets(tmp_path, tok):
    import datasets

    from pipeline.evaluation.prompts import load_prompt_sets, render

    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "Add 7 and 5."}, {"prompt": "Is 9 > 4?"}]
    (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a Hub-style dataset saved locally (what load_from_disk reads), with OpenAI messages and a split
    msgs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"},
             {"role": "assistant", "content": "return a + b"}],
            [{"role": "user", "content": "print the sum"}]]
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"messages": msgs})}).save_to_disk(tmp_path / "code")
    cfg = _eval_cfg({"name": "math", "path": str(tmp_path / "math.jsonl")},
                    {"name": "code", "path": str(tmp_path / "code"), "field": "messages"}, limit=2)
    math, code = load_prompt_sets(cfg, tok)
    assert [len(math.prompts), len(code.prompts)] == [2, 2]  # limit applies per subset
    expected = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.decode(math.prompts[0]) == expected and expected.endswith("<|im_start|>assistant\n")
    assert math.texts == ["What is 2 + 3?", "Add 7 and 5."]
    # the trailing assistant turn is dropped: the drafter must propose the answer itself
    assert code.prompts[0] == render(tok, msgs[0][:2]) and code.texts[0] == "def add(a, b):"
    assert code.source["path"] == str(tmp_path / "code") and code.source["field"] == "messages"


def test_same_prompt_ids_as_the_drafter_loop(tmp_path, tok):
    """evaluate and spec_decode.load_prompts must tokenize a prompt file identically (same tau)."""
    from pipeline.evaluation.prompts import load_prompt_sets
    from pipeline.models.spec_decode import load_prompts

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["Hello, how are you?", "Tell me more."]))
    (ours,) = load_prompt_sets(_eval_cfg({"name": "chat", "path": str(path)}), tok)
    assert ours.prompts == load_prompts(path, tok)["chat"]


@pytest.mark.parametrize(("entry", "field"), [
    ({"name": "x", "path": "missing.jsonl"}, "eval.prompt_sets[0].path"),
    ({"name": "x", "hub_id": "openai/gsm8k"}, "eval.prompt_sets[0].revision"),
    ({"name": "x", "path": "{jsonl}", "field": "question"}, "eval.prompt_sets[0].field"),
    ({"name": "x y", "path": "{jsonl}"}, "eval.prompt_sets[0].name"),
])
@pytest.mark.faults("bad_input")
def test_bad_prompt_sets_name_the_field(tmp_path, tok, entry, field):
    from pipeline.core.errors import SpecquantError
    from pipeline.evaluation.prompts import load_prompt_sets

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "hi"}) + "\n")
    entry = {k: (str(jsonl) if v == "{jsonl}" else v) for k, v in entry.items()}
    with pytest.raises(SpecquantError, match="^`" + re.escape(field) + "`"):
        load_prompt_sets(_eval_cfg(entry), tok)
