"""`compose` (Hydra's two steps, the first kept per set of group choices) gives exactly Hydra's own compose:
the same config, the same struct mode, the same errors; and a changed conf/ file is composed again."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from pipeline.core import config as C


def _groups() -> list[list[str]]:
    """Every option of every config group in conf/: list i picks each group's i-th option (experiments, which
    choose other groups' options themselves, one list each)."""
    options = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in sorted(C.CONF_DIR.iterdir()) if d.is_dir()}
    experiments = options.pop("experiment", [])
    rows = [[f"{g}={opts[i]}" for g, opts in options.items() if i < len(opts)]
            for i in range(max(map(len, options.values())))]
    return rows + [[f"experiment={e}"] for e in experiments]


OVERRIDES = [
    [], ["run_name=x", "runs_root=/tmp/somewhere"], ["quant=w4a16", "quant.group_size=64", "run_name=a"],
    ["quant=nvfp4", "+quant.bogus=1"], ["++seed=3"], ["+newkey=1"], ["quant={name: x}"], ["data.sources=[]"],
    ["quant=nvfp4a16", "target_quant=w4a16", "quant.observer=minmax", "target_quant.group_size=32"],
    ["target.path=/x", "quant=nvfp4", "target.path=/y"],  # the later override wins, in both
    # errors: Hydra's, from whichever step raises them
    ["data.num_samples=many"], ["data.max_seq_lenn=3"], ["seed=abc"], ["quant=bogus"], ["~quant.name"],
    ["seed=1,2"], ["hydra.run.dir=x"], ["+quant=nvfp4"], ["quant.name"],
]


def _outcome(fn, overrides, conf):
    try:
        cfg = fn(list(overrides), conf)
    except Exception as exc:  # noqa: BLE001 - the error chain is what is compared
        chain = []
        while exc is not None:
            chain.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__cause__
        return ("error", chain)
    from omegaconf.errors import ConfigAttributeError

    with pytest.raises(ConfigAttributeError):  # struct mode: a key that is not in the schema is refused
        cfg.not_a_key = 1
    return ("config", OmegaConf.to_yaml(cfg), OmegaConf.is_struct(cfg))


@pytest.mark.parametrize("overrides", OVERRIDES + _groups(), ids=lambda ov: " ".join(ov) or "none")
def test_same_config_and_errors_as_hydra(overrides):
    want = _outcome(C.hydra_compose, overrides, C.CONF_DIR)
    assert _outcome(C.compose_fast, overrides, C.CONF_DIR) == want
    assert _outcome(C.compose_fast, overrides, C.CONF_DIR) == want  # the kept first step is not changed by use


def test_a_changed_conf_file_is_composed_again(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(C.CONF_DIR, conf)
    before = C.compose_fast(["quant=w4a16"], conf)
    text = (conf / "quant" / "w4a16.yaml").read_text()
    group = before.quant.group_size
    (conf / "quant" / "w4a16.yaml").write_text(text.replace(f"group_size: {group}", f"group_size: {group * 2}"))
    assert C.compose_fast(["quant=w4a16"], conf).quant.group_size == group * 2
    assert C.compose_fast(["quant=w4a16"], conf) == C.hydra_compose(["quant=w4a16"], conf)
