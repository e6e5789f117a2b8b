"""Every config field of the drafter and target families, refused by every stage that reads the checkpoint (issue 47).

Each field class is tried on the real tiny checkpoints: the DFlash2 drafter (assets/tiny/drafter-dflash2, its
target assets/tiny/target), the hybrid Qwen3.5 target (assets/tiny-hybrid/target with its drafter) and the dense
tiny target. A case copies the checkpoint, edits one field of its config.json and feeds it to each stage that
reads that checkpoint (`python -m pipeline <stage>` through `tests._support.run_main`, the real entry point in this
process; the two mistakes the issue found are also run as real subprocesses): exit 2, one `error:` sentence
naming the field and its value (and a fix), no traceback, in seconds, and the run directory (and convert's DST)
byte for byte as it was. The sizes a case breaks are read from the checkpoints' own configs and headers.

`pipeline.models.validation` holds the one validator per family that all of these go through.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.models import compat, validation
from tests._support import REPO, run_cli, run_main

ASSETS = REPO / "assets"
WORLDS = {  # experiment, drafter, target
    "dflash2": ("tiny-dflash2", ASSETS / "tiny" / "drafter-dflash2", ASSETS / "tiny" / "target"),
    "hybrid": ("tiny-hybrid", ASSETS / "tiny-hybrid" / "drafter", ASSETS / "tiny-hybrid" / "target"),
    "dense": ("tiny", ASSETS / "tiny" / "drafter", ASSETS / "tiny" / "target"),
}
DRAFTER_STAGES = ("cache", "quantize-drafter", "evaluate", "serve-check", "convert")
TARGET_STAGES = ("cache", "quantize-drafter", "quantize-target", "evaluate", "serve-check", "convert")
FAST_S = 10.0


def _conf(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


D2 = _conf(WORLDS["dflash2"][1])  # the DFlash2 drafter (speculators layout)
D2_TLC = D2["transformer_layer_config"]
D2_SHAPES = validation.tensor_shapes(WORLDS["dflash2"][1])
HY = _conf(WORLDS["hybrid"][2])  # the hybrid target
HY_DRAFTER = _conf(WORLDS["hybrid"][1])
DENSE = _conf(WORLDS["dense"][2])
V, H, BS = D2_TLC["vocab_size"], D2_TLC["hidden_size"], D2["block_size"]
GROUPS = D2_SHAPES["layers.0.attention_conv.kernel_projection.weight"][0] // (2 * D2["conv_kernel_size"])
OTHER_GROUP = next(g for g in (2 * D2["conv_group_size"], D2["conv_group_size"] // 2) if H % g == 0)
NOT_DIVIDING = next(g for g in range(D2["conv_group_size"] + 1, H) if H % g)
N_HY = HY["num_hidden_layers"]


@dataclass
class Field:
    id: str
    world: str  # WORLDS key
    side: str  # "drafter" or "target": the checkpoint whose config.json is edited
    edit: Callable[[dict], None]
    needles: tuple[str, ...]  # the field and its value, in the error sentence
    what: str  # one sentence for docs/reliability.md
    pair: bool = False  # a field checked against the target (convert reads the target only when it trims)

    @property
    def stages(self) -> tuple[str, ...]:
        return DRAFTER_STAGES if self.side == "drafter" else TARGET_STAGES


def _top(**kv):
    return lambda c: c.update(kv)


def _tlc(**kv):
    return lambda c: c["transformer_layer_config"].update(kv)


FIELDS = [
    # ---- the DFlash2 drafter: selector, convolution, block, mask, aux layers, layer types, windows
    Field("selector_top_k_beyond_vocab", "dflash2", "drafter", _top(selector_top_k=2 * V),
          ("`drafter.selector_top_k` = " + str(2 * V), str(V)),
          f"a DFlash2 selector_top_k ({2 * V}) larger than the {V}-token vocabulary."),
    Field("selector_rank_unlike_tensors", "dflash2", "drafter", _top(selector_rank=2 * D2["selector_rank"]),
          (f"`drafter.selector_rank` = {2 * D2['selector_rank']}", str(D2["selector_rank"])),
          "a DFlash2 selector_rank unlike the rank of its hidden_projection / codebooks."),
    Field("conv_group_size_unlike_tensors", "dflash2", "drafter", _top(conv_group_size=OTHER_GROUP),
          (f"`drafter.conv_group_size` = {OTHER_GROUP}", f"set conv_group_size to {H // GROUPS}"),
          "a DFlash2 conv_group_size that divides the hidden size but not the one its convolutions were built with."),
    Field("conv_group_size_not_dividing_hidden", "dflash2", "drafter", _top(conv_group_size=NOT_DIVIDING),
          (f"`drafter.conv_group_size` = {NOT_DIVIDING}", str(H)),
          f"a DFlash2 conv_group_size ({NOT_DIVIDING}) that does not divide the hidden size {H}."),
    Field("conv_taps_beyond_block", "dflash2", "drafter", _top(conv_kernel_size=BS + 1),
          (f"`drafter.conv_kernel_size` = {BS + 1}", f"block_size={BS}"),
          "a DFlash2 conv_kernel_size (taps) larger than its block size."),
    Field("conv_taps_unlike_tensors", "dflash2", "drafter", _top(conv_kernel_size=D2["conv_kernel_size"] + 1),
          (f"`drafter.conv_kernel_size` = {D2['conv_kernel_size'] + 1}", f"set conv_kernel_size to "
           f"{D2['conv_kernel_size']}"), "a DFlash2 conv_kernel_size unlike its convolution kernels' taps."),
    Field("block_size_1", "dflash2", "drafter", _top(block_size=1), ("`block_size` = 1", ">= 2"),
          "a DFlash2 drafter with block_size 1."),
    Field("mask_token_id_outside_vocab", "dflash2", "drafter", _top(mask_token_id=V),
          (f"`drafter.mask_token_id` = {V}", f"{V}-token vocabulary"),
          "a DFlash2 mask_token_id equal to the vocabulary size."),
    Field("aux_layers_beyond_target", "dflash2", "drafter",
          _top(aux_hidden_state_layer_ids=[D2["aux_hidden_state_layer_ids"][0], DENSE["num_hidden_layers"] + 2]),
          ("aux_layer_ids", str(DENSE["num_hidden_layers"] + 2)),
          "a DFlash2 drafter's aux layer beyond the target's layers.", pair=True),
    Field("aux_layers_unlike_fc", "dflash2", "drafter", _top(aux_hidden_state_layer_ids=[1]),
          ("`drafter.aux_layer_ids` = [1]", f"{len(D2['aux_hidden_state_layer_ids'])} aux layers"),
          "a DFlash2 drafter listing fewer aux layers than its fc was trained on."),
    Field("drafter_layer_types_short", "dflash2", "drafter", _tlc(layer_types=D2_TLC["layer_types"][:-1]),
          ("`drafter.layer_types`", f"num_hidden_layers is {D2_TLC['num_hidden_layers']}"),
          "a DFlash2 drafter whose layer_types is one entry short."),
    Field("drafter_sliding_without_window", "dflash2", "drafter",
          _tlc(layer_types=["sliding_attention"] * D2_TLC["num_hidden_layers"], sliding_window=None),
          ("`drafter.sliding_window` = None", "sliding_attention"),
          "a DFlash2 drafter with sliding_attention layers and no sliding_window."),
    Field("drafter_layers_unlike_tensors", "dflash2", "drafter", _tlc(
        num_hidden_layers=D2_TLC["num_hidden_layers"] + 1, layer_types=["full_attention"] * (D2_TLC["num_hidden_layers"] + 1)),
          (f"`drafter.num_hidden_layers` = {D2_TLC['num_hidden_layers'] + 1}",),
          "a DFlash2 drafter whose num_hidden_layers is one more than its checkpoint holds."),
    # ---- the hybrid target: layer types, linear-attention sizes, aux layers of its layer mix
    Field("hybrid_layer_types_short", "hybrid", "target", _top(layer_types=HY["layer_types"][:-1]),
          ("`target.layer_types`", f"num_hidden_layers is {N_HY}"),
          "a hybrid target whose layer_types is one entry short of num_hidden_layers."),
    Field("hybrid_layer_type_unknown", "hybrid", "target", _top(layer_types=["gated_deltanet", *HY["layer_types"][1:]]),
          ("`target.layer_types`", "'gated_deltanet'"), "a hybrid target with an unknown layer type."),
    Field("hybrid_layer_types_unlike_tensors", "hybrid", "target", _top(layer_types=HY["layer_types"][::-1]),
          ("`target.layer_types`", "entry 0 says full_attention"),
          "a hybrid target whose layer_types puts the attention layer where the checkpoint has a DeltaNet layer."),
    Field("linear_value_heads_unlike_tensors", "hybrid", "target",
          _top(linear_num_value_heads=HY["linear_num_key_heads"] * 2 * (HY["linear_num_value_heads"] // HY["linear_num_key_heads"])),
          (f"`target.linear_num_value_heads` = {2 * HY['linear_num_value_heads']}",
           f"set linear_num_value_heads to {HY['linear_num_value_heads']}"),
          "a hybrid target's linear_num_value_heads unlike its DeltaNet tensors."),
    Field("linear_value_heads_not_multiple", "hybrid", "target", _top(linear_num_value_heads=HY["linear_num_key_heads"] + 1),
          (f"`target.linear_num_value_heads` = {HY['linear_num_key_heads'] + 1}", "linear_num_key_heads"),
          "a hybrid target's linear_num_value_heads that is not a multiple of linear_num_key_heads."),
    Field("linear_key_head_dim_unlike_tensors", "hybrid", "target", _top(linear_key_head_dim=2 * HY["linear_key_head_dim"]),
          ("linear_key_head_dim", str(2 * HY["linear_key_head_dim"])),
          "a hybrid target's linear_key_head_dim unlike its in_proj_qkv."),
    Field("linear_conv_kernel_unlike_tensors", "hybrid", "target", _top(linear_conv_kernel_dim=HY["linear_conv_kernel_dim"] + 1),
          (f"`target.linear_conv_kernel_dim` = {HY['linear_conv_kernel_dim'] + 1}",),
          "a hybrid target's linear_conv_kernel_dim unlike its conv1d taps."),
    Field("hybrid_hidden_size_unlike_tensors", "hybrid", "target", _top(hidden_size=2 * HY["hidden_size"]),
          (f"`target.hidden_size` = {2 * HY['hidden_size']}",), "a hybrid target's hidden_size unlike its embedding."),
    Field("aux_layers_beyond_hybrid_layers", "hybrid", "drafter",
          _top(aux_hidden_state_layer_ids=[HY_DRAFTER["aux_hidden_state_layer_ids"][0], N_HY + 1]),
          ("aux_layer_ids", str(N_HY + 1), "linear_attention"), "a drafter's aux layer beyond the hybrid target's layers.",
          pair=True),
    # ---- the dense target: layer types and sliding windows
    Field("dense_sliding_without_window", "dense", "target",
          _top(layer_types=["sliding_attention"] * DENSE["num_hidden_layers"], sliding_window=None),
          ("`target.sliding_window` = None", "sliding_attention"),
          "a dense target with sliding_attention layers and no sliding_window."),
    Field("dense_layer_types_short", "dense", "target",
          _top(layer_types=["full_attention"] * (DENSE["num_hidden_layers"] - 1)),
          ("`target.layer_types`", f"num_hidden_layers is {DENSE['num_hidden_layers']}"),
          "a dense target whose layer_types is one entry short."),
]
WHAT = {f.id: f.what for f in FIELDS}


# ---------------------------------------------------------------- the world the cases start from
@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> Path:
    """A run's data/ (the data stage's files, 4 samples) that the cache stage and convert's counts read."""
    from tests._support import write_blend

    data = tmp_path_factory.mktemp("family_validation") / "data"
    write_blend(data, num_samples=4)
    import importlib

    from pipeline.stages import MODULES

    for module in MODULES.values():  # each case's time is its checks', not a stage's first import
        importlib.import_module(module)
    importlib.import_module("pipeline.commands.convert")
    return data


def checkpoint_copy(src: Path, dst: Path, edit: Callable[[dict], None] | None = None) -> Path:
    """config.json (edited) and the other small files copied; the weights linked (only their headers are read)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.is_file():
            shutil.copyfile(f, dst / f.name)
    if edit is not None:
        conf = json.loads((dst / "config.json").read_text())
        edit(conf)
        (dst / "config.json").write_text(json.dumps(conf, indent=2))
    return dst


def tree_hash(root: Path) -> str | None:
    """sha256 over every entry under root (relative path, kind, size, mtime, contents); None if absent."""
    if not root.exists():
        return None
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            h.update(f"{p.relative_to(root)}|{st.st_mode}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            if p.is_file() and not p.is_symlink():
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def setup_case(f: Field, stage: str, case: Path, blend: Path) -> tuple[list[str], Path]:
    """(argv after `python -m pipeline`, the run dir) for field `f` fed to `stage`."""
    experiment, drafter_src, target_src = WORLDS[f.world]
    drafter = checkpoint_copy(drafter_src, case / "drafter", f.edit if f.side == "drafter" else None)
    target = checkpoint_copy(target_src, case / "target", f.edit if f.side == "target" else None)
    run = case / "run"
    shutil.copytree(blend, run / "data")
    if stage in ("evaluate", "serve-check"):  # they read the run's drafters (the reference: drafter/bf16)
        shutil.copytree(drafter, run / "drafter" / "bf16", symlinks=False)  # no link out of the run dir
    if stage == "convert":
        argv = ["convert", "--to", "zlab", str(drafter), str(run / "converted")]
        if f.side == "target" or f.pair:  # the target is read (and the pair checked) when convert trims the head
            argv = ["convert", "--to", "speculators", "--draft-vocab", str(V // 4), "--target", str(target),
                    "--counts-from", str(run), str(drafter), str(run / "converted")]
        return argv, run
    argv = [stage, f"experiment={experiment}", f"run_dir={run}", f"target.path={target}",
            f"target.tokenizer={target_src}", f"drafter.path={drafter}"]
    return argv, run


def check_refusal(rc: int, err: str, needles: tuple[str, ...]) -> str:
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, f"exit code {rc}; stderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert len(errors) == 1, err[-3000:]
    line = errors[0]
    for needle in needles:
        assert needle in line, (needle, line)
    assert ";" in line and line.rstrip().endswith("."), f"no fix in: {line}"
    return line


CASES = [pytest.param(f, s, id=f"{f.id}-{s}") for f in FIELDS for s in f.stages]


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("field, stage", CASES)
def test_bad_field_refused_by_every_stage(field: Field, stage: str, tmp_path: Path, blend: Path):
    argv, run = setup_case(field, stage, tmp_path / "case", blend)
    before = tree_hash(run)
    t0 = time.time()
    rc, _, err = run_main(*argv, env={"OMP_NUM_THREADS": "1"})
    elapsed = time.time() - t0
    line = check_refusal(rc, err, field.needles)
    print(f"{field.id} / {stage}: {line}")
    assert elapsed < FAST_S, f"took {elapsed:.1f}s: work ran before the check"
    assert tree_hash(run) == before, "the run directory changed"


@pytest.mark.faults("bad_input")
@pytest.mark.parametrize("field_id, stage", [("selector_top_k_beyond_vocab", "quantize-drafter"),
                                             ("hybrid_layer_types_short", "cache")])
def test_the_issue_cases_as_real_processes(field_id: str, stage: str, tmp_path: Path, blend: Path):
    """The two mistakes issue 47 found ending in a traceback, now one sentence from a real interpreter."""
    field = next(f for f in FIELDS if f.id == field_id)
    argv, run = setup_case(field, stage, tmp_path / "case", blend)
    before = tree_hash(run)
    res = run_cli(*argv, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    check_refusal(res.returncode, res.stderr, field.needles)
    assert tree_hash(run) == before


def test_the_real_checkpoints_pass_every_validator():
    """The validators accept every shipped checkpoint pair (the cases above are refusals, not a validator that
    refuses everything), and each family's validator is the one picked."""
    for _, drafter, target in WORLDS.values():
        compat.check_checkpoints(drafter, target)
    for p in sorted((REPO / "tests" / "fixtures").glob("dflash*/*/checkpoint")):
        validation.check_drafter(p)
    assert validation.drafter_family(validation.check_drafter(WORLDS["dflash2"][1])) == "dflash2"
    assert validation.drafter_family(validation.check_drafter(WORLDS["dense"][1])) == "dflash"
    from pipeline.models.targets import family_of

    assert family_of(HY).name == "qwen3_5" and family_of(DENSE).name == "dense"


def test_every_field_class_of_the_issue_is_covered():
    ids = {f.id for f in FIELDS}
    assert len(ids) == len(FIELDS)
    for word in ("selector_rank", "selector_top_k", "conv_group_size", "conv_taps", "block_size", "mask_token_id",
                 "aux_layers", "layer_types", "sliding", "linear_"):
        assert any(word in i for i in ids), word
    assert {f.world for f in FIELDS} == set(WORLDS)


def test_a_model_type_the_dense_family_does_not_name_keeps_its_own_layer_kinds():
    """A decoder `targets.family_of` treats as dense without naming it has its sizes and layer count checked, not
    the layer kinds its own class knows (llama4's chunked_attention, say) nor a tensor layout."""
    from pipeline.core.errors import SpecquantError

    kinds = ["chunked_attention", "full_attention"] * (DENSE["num_hidden_layers"] // 2)
    other = {**DENSE, "model_type": "llama4_text", "layer_types": kinds}
    validation.validate_target_config(other, {"model.embed_tokens.weight": (1, 1)})
    with pytest.raises(SpecquantError, match="chunked_attention"):
        validation.validate_target_config({**other, "model_type": "qwen3"})
    with pytest.raises(SpecquantError, match="num_hidden_layers is"):
        validation.validate_target_config({**other, "layer_types": kinds[:-1]})
