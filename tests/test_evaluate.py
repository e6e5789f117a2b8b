"""The evaluate stage on a tiny world built here: real target, real DFlash drafter, real llm-compressor
checkpoints (NVFP4 W4A4, its calibration-free twin, NVFP4A16, W4A16) in speculators format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests._support import build_chat_tokenizer, nvfp4_qdq_reference, write_stage_record

H, INTER, HEADS, KV, HEAD_DIM = 128, 256, 8, 2, 16  # in_features divisible by 16 (NVFP4) and 128 (W4A16)
BLOCK = 4
QKV_IGNORE = r"re:.*self_attn\.[qkv]_proj$"
SCHEMES = {"nvfp4": "NVFP4", "nvfp4-nocalib": "NVFP4", "nvfp4a16": "NVFP4A16", "w4a16": "W4A16"}
# what each variant's stage record says (the quant preset and the settings _quantize uses: llm-compressor's
# minmax observer; nvfp4's activation global scales from minmax over the calibration batches, nvfp4-nocalib's
# the preset's fixed one, 1.0)
RECORDED = {"nvfp4": ["quant=nvfp4", "quant.observer=minmax", "quant.activation_scale=minmax"],
            "nvfp4-nocalib": ["quant=nvfp4-nocalib", "quant.observer=minmax"],
            "nvfp4a16": ["quant=nvfp4a16", "quant.observer=minmax"],
            "w4a16": ["quant=w4a16", "quant.observer=minmax"]}
PROMPTS = {
    "chat": ["Hello, how are you?", "Tell me about your day.", "What is your name?"],
    "math": ["What is 2 + 3?", "Add 7 and 5.", "Is 9 larger than 4?"],
    "code": ["def add(a, b):", "Write a function that returns a + b.", "print the sum"],
}


class _NullProcessor:
    def save_pretrained(self, *args, **kwargs):
        return None


def _target(tok_dir: Path, out: Path):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=H, intermediate_size=INTER, num_hidden_layers=3,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def _drafter(target, tok, target_dir: Path):
    from pipeline.models.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(1)
    cfg = DFlashConfig(vocab_size=len(tok), hidden_size=H, intermediate_size=INTER, num_hidden_layers=1,
                       num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, block_size=BLOCK,
                       mask_token_id=tok.convert_tokens_to_ids("<|MASK|>"), aux_layer_ids=[1, 2], num_target_layers=3,
                       verifier_name_or_path=str(target_dir), verifier_architectures=["Qwen3ForCausalLM"])
    drafter = DFlashDrafter(cfg)
    drafter.attach_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter.eval()


def _calibration_batches(target, tok, drafter, texts: list[str], new_tokens: int = 12, every: int = 3) -> list[dict]:
    """Drafter forward batches from real target hidden states of greedy continuations."""
    from pipeline.evaluation.prompts import render
    from pipeline.models.spec_decode import aux_hidden, greedy_generate

    batches = []
    for text in texts:
        ids = greedy_generate(target, render(tok, [{"role": "user", "content": text}]), new_tokens)
        t = torch.tensor([ids])
        with torch.no_grad():
            hs = aux_hidden(target(t, output_hidden_states=True).hidden_states, drafter.config.aux_layer_ids)
        anchors = torch.arange(1, len(ids) - BLOCK, every)[None]
        batches.append({"input_ids": t, "hidden_states": hs, "position_ids": torch.arange(len(ids))[None],
                        "document_ids": torch.zeros(1, len(ids), dtype=torch.long),
                        "loss_mask": torch.ones(1, len(ids), dtype=torch.long),
                        "anchor_positions": anchors, "anchor_valid": torch.ones_like(anchors, dtype=torch.bool)})
    return batches


def _train(drafter, batches: list[dict], steps: int = 80) -> None:
    """A few Adam steps on the target's own greedy tokens, so acceptance lengths are not all 1."""
    import torch.nn.functional as F

    from pipeline.models.calibration import aligned_loss_mask, block_labels

    torch.manual_seed(2)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    drafter.train()
    for i in range(steps):
        b = batches[i % len(batches)]
        anchors = b["anchor_positions"].reshape(-1)
        logits = drafter(**b).logits[0]
        labels = block_labels(b["input_ids"], anchors, BLOCK)
        mask = aligned_loss_mask(b["loss_mask"], anchors, b["anchor_valid"], BLOCK)
        loss = (F.cross_entropy(logits, labels, reduction="none") * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()


def _quantize(drafter, variant: str, batches, native_dir: Path, out: Path) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from torch.utils.data import DataLoader

    from pipeline.models.formats import speculators_config_dict

    model = _copy_drafter(drafter, native_dir)
    modifier = QuantizationModifier(targets="Linear", scheme=SCHEMES[variant],
                                    ignore=[QKV_IGNORE, "re:(.*\\.)?lm_head$", "re:(.*\\.)?embed_tokens$"])
    torch.manual_seed(0)
    if variant == "nvfp4":
        oneshot(model=model, dataset=DataLoader(batches, batch_size=None), recipe=[modifier],
                processor=_NullProcessor(), pipeline="basic", num_calibration_samples=len(batches))
    else:
        oneshot(model=model, recipe=[modifier], pipeline="datafree")
    if variant == "nvfp4-nocalib":  # data-free baseline: a fixed activation global scale (1.0)
        for m in model.modules():
            if isinstance(getattr(m, "input_global_scale", None), torch.Tensor):
                m.input_global_scale.data.fill_(1.0)
    tmp = out.parent / f"tmp-{out.name}"
    model.save_pretrained(str(tmp), save_compressed=True)
    qc = json.loads((tmp / "config.json").read_text())["quantization_config"]
    out.mkdir(parents=True)
    shutil.copyfile(tmp / "model.safetensors", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(speculators_config_dict(model.config, quantization_config=qc)))
    shutil.rmtree(tmp)


def _quantize_target(target_dir: Path, out: Path) -> None:
    """A W4A16 target checkpoint (data-free RTN), as quantize-target writes it."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])],
            pipeline="datafree")
    model.save_pretrained(str(out), save_compressed=True)


def _copy_drafter(drafter, native_dir: Path):
    """A fresh copy whose config oneshot can re-read from disk (it reloads `name_or_path`)."""
    from pipeline.models.dflash import DFlashDrafter
    from pipeline.models.formats import save_native

    if not (native_dir / "config.json").is_file():
        save_native(drafter, native_dir)
    model = DFlashDrafter(drafter.config)
    model.load_state_dict(drafter.state_dict())
    model.config.name_or_path = str(native_dir)
    return model.eval()


def _record(root: Path, target_dir: Path, variant: str) -> None:
    """The variant's quantize-drafter stage record, through the record's writer: the drafter is quantized
    here (in this test's own geometry, without a cache), so no stage ran to record it."""
    from pipeline.core.config import compose

    ov = [f"runs_root={root / 'runs'}", "run_name=tiny-eval", f"target.path={target_dir}",
          f"target.tokenizer={target_dir}", f"drafter.path={root / 'runs' / 'tiny-eval' / 'drafter' / 'bf16'}",
          *RECORDED[variant]]
    write_stage_record(root / "runs" / "tiny-eval", "quantize-drafter", compose(ov), ov)


def build_world(root: Path) -> dict:
    """target/, runs/tiny-eval/drafter/{bf16,nvfp4,nvfp4-nocalib,nvfp4a16,w4a16}/, eval/*.jsonl."""
    from pipeline.models.formats import save_speculators

    tok_dir = build_chat_tokenizer(root / "tok")
    target_dir = root / "target"
    target, tok = _target(tok_dir, target_dir)
    drafter = _drafter(target, tok, target_dir)
    run = root / "runs" / "tiny-eval"
    texts = [t for ts in PROMPTS.values() for t in ts]
    _train(drafter, _calibration_batches(target, tok, drafter, texts, new_tokens=24, every=1))
    save_speculators(drafter, run / "drafter" / "bf16", verifier=str(target_dir))
    batches = _calibration_batches(target, tok, drafter, texts[::3])
    for variant in SCHEMES:
        _quantize(drafter, variant, batches, root / "native", run / "drafter" / variant)
        _record(root, target_dir, variant)
    _quantize_target(target_dir, run / "target" / "w4a16")
    prompts = {}
    for name, texts in PROMPTS.items():
        prompts[name] = root / "eval" / f"{name}.jsonl"
        prompts[name].parent.mkdir(exist_ok=True)
        prompts[name].write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return {"root": root, "target_dir": target_dir, "run": run, "prompts": prompts, "target": target, "tok": tok}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)  # 2 shared cores: more threads only spin against other processes
    return build_world(tmp_path_factory.mktemp("evalworld"))


def compose_for(world: dict, *extra: str):
    from pipeline.core.config import compose

    sets = ",".join(f"{{name:{n},path:'{p}',field:prompt}}" for n, p in world["prompts"].items())
    return compose([f"runs_root={world['root'] / 'runs'}", "run_name=tiny-eval",
                    f"target.path={world['target_dir']}", f"target.tokenizer={world['target_dir']}",
                    f"drafter.path={world['run'] / 'drafter' / 'bf16'}", f"eval.prompt_sets=[{sets}]",
                    "eval.max_new_tokens=8", *extra])


def load_variant(world: dict, variant: str):
    from pipeline.evaluation.fakequant import load_drafter_variant

    return load_drafter_variant(world["run"] / "drafter" / variant, world["target"], torch.float32, "cpu")


def crafted_block(drafter, tok, outlier: float = 40.0):
    """A draft_block input whose aux hidden states carry a few large outlier channels."""
    g = torch.Generator().manual_seed(3)
    n_aux = len(drafter.config.aux_layer_ids)
    aux = torch.randn(1, 6, n_aux * H, generator=g)
    aux[..., ::37] *= outlier
    block = torch.full((1, BLOCK), drafter.config.mask_token_id)
    block[0, 0] = tok.convert_tokens_to_ids("<|im_start|>")
    return aux, block, torch.arange(6 + BLOCK)[None]


def test_nvfp4_linear_quantizes_its_input_like_vllm(world):
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    drafter, summary = load_variant(world, "nvfp4")
    assert "layers.0.mlp.down_proj" in summary["activation_quantized_modules"]
    assert not any("_proj" in m and "self_attn.o" not in m and "mlp" not in m
                   for m in summary["quantized_modules"]), "q/k/v must stay dense (in ignore)"
    lin = drafter.layers[0].mlp.down_proj
    gs = lin.input_global_scale
    assert gs.dtype == torch.float32 and float(gs) != 1.0  # the calibrated scale, read from the checkpoint
    x = torch.randn(2, 5, INTER, generator=torch.Generator().manual_seed(0))
    x[..., 7] = 300.0  # an outlier beyond the calibrated range: its blocks saturate
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
        nocalib, _ = load_variant(world, "nvfp4-nocalib")
        assert (nocalib.draft_block(aux, block, pos) - a).abs().max() > 0  # other global scale, other logits


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
            assert len(r.acceptance_lengths) >= 1 and all(1 <= t <= BLOCK for t in r.acceptance_lengths)


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
    assert res["variant_order"] == ["bf16", "nvfp4", "nvfp4-nocalib", "nvfp4a16", "w4a16"]
    assert res["variants"]["nvfp4"]["quantization"]["activations_quantized"] is True
    assert res["variants"]["w4a16"]["quantization"]["activations_quantized"] is False
    assert res["variants"]["bf16"]["files"]["model.safetensors"]  # checkpoint hashes recorded
    # scheme and calibration come from each variant's stage record
    assert {v: (res["variants"][v]["scheme"], res["variants"][v]["calibration"]) for v in SCHEMES} == {
        "nvfp4": ("nvfp4", "cache"), "nvfp4-nocalib": ("nvfp4", "none"), "nvfp4a16": ("nvfp4a16", "none"),
        "w4a16": ("w4a16", "none")}
    assert res["variants"]["nvfp4"]["what_is_calibrated"] == "activation scale (minmax)"
    for v in res["variant_order"]:
        for s in ("chat", "math", "code"):
            st = res["variants"][v]["subsets"][s]
            assert st["drafted_tokens"] == st["steps"] * (BLOCK - 1)
            assert abs(sum(st["position_acceptance"]) - (st["tau"] - 1)) < 1e-4  # curve sums to tau - 1
            assert st["accepted_tokens"] == round(st["steps"] * (st["tau"] - 1))
    # the bf16 tau is the one the drafter's own loop measures on the same prompts
    from pipeline.evaluation.fakequant import load_drafter_variant
    from pipeline.evaluation.prompts import load_prompt_sets

    subsets = load_prompt_sets(cfg.eval, world["tok"])
    bf16, _ = load_drafter_variant(world["run"] / "drafter" / "bf16", world["target"], torch.float32, "cpu")
    ref = measure_tau(world["target"], bf16, {s.name: s.prompts for s in subsets}, 8, res["stop_token_ids"])
    for s in ("chat", "math", "code"):
        assert res["variants"]["bf16"]["subsets"][s]["tau"] == pytest.approx(ref["sets"][s]["mean_tau"], abs=1e-4)
        assert res["variants"]["bf16"]["subsets"][s]["steps"] == ref["sets"][s]["steps"]
    from pipeline.artifacts.eval_results import read_results
    from pipeline.provenance.modelcard import acceptance_table

    table = acceptance_table(read_results(ev), "nvfp4")  # the model card reads the flat rows of results.json
    assert table and "| chat |" in table and f"{res['variants']['nvfp4']['subsets']['chat']['tau']:.3f}" in table
    report = (ev / "report.md").read_text()
    assert "| subset | `bf16` | `nvfp4` | `nvfp4-nocalib` | `nvfp4a16` | `w4a16` |" in report
    assert "## Calibrated vs calibration-free" in report and "| nvfp4 | `nvfp4` | `nvfp4-nocalib` | chat |" in report
    assert "| **all** |" in report
    cmds = (ev / "vllm_commands.sh").read_text()
    assert cmds.count("  vllm serve") == 5 and cmds.count("  vllm bench serve") == 3
    assert '"num_speculative_tokens": 3' in cmds and '"method": "dflash"' in cmds
    from PIL import Image

    for png in ("tau_per_subset.png", "acceptance_per_position.png"):
        with Image.open(ev / png) as im:
            assert im.size[0] > 400 and im.size[1] > 200
    # same config -> byte-identical results, report and plots
    before = {f: (ev / f).read_bytes() for f in ("results.json", "report.md", "tau_per_subset.png")}
    evaluate.run(cfg)
    assert before == {f: (ev / f).read_bytes() for f in before}


@pytest.mark.faults("bad_input")
def test_evaluate_refuses_unknown_variant_before_work(world, tmp_path):
    from pipeline.core.errors import SpecquantError
    from pipeline.stages import evaluate

    cfg = compose_for(world, "eval.variants=[bf16,fp8]", f"runs_root={tmp_path}")
    with pytest.raises(SpecquantError, match="eval.variants"):
        evaluate.run(cfg)
    assert not (tmp_path / "tiny-eval" / "eval").exists()


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
    assert 1e-3 < err < 0.3  # int4 group-128 rounding, not a different model
    source = world["root"] / "source-drafter"  # the configured drafter, outside the run (include_source)
    shutil.copytree(world["run"] / "drafter" / "bf16", source)
    cfg = compose_for(world, "eval.limit=1", "eval.target_variant=w4a16", "eval.variants=[source,bf16,nvfp4]",
                      f"runs_root={world['root'] / 'runs-qt'}", f"drafter.path={source}", "eval.include_source=true")
    shutil.copytree(world["run"] / "drafter", world["root"] / "runs-qt" / "tiny-eval" / "drafter")
    shutil.copytree(world["run"] / "target", world["root"] / "runs-qt" / "tiny-eval" / "target")
    out = evaluate.run(cfg)
    res = json.loads((world["root"] / "runs-qt" / "tiny-eval" / "eval" / "results.json").read_text())
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
    ev = world["root"] / "runs-qt" / "tiny-eval" / "eval"
    assert (ev / "pair_matrix.png").stat().st_size > 1000
    report = (ev / "report.md").read_text()
    assert "## The served pair: every target x every drafter" in report
    assert "| drafter | calibrated on | w4a16: chat |" in report
