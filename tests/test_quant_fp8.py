"""FP8 drafter presets (issue 45) through the real quantize-drafter stage on the fixture world.

llm-compressor writes `fp8-dynamic` (per-channel weights, dynamic per-token activations, data-free) and `fp8`
(per-tensor weights, static per-tensor activation scales chosen by the search over the cached hidden states):
compressed-tensors `float-quantized` configs, E4M3 weights in the safetensors, the ignore list in names vLLM's
runtime layers match, fused groups (gate/up) at one weight and one input scale, and every layer's searched scale
no worse than minmax on the calibration data. What a vLLM range cannot load, or a setting FP8 cannot take, is one
sentence with exit 2 before anything is written. Sizes are read from the fixture.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests import _support

VARIANTS = ("fp8-dynamic", "fp8")


@pytest.fixture(scope="module")
def fp8_world(fixture_world, tmp_path_factory) -> tuple[Path, dict]:
    from pipeline.stages.runner import run_stage

    root = _support.copy_world(fixture_world, tmp_path_factory.mktemp("fp8"))
    results = {}
    for v in VARIANTS:
        full = _support.world_cfg(root, f"quant={v}", overrides_only=True)
        results[v] = run_stage("quantize-drafter", "pipeline.stages.quantize_drafter", _support.compose(full), full)
    return root, results


def _tensors(path: Path) -> dict[str, str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_slice(k).get_dtype() for k in fh.keys()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_checkpoint_is_float_quantized_e4m3_with_runtime_ignore_names(fp8_world, variant):
    from pipeline.serving import contract

    root, _ = fp8_world
    out = root / "qw" / "drafter" / variant
    config = json.loads((out / "config.json").read_text())
    qc = config["transformer_layer_config"]["quantization_config"]
    assert qc == config["quantization_config"]
    assert qc["format"] == "float-quantized" and qc["quant_method"] == "compressed-tensors"
    (group,) = qc["config_groups"].values()
    assert (group["weights"]["num_bits"], group["weights"]["type"]) == (8, "float")
    want = {"fp8-dynamic": ("channel", "token", True), "fp8": ("tensor", "tensor", False)}[variant]
    acts = group["input_activations"]
    assert (group["weights"]["strategy"], acts["strategy"], acts["dynamic"]) == want
    dtypes = _tensors(out)
    geo = _support.geometry()
    # every MLP / o_proj / fc weight is E4M3 beside its fp32 scale; q/k/v stay dense (quantize_qkv false)
    for i in range(geo["layers"]):
        for name in (f"layers.{i}.mlp.gate_proj", f"layers.{i}.mlp.up_proj", f"layers.{i}.mlp.down_proj",
                     f"layers.{i}.self_attn.o_proj"):
            assert dtypes[f"{name}.weight"] == "F8_E4M3", name
            assert f"{name}.weight_scale" in dtypes
            assert (f"{name}.input_scale" in dtypes) == (variant == "fp8"), name
        for p in ("q_proj", "k_proj", "v_proj"):
            assert dtypes[f"layers.{i}.self_attn.{p}.weight"] not in ("F8_E4M3",), p
            assert f"layers.{i}.self_attn.{p}.weight_scale" not in dtypes
    assert dtypes["fc.weight"] == "F8_E4M3"
    # vLLM's runtime names: draft layer i is model.layers.{i+T}, q/k/v fused; its ignore matching keeps qkv dense
    t = geo["target_layers"]
    for prof in contract.PROFILES.values():
        assert contract.vllm_ignores(f"model.layers.{t}.self_attn.qkv_proj", qc["ignore"], prof.split_shards)
        assert not contract.vllm_ignores(f"model.layers.{t}.mlp.gate_up_proj", qc["ignore"], prof.split_shards)
        assert contract.check_dir(out, t, prof) == [], prof.name


def test_fp8_static_scales_are_searched_and_shared_by_fused_layers(fp8_world):
    root, results = fp8_world
    out = root / "qw" / "drafter" / "fp8"
    r = results["fp8"]
    search = r["activation_scale_search"]
    assert search["method"] == "mse" and search["layers"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        stored = {k: float(fh.get_tensor(k).float().reshape(-1)[0]) for k in fh.keys() if k.endswith("_scale")}
    for name, rec in search["layers"].items():
        # never worse than plain minmax on the calibration data; the stored scale is the chosen one
        assert rec["error"]["chosen"] <= rec["error"]["minmax"], name
        assert stored[f"{name}.input_scale"] == pytest.approx(rec["chosen_scale"], rel=1e-6), name
    for i in range(_support.geometry()["layers"]):
        gate, up = f"layers.{i}.mlp.gate_proj", f"layers.{i}.mlp.up_proj"
        assert stored[f"{gate}.input_scale"] == stored[f"{up}.input_scale"]
        assert stored[f"{gate}.weight_scale"] == stored[f"{up}.weight_scale"]  # vLLM requantizes to the max()
    assert r["num_calibration_samples"] > 0
    assert results["fp8-dynamic"]["num_calibration_samples"] == 0  # data-free
    # the reloaded checkpoint runs with its activations quantized (the served numerics) and mostly agrees
    for v in VARIANTS:
        assert results[v]["check"]["served"]["top1_agreement"] > 0.5, v


def _refused(root: Path, *ov: str) -> str:
    rc, out, err = _support.run_main("quantize-drafter", *_support.world_cfg(root, *ov, overrides_only=True))
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err
    return err


def test_refusals_name_the_field_before_anything_is_written(fixture_world, tmp_path):
    from pipeline.quant import recipes

    root = _support.copy_world(fixture_world, tmp_path / "runs")
    err = _refused(root, "quant=fp8", "quant.quantize_qkv=true", "quant.vllm=0.26")
    assert "quant.quantize_qkv" in err and "#51581" in err and "dtype mismatch" in err
    assert "quant.calibration" in _refused(root, "quant=fp8", "quant.calibration=none")
    assert "quant.group_size" in _refused(root, "quant=fp8-dynamic", "quant.group_size=16")
    assert "quant.observer" in _refused(root, "quant=fp8-dynamic", "quant.observer=nvfp4_expanded_mse")
    geo = _support.geometry()
    widths = (geo["hidden"], geo["intermediate"], geo["heads"] * geo["head_dim"])
    if any(w % recipes.SCHEMES["fp8-block"].block[0] for w in widths):
        assert "quant.scheme" in _refused(root, "quant=fp8-block")
    assert not (root / "qw" / "drafter").exists() or not any(
        (root / "qw" / "drafter" / v).exists() for v in ("fp8", "fp8-dynamic", "fp8-block"))


def test_unknown_kv_cache_dtype_is_refused_in_one_sentence(tmp_path):
    rc, out, err = _support.run_main("serve-check", f"runs_root={tmp_path}", "serve.kv_cache_dtype=fp16x")
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "serve.kv_cache_dtype" in err and "fp16x" in err and "auto or fp8" in err
    assert not any(tmp_path.iterdir())
