"""The contract per vLLM range (`pipeline.serving.contract.PROFILES`), on checkpoints quantize-drafter writes.

Each profile's rules are pinned to file:line of the vLLM wheels it cites (0.26.0, 0.28.0-0.31.0, 0.32.0-0.34.0;
`contract.Profile.cites`). Every checkpoint here is written by the real stage on the fixture world: the
session's nvfp4 / nvfp4a16 / w4a16 (written for the default range), one written for 0.26, and an NVFP4 one
with quantized q/k/v (quant.quantize_qkv=true, only 0.32+ serves it). The forms a range rejects are what a
writer produces for another range, or what another writer produces (compressed-tensors' per-layer NVFP4
global scale, a verifier given as a local path).
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.core.errors import SpecquantError
from pipeline.core.io import read_json
from pipeline.serving import contract
from pipeline.stages import quantize_drafter
from tests._support import DRAFTER, TARGET, copy_world, run_main, w4a16_group, world_cfg

T = int(read_json(TARGET / "config.json", "target")["num_hidden_layers"])
LAYERS = int(read_json(DRAFTER / "config.json", "drafter")["transformer_layer_config"]["num_hidden_layers"])
W4_GROUP = w4a16_group()
OLDER = ("0.26", "0.28-0.31")


@pytest.fixture(scope="module")
def world(quantized_world, tmp_path_factory):
    """A private copy of the session's fixture world (nvfp4, nvfp4a16, w4a16 written for the default range)."""
    return copy_world(quantized_world[0], tmp_path_factory.mktemp("pworld"))


@pytest.fixture(scope="module")
def qkv(world):
    """NVFP4 with q/k/v quantized too, written for the default range (0.32+)."""
    quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true", "quant.name=nvfp4-qkv"))
    return world / "qw" / "drafter" / "nvfp4-qkv"


@pytest.fixture(scope="module")
def old(world):
    """W4A16 written for vLLM 0.26 (today's GPU machine)."""
    result = quantize_drafter.run(world_cfg(world, "quant=w4a16", f"quant.group_size={W4_GROUP}", "quant.vllm=0.26",
                                            "quant.name=w4a16-v026"))
    return world / "qw" / "drafter" / "w4a16-v026", result


def _dir(world, variant):
    return world / "qw" / "drafter" / variant


def test_the_default_is_the_newest_range_and_every_rule_cites_a_wheel():
    assert contract.DEFAULT == list(contract.PROFILES)[-1] == "0.32+"
    from pipeline.core.config import QuantConfig

    assert QuantConfig().vllm == contract.DEFAULT
    for prof in contract.PROFILES.values():
        for rule, cite in prof.cites.items():  # a release of the range, a wheel file and its line numbers
            assert prof.first <= cite.split()[0] <= prof.last and ".py:" in cite, (prof.name, rule)


@pytest.mark.parametrize("variant", ["nvfp4", "nvfp4a16", "w4a16", "bf16"])
@pytest.mark.parametrize("prof", list(contract.PROFILES))
def test_dense_qkv_checkpoints_load_in_every_range(world, variant, prof):
    """Written for 0.32+ with q/k/v dense: every range builds every layer as stored (0.26 ignores is_causal)."""
    assert contract.check_dir(_dir(world, variant), T, prof) == []


def test_what_the_written_config_carries_per_range(world, old):
    new = read_json(_dir(world, "w4a16") / "config.json", "config")
    assert new["transformer_layer_config"]["is_causal"] is False and new["sliding_window_non_causal"] is True
    path, result = old
    conf = read_json(path / "config.json", "config")
    assert "is_causal" not in conf["transformer_layer_config"] and conf["sliding_window_non_causal"] is True
    assert result["vllm"]["profile"] == "0.26" and result["vllm"]["versions"] == "0.26.0"
    for prof in contract.PROFILES:
        assert contract.check_dir(path, T, prof) == [], prof


def test_quantized_qkv_loads_from_032_with_one_shared_scale(qkv):
    config, names, scales = contract.read_dir(qkv)
    for i in range(LAYERS):
        assert all(f"layers.{i}.self_attn.{s}_proj.weight_packed" in names for s in "qkv")
        for kind in contract.GLOBAL_SCALES:
            assert len({scales[f"layers.{i}.self_attn.{s}_proj.{kind}"] for s in "qkv"}) == 1, (i, kind)
    assert contract.check_dir(qkv, T, "0.32+") == []
    assert contract.vllm_ignores(f"model.layers.{T}.self_attn.qkv_proj",
                                 config["transformer_layer_config"]["quantization_config"]["ignore"],
                                 split_shards=False) is False


@pytest.mark.parametrize("prof", OLDER)
def test_quantized_qkv_is_what_older_ranges_cannot_serve(qkv, prof):
    problems = contract.check_dir(qkv, T, prof)
    assert len([p for p in problems if "needs a dense qkv_proj" in p]) == LAYERS, problems
    assert all(f"model.layers.{i + T}.self_attn.qkv_proj" in " ".join(problems) for i in range(LAYERS))


def test_a_per_layer_nvfp4_global_scale_is_refused_from_032(qkv):
    """compressed-tensors computes each layer's weight global scale from its own absmax (generate_gparam);
    llm-compressor then makes q/k/v share one. A writer that skips that step stores k_proj's own."""
    from compressed_tensors.quantization.utils import generate_gparam

    from pipeline.models.formats import load_drafter

    config, names, scales = contract.read_dir(qkv)
    w = load_drafter(qkv.parent / "bf16", target=TARGET, dtype=torch.float32).layers[0].self_attn.k_proj.weight.detach()
    own = float(generate_gparam(w.min(), w.max()).reshape(-1)[0])
    shared = scales["layers.0.self_attn.k_proj.weight_global_scale"]
    assert (own,) != shared  # k_proj's own scale is not the shared one
    per_layer = {**scales, "layers.0.self_attn.k_proj.weight_global_scale": (own,)}
    problems = contract.checkpoint_problems(config, names, T, "0.32+", per_layer)
    assert problems == [p for p in problems if f"model.layers.{T}.self_attn.qkv_proj: its shards' NVFP4 "
                        "weight_global_scale differ" in p] and len(problems) == 1, problems
    assert "compressed_tensors_w4a4_nvfp4.py:100-110" in problems[0]


def test_quantize_qkv_for_an_older_range_is_one_sentence_before_any_work(world):
    before = sorted(p.name for p in (world / "qw" / "drafter").iterdir())
    for prof in OLDER:
        rc, _, err = run_main("quantize-drafter", *world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true",
                                                             f"quant.vllm={prof}", "quant.name=refused",
                                                             overrides_only=True))
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("error: `quant.quantize_qkv` = True: vLLM ") and "quant.vllm=0.32+" in err, err
    assert sorted(p.name for p in (world / "qw" / "drafter").iterdir()) == before
    rc, _, err = run_main("quantize-drafter", *world_cfg(world, "quant=w4a16", "quant.vllm=0.27",
                                                         overrides_only=True))
    assert rc == 2 and err.startswith("error: `quant.vllm` = '0.27'") and "0.26, 0.28-0.31, 0.32+" in err, err


def test_a_local_verifier_serves_standalone_only_before_033(world):
    """`vllm serve <drafter dir>`: 0.26-0.32 take the verifier verbatim, 0.33+ refuse a local path."""
    path = _dir(world, "w4a16")
    verifier = read_json(path / "config.json", "config")["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str(TARGET)  # the configured target: a local folder
    for prof in OLDER:
        assert contract.check_dir(path, T, prof, standalone=True) == []
    problems = contract.check_dir(path, T, "0.32+", standalone=True)
    assert len(problems) == 1 and "needs a Hub id that is no local path" in problems[0], problems
    assert "transformers_utils/config.py:860-873, 0.34.0 :905-918" in problems[0]
    assert contract.check_dir(path, T, "0.32+") == []  # the target named explicitly, as every command of ours does


def test_a_hub_id_verifier_serves_standalone_in_every_range(world):
    cfg = world_cfg(world, "quant=w4a16", f"quant.group_size={W4_GROUP}", "quant.name=w4a16-hub",
                    "publish.target_model=Qwen/Qwen3-8B")
    quantize_drafter.run(cfg)
    for prof in contract.PROFILES:
        assert contract.check_dir(_dir(world, "w4a16-hub"), T, prof, standalone=True) == [], prof


@pytest.mark.parametrize("prof", OLDER[1:] + ("0.32+",))
def test_a_causal_flag_is_what_028_and_newer_read_first(world, prof):
    """speculators' converter writes sliding_window_non_causal=false (served causally by every range); from
    0.28 an is_causal=false inside transformer_layer_config wins over it, before it only the flag counts."""
    config, names, scales = contract.read_dir(_dir(world, "w4a16"))
    config["sliding_window_non_causal"] = False
    assert contract.checkpoint_problems(config, names, T, prof, scales) == []
    assert any("sliding_window_non_causal" in p for p in contract.checkpoint_problems(config, names, T, "0.26"))
    del config["transformer_layer_config"]["is_causal"]
    assert any("sliding_window_non_causal" in p for p in contract.checkpoint_problems(config, names, T, prof))


def test_compressed_tensors_own_ignore_list_fails_in_every_range(world, quantized_world):
    native = quantized_world[1]["w4a16"]["ignore_compressed_tensors"]
    config, names, scales = contract.read_dir(_dir(world, "w4a16"))
    for qc in (config["quantization_config"], config["transformer_layer_config"]["quantization_config"]):
        qc["ignore"] = native
    for prof in contract.PROFILES:
        problems = contract.checkpoint_problems(config, names, T, prof, scales)
        assert any(f"model.layers.{T}.self_attn.qkv_proj: the checkpoint stores it dense but vLLM" in p
                   for p in problems), (prof, problems)


def test_profile_records_are_plain_json():
    for prof in contract.PROFILES.values():
        assert json.loads(json.dumps(prof.record()))["profile"] == prof.name
    with pytest.raises(SpecquantError, match=r"`quant.vllm` = 'x'"):
        contract.profile("x")


def test_minmax_input_scales_of_quantized_qkv_are_refused_from_032(world):
    """q reads the block, k/v also the context: static_minmax gives q/k/v different input global scales, which
    0.32+ would serve at their max; refused in one sentence before any work (mse shares one). The write-time
    check of the scales themselves: test_a_per_layer_nvfp4_global_scale_is_refused_from_032."""
    cfg = world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true", "quant.activation_scale=minmax",
                    "quant.name=nvfp4-qkv-minmax")
    with pytest.raises(SpecquantError, match=r"^`quant.activation_scale` = 'minmax': with quantized q/k/v it "
                                             r"calibrates different input scales .* use quant.activation_scale=mse"):
        quantize_drafter.run(cfg)
    assert not (world / "qw" / "drafter" / "nvfp4-qkv-minmax").exists()
