"""quantize-target on the fixture target: W4A16 (data-free RTN) and NVFP4 calibrated on the blend."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.io import hash_tree, read_json
from pipeline.stages import quantize_target
from tests._support import TARGET, world_cfg, write_blend


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
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


GPTQ = ("target_quant=w4a16", "target_quant.algorithm=gptq", "target_quant.calibration=cache",
        "target_quant.group_size=32", "target_quant.num_samples=8")


@pytest.mark.slow
def test_torchrun_two_ranks_gptq_target_equals_one_process(tmp_path):
    """llm-compressor's distributed oneshot (data-parallel Hessians, modules split over ranks, shared
    CPU weights) under `torchrun --nproc-per-node 2` writes the same checkpoint as one process."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from pipeline.core.config import compose

    one, two = tmp_path / "one", tmp_path / "two"
    for root in (one, two):
        write_blend(root / "qw" / "data")
    quantize_target.run(world_cfg(one, *GPTQ))
    torchrun = Path(sys.executable).with_name("torchrun")
    torchrun = str(torchrun) if torchrun.exists() else shutil.which("torchrun")
    overrides = [f"runs_root={two}", "run_name=qw", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
                 "target_quant.max_seq_len=64", *GPTQ]
    compose(overrides)  # the same overrides compose here, so a typo fails fast rather than in the subprocess
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "pipeline", "quantize-target",
                          *overrides], cwd=Path(__file__).resolve().parent.parent, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = one / "qw" / "target" / "w4a16", two / "qw" / "target" / "w4a16"
    assert {k: v["sha256"] for k, v in hash_tree(a).items()} == {k: v["sha256"] for k, v in hash_tree(b).items()}
    record = json.loads((two / "qw" / "stages" / "quantize-target-w4a16.json").read_text())
    assert record["launcher"]["world_size"] == 2 and record["result"]["world_size"] == 2
    assert record["result"]["num_calibration_samples"] == 8
    assert read_json(two / "qw" / "checks" / "target-w4a16.json")["reloaded"] is True
    assert not list((two / "qw" / "target").glob(".partial-*"))


def test_data_free_recipe_under_torchrun_is_refused_before_loading(runs, monkeypatch):
    from pipeline.core.errors import SpecquantError

    monkeypatch.setenv("WORLD_SIZE", "2")  # no process group exists: reaching it would fail differently
    with pytest.raises(SpecquantError, match=r"target_quant\.algorithm.*rtn.*data-free.*without torchrun"):
        quantize_target.run(world_cfg(runs, "target_quant=w4a16", "target_quant.group_size=32",
                                      "target_quant.name=w4a16-dist"))
    assert not (runs / "qw" / "target" / "w4a16-dist").exists()


def test_more_processes_than_calibration_samples_is_refused_before_loading(runs, monkeypatch):
    from pipeline.core.errors import SpecquantError

    monkeypatch.setenv("WORLD_SIZE", "8")  # no process group exists: reaching it would fail differently
    with pytest.raises(SpecquantError, match=r"^`target_quant\.num_samples` = 4.*8 processes.*at least 8"):
        quantize_target.run(world_cfg(runs, *GPTQ[:-1], "target_quant.num_samples=4", "target_quant.name=gptq-8"))
    assert not (runs / "qw" / "target" / "gptq-8").exists()
