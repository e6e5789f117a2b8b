"""The evaluate stage on the session's fixture world (tests/conftest.py `quantized_world`): the real cache,
quantize-drafter (NVFP4 W4A4, its calibration-free twin, NVFP4A16, W4A16) and quantize-target (W4A16) stage
runs, each with the stage record it writes, and the fixture tokenizer (tests/_support.build_fixture_tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests._support import (
    TARGET,
    build_fixture_tokenizer,
    copy_world,
    geometry,
    nvfp4_qdq_reference,
    world_cfg,
)

SCHEMES = ("nvfp4", "nvfp4-nocalib", "nvfp4a16", "w4a16")  # the drafter variants besides bf16
NEW_TOKENS = 4  # per prompt: the fixture drafter is untrained, so nearly every step emits one token
PROMPTS = {  # in the fixture tokenizer's words
    "chat": ["hello how are you", "what is the answer please", "hello what is your answer"],
    "math": ["what is one plus two", "two plus three equals", "four minus one equals what"],
    "code": ["def add a b return a plus b", "write a function that sums numbers", "code that sums a b"],
}


def _stage(stage: str, overrides: list[str]) -> dict:
    """One stage through `run_stage`, as `python -m pipeline <stage>` runs it (so it writes its stage record)."""
    from pipeline.core.config import compose
    from pipeline.stages.runner import run_stage

    return run_stage(stage, f"pipeline.stages.{stage.replace('-', '_')}", compose(overrides), overrides)


def build_world(root: Path, quantized_runs: Path) -> dict:
    """A copy of the session's quantized fixture world (drafter bf16, nvfp4, nvfp4a16, w4a16 and their
    records) plus quantize-drafter nvfp4-nocalib, quantize-target w4a16, the tokenizer and prompt sets."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    copy_world(quantized_runs, root / "runs")
    tok_dir = build_fixture_tokenizer(root / "tokenizer")
    base = overrides(root / "runs", tok_dir)
    _stage("quantize-drafter", [*base, "quant=nvfp4-nocalib"])
    _stage("quantize-target", [*base, "target_quant=w4a16", f"target_quant.group_size={target_group()}"])
    prompts = {}
    for name, texts in PROMPTS.items():
        prompts[name] = root / "eval" / f"{name}.jsonl"
        prompts[name].parent.mkdir(exist_ok=True)
        prompts[name].write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return {"root": root, "run": root / "runs" / "qw", "prompts": prompts, "target": target,
            "tok_dir": tok_dir, "tok": AutoTokenizer.from_pretrained(tok_dir)}


def target_group() -> int:
    """A W4A16 group size that divides every quantized width of the fixture target (128 at most)."""
    import math

    c = json.loads((TARGET / "config.json").read_text())
    head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
    return math.gcd(128, int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_attention_heads"]) * head_dim,
                    int(c["num_key_value_heads"]) * head_dim)


def overrides(runs_root: Path, tok_dir: Path, *extra: str) -> list[str]:
    """tests/_support.world_cfg's run (`qw`, the fixture pair) with the fixture tokenizer."""
    return [*world_cfg(runs_root, tokenizer=tok_dir, overrides_only=True), *extra]


@pytest.fixture(scope="module")
def world(quantized_world, tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("evalworld"), quantized_world[0])


def compose_for(world: dict, *extra: str, runs_root: Path | None = None):
    from pipeline.core.config import compose

    sets = ",".join(f"{{name:{n},path:'{p}',field:prompt}}" for n, p in world["prompts"].items())
    return compose(overrides(runs_root or world["root"] / "runs", world["tok_dir"], f"eval.prompt_sets=[{sets}]",
                             f"eval.max_new_tokens={NEW_TOKENS}", *extra))


def load_variant(world: dict, variant: str):
    from pipeline.evaluation.fakequant import load_drafter_variant

    return load_drafter_variant(world["run"] / "drafter" / variant, world["target"], torch.float32, "cpu")


def crafted_block(drafter, tok, outlier: float = 40.0):
    """A draft_block input whose aux hidden states carry a few large outlier channels."""
    g = torch.Generator().manual_seed(3)
    n_aux = len(drafter.config.aux_layer_ids)
    aux = torch.randn(1, 6, n_aux * geometry()["hidden"], generator=g)
    aux[..., ::37] *= outlier
    block = torch.full((1, drafter.config.block_size), drafter.config.mask_token_id)
    block[0, 0] = tok.convert_tokens_to_ids("<|im_start|>")
    return aux, block, torch.arange(6 + drafter.config.block_size)[None]


def test_nvfp4_linear_quantizes_its_input_like_vllm(world):
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    drafter, summary = load_variant(world, "nvfp4")
    assert "layers.0.mlp.down_proj" in summary["activation_quantized_modules"]
    assert not any("_proj" in m and "self_attn.o" not in m and "mlp" not in m
                   for m in summary["quantized_modules"]), "q/k/v must stay dense (in ignore)"
    lin = drafter.layers[0].mlp.down_proj
    gs = lin.input_global_scale
    # the scale quantize-drafter chose for this layer (its stage record), read back from the checkpoint; the
    # search may rightly keep the calibration-free 1.0, so its value is not asserted
    from pipeline.artifacts.stage_record import load_record

    chosen = load_record(world["run"], "quantize-drafter-nvfp4").result["input_global_scales"]["layers.0.mlp.down_proj"]
    assert gs.dtype == torch.float32 and float(gs) == chosen
    x = torch.randn(2, 5, geometry()["intermediate"], generator=torch.Generator().manual_seed(0))
    x[..., 7] = 2 * 448 * 6 / float(gs)  # an outlier twice the scale's range (absmax 448*6/gs): its blocks saturate
    y = lin(x)
    ref = torch.nn.functional.linear(nvfp4_qdq_reference(x, gs), lin.weight)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # the same through compressed-tensors' own reference quantize-dequantize
    args = lin.quantization_scheme.input_activations
    scale, zp = compute_dynamic_scales_and_zp(x, args, lin, global_scale=gs)
    ct = fake_quantize(x, scale, zp, args, global_scale=gs)
    torch.testing.assert_close(nvfp4_qdq_reference(x, gs), ct, rtol=0, atol=0)
    assert (y - torch.nn.functional.linear(x, lin.weight)).abs().max() > 1e-3  # inputs really were quantized


def test_nvfp4_logits_differ_from_weights_only_variant(world):
    from pipeline.evaluation.fakequant import set_activation_quantization

    w4a4, _ = load_variant(world, "nvfp4")
    w4a16, s16 = load_variant(world, "nvfp4a16")
    assert s16["activation_quantized_modules"] == []
    weights16 = dict(w4a16.named_parameters())
    for name, p in w4a4.named_parameters():
        if name.endswith("weight"):
            assert torch.equal(p, weights16[name]), name  # same fp4 weights: differences come from activations
    aux, block, pos = crafted_block(w4a4, world["tok"])
    with torch.no_grad():
        a = w4a4.draft_block(aux, block, pos)
        b = w4a16.draft_block(aux, block, pos)
        assert (a - b).abs().max() > 1e-2
        set_activation_quantization(w4a4, False)
        torch.testing.assert_close(w4a4.draft_block(aux, block, pos), b, rtol=1e-5, atol=1e-5)
        set_activation_quantization(w4a4, True)
        # the calibration-free twin differs only in its activation global scales: given its scales, the
        # calibrated drafter computes its logits (whether the search moved any scale or kept the fixed one)
        nocalib, _ = load_variant(world, "nvfp4-nocalib")
        free = {n: m.input_global_scale for n, m in nocalib.named_modules() if hasattr(m, "input_global_scale")}
        for n, m in w4a4.named_modules():
            if n in free:
                m.input_global_scale.data.copy_(free[n])
        torch.testing.assert_close(w4a4.draft_block(aux, block, pos), nocalib.draft_block(aux, block, pos),
                                   rtol=1e-5, atol=1e-5)


def test_quantized_drafter_keeps_spec_decode_lossless(world):
    from pipeline.evaluation.prompts import render
    from pipeline.models.spec_decode import greedy_generate, spec_generate

    target, tok = world["target"], world["tok"]
    for variant in ("nvfp4", "w4a16"):
        drafter, _ = load_variant(world, variant)
        for text in (PROMPTS["math"][0], PROMPTS["code"][2]):
            ids = render(tok, [{"role": "user", "content": text}])
            r = spec_generate(target, drafter, ids, 20, [tok.eos_token_id])
            assert r.output_ids == greedy_generate(target, ids, 20, [tok.eos_token_id])
            assert len(r.acceptance_lengths) >= 1 and all(1 <= t <= geometry()["block_size"] for t in r.acceptance_lengths)


def test_evaluate_stage_writes_results_report_plots_and_commands(world):
    from pipeline.models.spec_decode import measure_tau
    from pipeline.stages import evaluate

    cfg = compose_for(world, "eval.limit=1")
    out = evaluate.run(cfg)
    ev = world["run"] / "eval"
    assert {"results.json", "report.md", "timings.json", "vllm_commands.sh", "tau_per_subset.png",
            "acceptance_per_position.png", "prompts/chat.jsonl"} <= set(out["files"])
    assert out["lossless"] is True
    res = json.loads((ev / "results.json").read_text())
    # the configured drafter (the fixture's, outside the run) first, then the run's variants
    assert res["variant_order"] == ["source", "bf16", *SCHEMES]
    assert res["variants"]["nvfp4"]["quantization"]["activations_quantized"] is True
    assert res["variants"]["w4a16"]["quantization"]["activations_quantized"] is False
    assert res["variants"]["bf16"]["files"]["model.safetensors"]  # checkpoint hashes recorded
    # scheme and calibration come from each variant's stage record
    assert {v: (res["variants"][v]["scheme"], res["variants"][v]["calibration"]) for v in SCHEMES} == {
        "nvfp4": ("nvfp4", "cache"), "nvfp4-nocalib": ("nvfp4", "none"), "nvfp4a16": ("nvfp4a16", "none"),
        "w4a16": ("w4a16", "none")}
    # nvfp4's record: conf/quant/nvfp4.yaml's activation-scale search (the weight observer reads no data)
    recorded = json.loads((world["run"] / "stages" / "quantize-drafter-nvfp4.json").read_text())["resolved_config"]
    assert recorded["quant"]["activation_scale"] == "mse"
    assert res["variants"]["nvfp4"]["what_is_calibrated"] == "activation scale (mse)"
    for v in res["variant_order"]:
        for s in ("chat", "math", "code"):
            st = res["variants"][v]["subsets"][s]
            assert st["drafted_tokens"] == st["steps"] * (geometry()["block_size"] - 1)
            assert abs(sum(st["position_acceptance"]) - (st["tau"] - 1)) < 1e-4  # curve sums to tau - 1
            assert st["accepted_tokens"] == round(st["steps"] * (st["tau"] - 1))
    # the bf16 tau is the one the drafter's own loop measures on the same prompts
    from pipeline.evaluation.fakequant import load_drafter_variant
    from pipeline.evaluation.prompts import load_prompt_sets

    subsets = load_prompt_sets(cfg.eval, world["tok"])
    bf16, _ = load_drafter_variant(world["run"] / "drafter" / "bf16", world["target"], torch.float32, "cpu")
    ref = measure_tau(world["target"], bf16, {s.name: s.prompts for s in subsets}, NEW_TOKENS, res["stop_token_ids"])
    for s in ("chat", "math", "code"):
        assert res["variants"]["bf16"]["subsets"][s]["tau"] == pytest.approx(ref["sets"][s]["mean_tau"], abs=1e-4)
        assert res["variants"]["bf16"]["subsets"][s]["steps"] == ref["sets"][s]["steps"]
    from pipeline.artifacts.eval_results import read_results
    from pipeline.provenance.modelcard import acceptance_table

    table = acceptance_table(read_results(ev), "nvfp4")  # the model card reads the flat rows of results.json
    assert table and "| chat |" in table and f"{res['variants']['nvfp4']['subsets']['chat']['tau']:.3f}" in table
    report = (ev / "report.md").read_text()
    assert "| subset | `source` | `bf16` | `nvfp4` | `nvfp4-nocalib` | `nvfp4a16` | `w4a16` |" in report
    assert "## Calibrated vs calibration-free" in report and "| nvfp4 | `nvfp4` | `nvfp4-nocalib` | chat |" in report
    assert "| **all** |" in report
    cmds = (ev / "vllm_commands.sh").read_text()
    assert cmds.count("  vllm serve") == len(res["variant_order"]) and cmds.count("  vllm bench serve") == len(PROMPTS)
    assert f'"num_speculative_tokens":{geometry()["block_size"] - 1}' in cmds and '"method":"dflash"' in cmds
    from PIL import Image

    for png in ("tau_per_subset.png", "acceptance_per_position.png"):
        with Image.open(ev / png) as im:
            assert im.size[0] > 400 and im.size[1] > 200
    # every variant after the first took at least the prefill of each prompt from the shared target forwards
    timings = json.loads((ev / "timings.json").read_text())
    n_prompts = sum(st["num_prompts"] for st in res["subsets"])
    first, *later = res["variant_order"]
    assert timings["target_forwards"][first]["reused"] == 0
    assert all(timings["target_forwards"][v]["reused"] >= n_prompts for v in later), timings["target_forwards"]
    assert all(timings["speedup"][v] == {s: None for s in timings["speedup"][v]} for v in later)  # not timed whole
    # the same config with every target forward run (eval.target_memo_mb=0) -> byte-identical results, report, plots
    before = {f: (ev / f).read_bytes() for f in ("results.json", "report.md", "tau_per_subset.png")}
    evaluate.run(compose_for(world, "eval.limit=1", "eval.target_memo_mb=0"))
    assert before == {f: (ev / f).read_bytes() for f in before}
    timings = json.loads((ev / "timings.json").read_text())
    assert set(timings["target_forwards"].values()) == {None} and None not in timings["speedup"]["bf16"].values()


@pytest.mark.faults("bad_input")
def test_evaluate_refuses_unknown_variant_before_work(world, tmp_path):
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import evaluate

    cfg = compose_for(world, "eval.variants=[bf16,fp8]", f"runs_root={tmp_path}")
    with pytest.raises(SpecquantError, match="eval.variants"):
        evaluate.run(cfg)
    assert not (tmp_path / "qw" / "eval").exists()


@pytest.mark.faults("bad_input")
def test_cli_unknown_variant_is_one_line_exit_2(world, tmp_path):
    from tests._support import run_main  # the entry point, in this process

    rc, _, err = run_main("evaluate", f"runs_root={tmp_path}", f"drafter.path={world['run'] / 'drafter' / 'bf16'}",
                          "eval.variants=[fp8]")
    assert rc == 2, err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: `eval.variants`") and "fp8" in lines[0]
    assert not (tmp_path / "tiny" / "eval").exists()


def test_quantized_target_is_dequantized_and_still_lossless(world):
    from pipeline.evaluation.fakequant import load_target
    from pipeline.stages import evaluate

    qt = load_target(str(world["run"] / "target" / "w4a16"), torch.float32, "cpu")
    dense, quant = world["target"].model.layers[0].mlp.down_proj, qt.model.layers[0].mlp.down_proj
    assert quant.weight.dtype == torch.float32 and quant.weight.shape == dense.weight.shape
    err = ((quant.weight - dense.weight).norm() / dense.weight.norm()).item()
    assert 1e-3 < err < 0.3  # int4 rounding (groups of target_group()), not a different model
    source = world["root"] / "source-drafter"  # the configured drafter, outside the run (include_source)
    shutil.copytree(world["run"] / "drafter" / "bf16", source)
    cfg = compose_for(world, "eval.limit=1", "eval.target_variant=w4a16", "eval.variants=[source,bf16,nvfp4]",
                      f"runs_root={world['root'] / 'runs-qt'}", f"drafter.path={source}", "eval.include_source=true")
    shutil.copytree(world["run"] / "drafter", world["root"] / "runs-qt" / "qw" / "drafter")
    shutil.copytree(world["run"] / "target", world["root"] / "runs-qt" / "qw" / "target")
    out = evaluate.run(cfg)
    res = json.loads((world["root"] / "runs-qt" / "qw" / "eval" / "results.json").read_text())
    assert out["lossless"] and res["target"]["variant"] == "w4a16"
    assert res["variant_order"] == ["source", "bf16", "nvfp4"] and res["variants"]["source"]["path"] == str(source)
    # this run has no stage records (drafter/ copied alone): the scheme is read off the checkpoint, and no
    # calibration setting is guessed from the variant's name
    assert (res["variants"]["nvfp4"]["scheme"], res["variants"]["nvfp4"]["calibration"]) == ("nvfp4", None)
    assert out["tau"]["source"] == out["tau"]["bf16"]  # identical weights, identical acceptance
    assert res["target"]["path"].endswith("target/w4a16") and "model.safetensors" in res["target"]["files"]
    # the pair matrix: the main table's target first, then every other target of the run, each with every
    # drafter variant of the run (the drafter as given only in the main table)
    pairs = res["pairs"]
    assert pairs["targets"] == ["w4a16", "bf16"]
    assert list(pairs["matrix"]["bf16"]) == list(pairs["matrix"]["w4a16"]) == ["bf16", "nvfp4"]
    for v in ("bf16", "nvfp4"):
        assert pairs["matrix"]["w4a16"][v]["overall"]["tau"] == res["variants"][v]["overall"]["tau"]
        assert all(n == 0 for t in pairs["targets"] for n in pairs["matrix"][t][v]["lossless_mismatches"].values())
        assert set(pairs["matrix"]["bf16"][v]["subsets"]) == set(PROMPTS)
    assert pairs["served"]["w4a16"]["files_sha256"] != pairs["served"]["bf16"]["files_sha256"]
    ev = world["root"] / "runs-qt" / "qw" / "eval"
    assert (ev / "pair_matrix.png").stat().st_size > 1000
    report = (ev / "report.md").read_text()
    assert "## The served pair: every target x every drafter" in report
    assert "| drafter | calibrated on | w4a16: chat |" in report
