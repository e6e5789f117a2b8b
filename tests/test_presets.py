"""Presets compose honestly: under every experiment, `quant=<preset>` (and `target_quant=<preset>`) keeps the
preset's own scheme, observer, algorithm, calibration and every other key its file sets. An experiment may only
size the run (how many samples, how long, which target's states), never change what a preset means: an
experiment that set `quant.observer` once turned `quant=w4a16-imatrix` into plain MSE, silently."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipeline.core import config as C

# what an experiment may set in a quant group: the run's size and the target it is calibrated on
RUN_SIZE_KEYS = {"num_samples", "anchors_per_sequence", "max_seq_len", "activation_scale_samples",
                 "heldout_samples", "calibration_target"}
GROUPS = ("quant", "target_quant")


def _names(group: str) -> list[str]:
    return sorted(f.stem for f in (C.CONF_DIR / group).glob("*.yaml"))


def _preset(group: str, name: str) -> dict:
    """The keys a preset file sets, its `defaults` chain (`- <other preset>`, `- _self_`) merged in order."""
    raw = OmegaConf.to_container(OmegaConf.load(C.CONF_DIR / group / f"{name}.yaml"))
    defaults = raw.pop("defaults", None) or []
    out: dict = {}
    for entry in defaults if "_self_" in defaults else [*defaults, "_self_"]:  # Hydra: _self_ last unless placed
        out.update(raw if entry == "_self_" else _preset(group, entry))
    return out


CASES = [(e, g, p) for e in _names("experiment") for g in GROUPS for p in _names(g)]


@pytest.mark.parametrize("experiment,group,preset", CASES, ids=lambda x: str(x))
def test_every_preset_keeps_its_own_keys_under_every_experiment(experiment, group, preset):
    cfg = C.compose([f"experiment={experiment}", f"{group}={preset}"])
    got = OmegaConf.to_container(cfg[group], resolve=True)
    own = {k: v for k, v in _preset(group, preset).items() if k not in RUN_SIZE_KEYS}
    if group == "quant" and got.get("calibration_target") not in (None, "bf16"):
        own["name"] = f"{own['name']}{C.PAIR_SUFFIX}{got['calibration_target']}"  # derive_names, on purpose
    changed = {k: (v, got.get(k)) for k, v in own.items() if got.get(k) != v}
    assert not changed, (f"experiment={experiment} changes what {group}={preset} means "
                         f"(key: (preset's value, composed value)): {changed}")


@pytest.mark.parametrize("experiment", _names("experiment"))
def test_experiments_only_size_the_quant_groups(experiment):
    raw = OmegaConf.to_container(OmegaConf.load(C.CONF_DIR / "experiment" / f"{experiment}.yaml"))
    for group in GROUPS:
        extra = sorted(set(raw.get(group) or {}) - RUN_SIZE_KEYS)
        assert not extra, (f"conf/experiment/{experiment}.yaml sets {group}.{extra[0]}, which overrides every "
                           f"{group} preset's own value; set it in the preset (conf/{group}/) instead")


def test_imatrix_under_the_blend4_experiment_is_imatrix():
    cfg = C.compose(["experiment=qwen3-8b-dflash-nvfp4", "quant=w4a16-imatrix"])
    assert (cfg.quant.scheme, cfg.quant.observer, cfg.quant.name) == ("w4a16", "imatrix_mse", "w4a16-imatrix")
    assert cfg.quant.num_samples == 2027  # the experiment still sizes the run
    blend4 = C.compose(["experiment=qwen3-8b-dflash-nvfp4"])
    assert (blend4.quant.scheme, blend4.quant.observer) == ("nvfp4", "nvfp4_expanded_mse")  # the published recipe
