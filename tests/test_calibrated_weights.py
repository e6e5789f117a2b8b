"""Calibration that reaches the weights every kernel reads: GPTQ and imatrix drafters on the fixture world.

Real llm-compressor GPTQ / imatrix observers on the drafter's own calibration forward over the real
cache; real manifest, verify and publish on top. Sizes come from the fixture (W4A16 group size: the
largest of 128/64/32/16 dividing every quantized width).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from pipeline.core.io import hash_tree, read_json
from pipeline.stages import quantize_drafter
from tests._support import (
    DRAFTER,
    SHARED_VARIANTS,
    TARGET,
    copy_world,
    target_w4a16_group,
    w4a16_group,
    world_cfg,
)

_TLC = read_json(DRAFTER / "config.json", "drafter")["transformer_layer_config"]
_TC = read_json(TARGET / "config.json", "target")
G = w4a16_group()
GT = target_w4a16_group()  # o_proj's heads x head_dim included


@pytest.fixture(scope="module")
def world(quantized_world, tmp_path_factory):
    """A private copy of the session's fixture world, its w4a16 drafter included (tests/conftest.py)."""
    return copy_world(quantized_world[0], tmp_path_factory.mktemp("cworld"))


def _run(world, *overrides):
    return quantize_drafter.run(world_cfg(world, *overrides))


@pytest.fixture(scope="module")
def gptq(world):
    return _run(world, "quant=w4a16-gptq", f"quant.group_size={G}")


@pytest.fixture(scope="module")
def rtn(quantized_world):
    assert SHARED_VARIANTS["w4a16"] == ("quant=w4a16", f"quant.group_size={G}")
    return quantized_world[1]["w4a16"]  # round to nearest, written once per session


def _check(world, variant):
    return read_json(world / "qw" / "checks" / f"drafter-{variant}.json", "check")


def test_gptq_recipe_is_plain_data_and_gptq_lowers_the_held_apart_layer_output_error(world, gptq, rtn):
    text = (world / "qw" / "drafter" / "w4a16-gptq" / "recipe.yaml").read_text()
    assert "!!python" not in text
    recipe = yaml.safe_load(text)  # what the manifest, the Hub and users load it with
    weights = recipe["default_stage"]["default_modifiers"]["GPTQModifier"]["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == "static" and weights["num_bits"] == 4
    g, r = _check(world, "w4a16-gptq"), _check(world, "w4a16")
    # GPTQ rounds each layer (fc included: its input is the target's concatenated hidden states) against its
    # real inputs; on rows it never saw, its layer outputs stay closer to the bf16 drafter's than RTN's
    assert set(g["layer_output_error_heldout"]) == set(r["layer_output_error_heldout"])
    assert "fc" in g["layer_output_error_heldout"]
    assert g["layer_output_error_summary"]["mean"] < r["layer_output_error_summary"]["mean"]
    assert gptq["num_calibration_samples"] > 0 and rtn["num_calibration_samples"] == 0


def test_imatrix_observer_runs_on_the_calibration_forward(world):
    res = _run(world, "quant=w4a16-imatrix", f"quant.group_size={G}")
    assert res["num_calibration_samples"] > 0 and res["observer"] == "imatrix_mse"
    assert read_json(world / "qw" / "drafter" / "w4a16-imatrix" / "config.json", "c")["quantization_config"][
        "config_groups"]["group_0"]["weights"]["observer"] == "imatrix_mse"


def test_same_seed_gives_byte_identical_gptq_checkpoints(world, gptq, tmp_path):
    other = tmp_path / "again"
    shutil.copytree(world / "qw", other / "qw", ignore=shutil.ignore_patterns("drafter", "checks", "stages"))
    _run(other, "quant=w4a16-gptq", f"quant.group_size={G}")
    a = {k: v["sha256"] for k, v in hash_tree(world / "qw" / "drafter" / "w4a16-gptq").items()}
    b = {k: v["sha256"] for k, v in hash_tree(other / "qw" / "drafter" / "w4a16-gptq").items()}
    assert a == b


def test_another_group_size_never_overwrites_silently(world, gptq):
    from pipeline.stages.runner import run_stage

    ov = [f"runs_root={world}", "run_name=qw", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
          f"drafter.path={DRAFTER}", "drafter.format=speculators", "quant.num_samples=12", "quant.heldout_samples=12",
          "quant.anchors_per_sequence=8", "quant.max_seq_len=64", "quant=w4a16", f"quant.group_size={G}"]
    run_stage("quantize-drafter", "pipeline.stages.quantize_drafter", compose(ov), ov)  # the record the refusal reads
    before = {k: v["sha256"] for k, v in hash_tree(world / "qw" / "drafter" / "w4a16").items()}
    smaller = G // 2
    with pytest.raises(SpecquantError) as exc:
        quantize_drafter.run(compose([*ov, f"quant.group_size={smaller}"]))
    msg = str(exc.value)
    assert msg.startswith("`quant.name` = 'w4a16': ") and f"group_size={G}" in msg and f"group_size={smaller}" in msg
    assert f"quant.name=w4a16-groupsize{smaller}" in msg and msg.count("\n") == 0
    assert {k: v["sha256"] for k, v in hash_tree(world / "qw" / "drafter" / "w4a16").items()} == before
    # the override it names writes a second variant beside the first
    quantize_drafter.run(compose([*ov, f"quant.group_size={smaller}", f"quant.name=w4a16-groupsize{smaller}"]))
    assert (world / "qw" / "drafter" / f"w4a16-groupsize{smaller}" / "config.json").is_file()
    run_stage("quantize-drafter", "pipeline.stages.quantize_drafter", compose(ov), ov)  # the same settings: a re-run


def test_gptq_drafter_and_gptq_target_go_through_manifest_verify_and_publish(world, gptq):
    from pipeline.provenance.verify import verify_dir
    from pipeline.stages import manifest, publish
    from pipeline.stages.runner import run_stage

    base = [f"runs_root={world}", "run_name=qw", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
            f"drafter.path={DRAFTER}", "drafter.format=speculators", "quant.num_samples=12",
            "quant.heldout_samples=12", "quant.anchors_per_sequence=8", "quant.max_seq_len=64",
            "target_quant.num_samples=4", "target_quant.max_seq_len=64"]
    d = [*base, "quant=w4a16-gptq", f"quant.group_size={G}"]
    run_stage("quantize-drafter", "pipeline.stages.quantize_drafter", compose(d), d)
    t = [*base, "target_quant=w4a16", "target_quant.algorithm=gptq", "target_quant.calibration=cache",
         f"target_quant.group_size={GT}", "target_quant.name=w4a16-gptq"]
    run_stage("quantize-target", "pipeline.stages.quantize_target", compose(t), t)
    assert "!!python" not in (world / "qw" / "target" / "w4a16-gptq" / "recipe.yaml").read_text()
    manifest.run(compose(base))
    qrm = json.loads((world / "qw" / "quant_run_manifest.json").read_text())
    entries = {(c["kind"], c["variant"]): c for c in qrm["checkpoints"]}
    for key in (("drafter", "w4a16-gptq"), ("target", "w4a16-gptq")):
        groups = entries[key]["recipe"]["parsed"]["default_stage"]["default_modifiers"]["GPTQModifier"]
        assert groups["actorder"] == "static"
    assert entries[("drafter", "w4a16-gptq")]["serving"]["checked"] is False  # said plainly: not run in vLLM
    assert verify_dir(world / "qw") == []
    publish.run(compose([*base, "publish.variants=[w4a16-gptq]", "publish.target_model=Qwen/Qwen3-8B"]))
    folder = world / "qw" / "publish" / "w4a16-gptq"
    assert verify_dir(folder) == []
    assert yaml.safe_load((folder / "recipe.yaml").read_text())
    assert "not checked in vLLM" in (folder / "README.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_awq_without_cuda_is_refused_in_one_sentence(world):
    with pytest.raises(SpecquantError, match=r"^`quant.algorithm` = 'awq': llm-compressor 0.14's AWQ needs a CUDA"):
        quantize_drafter.validate(world_cfg(world, "quant=w4a16-awq", f"quant.group_size={G}"))
