"""Shared fixtures: the real config tree, a small chat tokenizer, and run directories in tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(out: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A small byte-level BPE tokenizer with chat special tokens and <|MASK|> (built in < 1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["Hello, how are you? I am fine, thank you.", "What is 2 + 3? The answer is 5.",
              "def add(a, b):\n    return a + b", "user assistant system"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|MASK|>"])
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("tok"))


def run_cli(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 600):
    """Run `python -m pipeline ...` as a user would; returns CompletedProcess (text)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- reliability report
# Tests marked `@pytest.mark.faults("<kind>")` are the fault-injection suite. With
# SPECQUANT_RELIABILITY_OUT set (by `python -m pipeline.reliability`), each one's outcome is
# appended to that JSONL file and rendered into docs/reliability.md.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    import json

    outcome = yield
    rep = outcome.get_result()
    out = os.environ.get("SPECQUANT_RELIABILITY_OUT")
    marker = item.get_closest_marker("faults")
    if not out or marker is None or (rep.when != "call" and rep.passed):
        return
    doc = (item.function.__doc__ or item.name).strip().splitlines()[0]
    # a parametrized case object may carry its own sentence (e.g. the bad-input table's `what`)
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(getattr(value, "what", None), str) and value.what:
            doc = value.what
            break
    params = getattr(getattr(item, "callspec", None), "id", None)
    with open(out, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"nodeid": item.nodeid, "kind": marker.args[0] if marker.args else "fault",
                             "case": params, "what": doc, "outcome": rep.outcome,
                             "seconds": round(rep.duration, 2)}) + "\n")
