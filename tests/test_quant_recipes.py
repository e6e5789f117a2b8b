"""Recipe building and validation: wrong settings fail in one sentence before any weight is read."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from pipeline.core.errors import SpecquantError
from pipeline.quant import recipes
from pipeline.stages import quantize_drafter, quantize_target
from tests._support import DRAFTER, geometry, w4a16_group, world_cfg


@pytest.fixture()
def broken_drafter(tmp_path):
    """The fixture drafter with unreadable weights: any error about settings must come before loading."""
    d = tmp_path / "drafter"
    shutil.copytree(DRAFTER, d)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    return d


def _fails(cfg, stage=quantize_drafter) -> str:
    with pytest.raises(SpecquantError) as exc:
        stage.run(cfg)
    msg = str(exc.value)
    assert "\n" not in msg and msg.endswith(".") and not re.search(r"\w\. [A-Z]", msg), msg  # one sentence
    return msg


@pytest.mark.parametrize("override, field, words", [
    ("quant.scheme=int3", "`quant.scheme` = 'int3'", "nvfp4, nvfp4a16, w4a16"),
    ("quant.observer=no_such_observer", "`quant.observer` = 'no_such_observer'", "nvfp4_expanded_mse"),
    ("quant.algorithm=hqq", "`quant.algorithm` = 'hqq'", "rtn, gptq, awq"),
    ("quant.group_size=32", "`quant.group_size` = 32", "set it to 16"),
    # the activation-scale search of quant=nvfp4 (pipeline/quant/act_scale.py)
    ("quant.activation_scale=l2", "`quant.activation_scale` = 'l2'", "minmax, mse"),
    ("quant.activation_scale_multipliers=[1.0,-2.0]", "`quant.activation_scale_multipliers`",
     "-2.0 is not a positive"),
    ("quant.activation_scale_multipliers=[]", "`quant.activation_scale_multipliers`", "needs candidate"),
    ("quant.fixed_activation_amax=0", "`quant.fixed_activation_amax` = 0", "must be positive"),
    ("quant.activation_scale_samples=-1", "`quant.activation_scale_samples` = -1", "whole number"),
    ("quant.rounding_band_factors=[0.9,2.0]", "`quant.rounding_band_factors`", "non-power-of-two"),
])
@pytest.mark.faults("bad_input")
def test_bad_settings_fail_before_loading_weights(tmp_path, broken_drafter, override, field, words):
    cfg = world_cfg(tmp_path / "runs", f"drafter.path={broken_drafter}", override)
    msg = _fails(cfg)
    assert msg.startswith(field) and words in msg
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.faults("bad_input")
def test_group_size_that_does_not_divide_a_layer_fails_before_loading(tmp_path, broken_drafter):
    # int4 groups that cannot tile a layer of the fixture drafter (128, or on a fixture whose widths are all
    # multiples of 128 a larger or odd size; o_proj reads heads x head_dim, fc n_aux x hidden): the sentence
    # names the first such layer
    g = geometry()
    widths = {g["hidden"], g["intermediate"], g["heads"] * g["head_dim"], len(g["aux_layer_ids"]) * g["hidden"]}
    bad = next(n for n in (128, 256, 512, 96, 48, 40, 24) if any(w % n for w in widths))
    cfg = world_cfg(tmp_path / "runs", f"drafter.path={broken_drafter}", "quant=w4a16", f"quant.group_size={bad}")
    msg = _fails(cfg)
    m = re.match(rf"`quant.group_size` = {bad}: it does not divide the in-features (\d+) of (\S+)", msg)
    assert m and int(m[1]) in widths and int(m[1]) % bad, msg
    assert f"e.g. {w4a16_group()}" in msg


@pytest.mark.faults("bad_input")
def test_target_group_size_is_checked_from_config_alone(tmp_path):
    hidden = geometry()["hidden"]
    group = next(n for n in (48, 40, 24, 80) if hidden % n)  # not a divisor of the target's hidden size
    cfg = world_cfg(tmp_path / "runs", "target_quant=w4a16", f"target_quant.group_size={group}")
    msg = _fails(cfg, quantize_target)
    assert msg.startswith(f"`target_quant.group_size` = {group}: it does not divide the in-features {hidden}")


@pytest.mark.faults("bad_input")
def test_gptq_without_calibration_data_is_refused(tmp_path, broken_drafter):
    cfg = world_cfg(tmp_path / "runs", f"drafter.path={broken_drafter}", "quant=w4a16", "quant.algorithm=gptq",
                    "quant.calibration=none")
    assert "GPTQ needs calibration data" in _fails(cfg)


def test_default_ignore_keeps_qkv_embedding_and_head_dense():
    cfg = world_cfg("/tmp/unused")
    default = recipes.resolve_ignore(cfg.quant)
    assert recipes.QKV_IGNORE in default and all(e in default for e in recipes.ALWAYS_IGNORE)
    cfg.quant.quantize_qkv = True
    assert recipes.QKV_IGNORE not in recipes.resolve_ignore(cfg.quant)
    from pipeline.models.formats import load_drafter_config

    names = [n for n, _ in quantize_drafter.drafter_linears(load_drafter_config(DRAFTER), default)]
    assert "fc" in names and "layers.1.mlp.down_proj" in names and "layers.0.self_attn.o_proj" in names
    assert not any(n.endswith(("q_proj", "k_proj", "v_proj")) or n == "lm_head" for n in names)


def test_nvfp4_recipe_has_explicit_groups():
    cfg = world_cfg("/tmp/unused", "quant.observer=mse", "+quant.observer_kwargs={maxshrink: 0.5}")
    mod = recipes.build_modifier(cfg.quant, recipes.resolve_ignore(cfg.quant))
    group = mod.config_groups["group_0"]
    w, a = group.weights, group.input_activations
    assert (w.num_bits, w.type, w.strategy, w.group_size, w.scale_dtype) == (4, "float", "tensor_group", 16,
                                                                           torch.float8_e4m3fn)
    assert w.observer == "mse" and w.observer_kwargs == {"maxshrink": 0.5}
    assert a.dynamic == "local" and a.observer == "static_minmax" and a.group_size == 16
    w4 = recipes.build_modifier(world_cfg("/tmp/unused", "quant=w4a16").quant, []).config_groups["group_0"]
    assert (w4.weights.type, w4.weights.group_size, w4.input_activations) == ("int", 128, None)


_FP8 = torch.float8_e4m3fn
_NVFP4_WEIGHTS = dict(num_bits=4, type="float", symmetric=True, group_size=16, strategy="tensor_group",
                      block_structure=None, dynamic=False, actorder=None, scale_dtype=_FP8, zp_dtype=_FP8)
# what each scheme's checkpoint declares (config.json quantization_config), pinned: built from the
# compressed-tensors presets, so a preset that changes under an upgrade shows up here, not in the bytes
EXPECTED = {
    "nvfp4": (_NVFP4_WEIGHTS, dict(num_bits=4, type="float", symmetric=True, group_size=16, strategy="tensor_group",
                                   block_structure=None, dynamic="local", actorder=None, scale_dtype=_FP8,
                                   zp_dtype=_FP8, observer="static_minmax", observer_kwargs={})),
    "nvfp4a16": (_NVFP4_WEIGHTS, None),
    "w4a16": (dict(num_bits=4, type="int", symmetric=True, group_size=128, strategy="group", block_structure=None,
                   dynamic=False, actorder=None, scale_dtype=None, zp_dtype=torch.int8), None),
    # FP8 E4M3 W8A8 (issue 45): per-tensor / per-channel / 128x128-block weights
    "fp8": (dict(num_bits=8, type="float", symmetric=True, group_size=None, strategy="tensor", block_structure=None,
                 dynamic=False, actorder=None, scale_dtype=None, zp_dtype=_FP8),
            dict(num_bits=8, type="float", symmetric=True, group_size=None, strategy="tensor", block_structure=None,
                 dynamic=False, actorder=None, scale_dtype=None, zp_dtype=_FP8, observer="static_minmax",
                 observer_kwargs={})),
    "fp8-dynamic": (dict(num_bits=8, type="float", symmetric=True, group_size=None, strategy="channel",
                         block_structure=None, dynamic=False, actorder=None, scale_dtype=None, zp_dtype=_FP8),
                    dict(num_bits=8, type="float", symmetric=True, group_size=None, strategy="token",
                         block_structure=None, dynamic=True, actorder=None, scale_dtype=None, zp_dtype=_FP8,
                         observer=None, observer_kwargs={})),
    "fp8-block": (dict(num_bits=8, type="float", symmetric=True, group_size=None, strategy="block",
                       block_structure=[128, 128], dynamic=False, actorder=None, scale_dtype=None, zp_dtype=_FP8),
                  dict(num_bits=8, type="float", symmetric=True, group_size=128, strategy="group",
                       block_structure=None, dynamic=True, actorder=None, scale_dtype=None, zp_dtype=_FP8,
                       observer=None, observer_kwargs={})),
}


def _presets():
    from pipeline.core.config import CONF_DIR

    return [(group, p.stem) for group in ("quant", "target_quant") for p in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.parametrize("group, preset", _presets())
def test_every_preset_builds_the_compressed_tensors_scheme(group, preset):
    from compressed_tensors.quantization import preset_name_to_scheme

    q = world_cfg("/tmp/unused", f"{group}={preset}")[group]
    built = recipes.build_modifier(q, recipes.resolve_ignore(q))
    built = built[-1] if isinstance(built, list) else built  # AWQ: the smoothing modifier, then the quantizer
    scheme = built.config_groups["group_0"]
    weights, acts = EXPECTED[q.scheme]
    observer = {"observer": str(q.observer).lower(), "observer_kwargs": dict(q.observer_kwargs or {})}
    assert dict(scheme.weights) == weights | observer
    assert (dict(scheme.input_activations) if scheme.input_activations else None) == acts
    assert (scheme.targets, scheme.output_activations, scheme.format) == (["Linear"], None, None)
    # the compressed-tensors preset is the same but for the observer the config picks
    base = preset_name_to_scheme(recipes.SCHEMES[q.scheme].preset, ["Linear"])
    assert dict(base.weights) | observer == dict(scheme.weights)
    assert base.input_activations == scheme.input_activations


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("stage, field, preset, observer, fmt, twin", [
    (quantize_drafter, "quant", "w4a16", "nvfp4_expanded_mse", "FP4", "mse"),
    (quantize_drafter, "quant", "w4a16", "nvfp4_expanded_imatrix", "FP4", "imatrix_mse"),
    (quantize_drafter, "quant", "w4a16", "fouroversix", "FP4", "mse"),
    (quantize_drafter, "quant", "nvfp4", "imatrix_mse", "INT4", "nvfp4_expanded_imatrix"),
    (quantize_drafter, "quant", "nvfp4a16", "imatrix_mse", "INT4", "nvfp4_expanded_imatrix"),
    (quantize_target, "target_quant", "w4a16", "nvfp4_expanded_mse", "FP4", "mse"),
    (quantize_target, "target_quant", "nvfp4", "imatrix_mse", "INT4", "nvfp4_expanded_imatrix"),
])
def test_observer_of_the_other_4bit_format_is_refused_before_loading(tmp_path, broken_drafter, stage, field,
                                                                     preset, observer, fmt, twin):
    """An FP4-tuned observer on an int4 scheme, or the int4-tuned one on an FP4 scheme, is one sentence naming the
    observer, the scheme's format and the twin to use, before any weight is read (the drafter's are junk)."""
    cfg = world_cfg(tmp_path / "runs", f"drafter.path={broken_drafter}", f"{field}={preset}",
                    f"{field}.observer={observer}")
    msg = _fails(cfg, stage)
    scheme = cfg[field].scheme
    other = "INT4" if fmt == "FP4" else "FP4"
    assert msg.startswith(f"`{field}.observer` = {observer!r}: it is tuned to {fmt} weights but {field}.scheme "
                          f"{scheme} stores {other} weights; use {field}.observer={twin} for {scheme}, or an {fmt} "
                          f"scheme ({field}.scheme="), msg
    assert not (tmp_path / "runs").exists()  # nothing written


def test_every_format_tuned_observer_and_twin_is_registered_and_every_preset_passes():
    """The table names observers llm-compressor registers, each twin of the format it is offered for; every
    shipped preset (conf/quant, conf/target_quant) passes the check as it is."""
    from pipeline.core.config import compose

    known = set(recipes._registered_observers())
    for key, (made_for, twins) in recipes.FORMAT_OBSERVERS.items():
        assert key in known, key
        for fmt, twin in twins.items():
            assert fmt != made_for and recipes._observer_key(twin) in known
            assert recipes.FORMAT_OBSERVERS.get(recipes._observer_key(twin), (fmt,))[0] == fmt  # tuned to fmt, or either
    conf = quantize_drafter.__file__.rsplit("/pipeline/", 1)[0] + "/conf"
    import pathlib

    for group in ("quant", "target_quant"):
        for preset in sorted(pathlib.Path(conf, group).glob("*.yaml")):
            q = compose([f"{group}={preset.stem}"])[group]
            recipes.check_observer_format(q, group)  # raises on a mismatched preset
