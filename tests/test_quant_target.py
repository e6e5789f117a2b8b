"""quantize-target on the fixture target: W4A16 (data-free RTN) and NVFP4 calibrated on the blend."""

from __future__ import annotations

import pytest
import torch

from pipeline import quantize_target
from pipeline.io import hash_tree, read_json
from tests.test_quant_world import TARGET, world_cfg, write_blend


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("qtarget")
    write_blend(root / "qw" / "data")
    return root


def test_w4a16_target_is_written_and_reloads_through_transformers(runs):
    result = quantize_target.run(world_cfg(runs, "target_quant=w4a16", "target_quant.group_size=32"))
    out = runs / "qw" / "target" / "w4a16"
    assert {"config.json", "model.safetensors", "recipe.yaml", "generation_config.json"} <= set(result["outputs"])
    qc = read_json(out / "config.json")["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert result["num_calibration_samples"] == 0  # RTN + MSE needs no data
    # the transformers loader dequantizes it independently of our checks
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True))
    dense = AutoModelForCausalLM.from_pretrained(TARGET)
    w, r = model.model.layers[3].mlp.down_proj.weight.float(), dense.model.layers[3].mlp.down_proj.weight
    report = read_json(runs / "qw" / "checks" / "target-w4a16.json")
    assert float((w - r).detach().norm() / r.norm()) == pytest.approx(report["weight_error"]["model.layers.3.mlp.down_proj"],
                                                             rel=1e-2)
    assert len(report["weight_error"]) == 6 * 7  # q/k/v quantized too for the target; lm_head never
    assert torch.equal(model.lm_head.weight, dense.lm_head.weight)
    before = {k: v["sha256"] for k, v in hash_tree(out).items()}
    quantize_target.run(world_cfg(runs, "target_quant=w4a16", "target_quant.group_size=32"))
    assert {k: v["sha256"] for k, v in hash_tree(out).items()} == before


def test_nvfp4_target_calibrates_on_the_blend_token_ids(runs):
    result = quantize_target.run(world_cfg(runs, "target_quant=nvfp4"))
    assert result["num_calibration_samples"] == 4 and result["inputs"]["samples_sha256"]
    scales = result["input_global_scales"]
    assert len(scales) == 6 * 7 and len(set(scales.values())) > 6 and 1.0 not in scales.values()
    report = read_json(runs / "qw" / "checks" / "target-nvfp4.json")
    assert 0.0 < report["weight_error_summary"]["max"] < 0.2
