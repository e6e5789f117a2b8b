"""Mistakes a second tester found ending in tracebacks: each is now one sentence, exit 2, nothing written."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli


def _tree(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("args, starts", [
    (["evaluate", "eval.prompt_sets=[{name:e,path:EMPTY,field:prompt}]"],
     "error: `eval.prompt_sets[0].path` = 'EMPTY': the file is empty"),
    (["quantize-drafter", "quant.max_seq_len=0"], "error: `quant.max_seq_len` = 0: "),
    (["quantize-target", "target_quant.max_seq_len=0"], "error: `target_quant.max_seq_len` = 0: "),
])
def test_one_sentence_and_nothing_written(args, starts, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    runs = tmp_path / "runs"
    r = run_cli(*[a.replace("EMPTY", str(empty)) for a in args], f"runs_root={runs}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(line) == 1 and line[0].startswith(starts.replace("EMPTY", str(empty)))
    assert [p for p in _tree(runs) if not p.endswith((".lock",))] in ([], ["tiny"])
