"""The drafter-family registry (`pipeline.models.families`) and `CheckpointInfo` (`pipeline.models.checkpoint_info`)
on real checkpoints: the tiny world's DFlash and DFlash2 drafters, the golden DFlash and DFlash2 fixtures in both
layouts, the checkpoints quantize-drafter writes (conftest's `quantized_world`), and a third family registered by a
test, which is the whole of what a new family adds to the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import SpecquantError
from pipeline.models import families, validation
from pipeline.models.checkpoint_info import CheckpointInfo, scheme_of
from pipeline.models.families.dflash import DFlash
from pipeline.models.layout import light_config
from pipeline.serving import contract
from tests._support import DFLASH, FIXTURES, REPO

TINY = REPO / "assets" / "tiny"
DRAFTERS = {  # checkpoint -> (family, format)
    TINY / "drafter": ("dflash", "speculators"),
    TINY / "drafter-dflash2": ("dflash2", "speculators"),
    REPO / "assets" / "tiny-hybrid" / "drafter": ("dflash", "speculators"),
    DFLASH / "speculators" / "checkpoint": ("dflash", "speculators"),
    DFLASH / "zlab" / "checkpoint": ("dflash", "zlab"),
    FIXTURES / "dflash2" / "speculators" / "checkpoint": ("dflash2", "speculators"),
    FIXTURES / "dflash2" / "zlab" / "checkpoint": ("dflash2", "zlab"),
}
TARGETS = {TINY / "target": "dense", REPO / "assets" / "tiny-hybrid" / "target": "qwen3_5"}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", list(DRAFTERS), ids=lambda p: str(p.relative_to(REPO)))
def test_each_real_drafter_is_detected_from_its_config_dict_and_its_parsed_config(path):
    name, fmt = DRAFTERS[path]
    assert families.family_of(_config(path)).name == name
    assert families.family_of(light_config(path)).name == name  # what validation and compat hold
    assert validation.drafter_family(validation.check_drafter(path)) == name
    info = CheckpointInfo.read(path)
    assert (info.kind, info.family, info.format, info.quantized, info.scheme) == ("drafter", name, fmt, False, None)
    assert info.drafter_family is families.get(name)
    assert info.num_layers == light_config(path).num_hidden_layers


@pytest.mark.parametrize("path", list(TARGETS), ids=lambda p: str(p.relative_to(REPO)))
def test_a_target_is_no_drafter_and_reads_as_its_target_family(path):
    info = CheckpointInfo.read(path)
    assert families.find(_config(path)) is None
    assert (info.kind, info.family, info.format, info.quantized) == ("target", TARGETS[path], "hf", False)
    assert info.num_layers == _config(path)["num_hidden_layers"] and info.architectures
    with pytest.raises(SpecquantError, match="not a drafter"):
        _ = info.drafter_family


def test_the_two_families_answer_what_differs():
    dflash, dflash2 = families.get("dflash"), families.get("dflash2")
    assert families.names()[:2] == ("dflash", "dflash2")
    assert (dflash.serve_mode, dflash2.serve_mode) == ("engine", "load-and-probe")
    assert (dflash.card_name, dflash2.card_name) == ("DFlash", "DFlash2")
    assert dflash.vllm_method == dflash2.vllm_method == "dflash"
    assert dflash.card_lines() == [] and "hidden_projection" in dflash2.card_lines()[0]
    assert dflash.head_trim_refusal is None and "candidate selector" in dflash2.head_trim_refusal
    d2 = light_config(TINY / "drafter-dflash2")
    dense = dflash2.dense_linears(d2)
    assert dense == [f"layers.{i}.{c}.kernel_projection" for i in range(d2.num_hidden_layers)
                     for c in ("attention_conv", "mlp_conv")] + ["candidate_selector.hidden_projection"]
    assert dflash.dense_linears(light_config(TINY / "drafter")) == []
    assert dflash2.check_notes(d2) == {"top1_of": "candidate_selector path"} and dflash.check_notes(d2) == {}
    assert dflash.config_class() is dflash2.config_class() and dflash.model_class() is dflash2.model_class()


@pytest.mark.parametrize("prof", list(contract.PROFILES))
def test_vllm_linears_and_range_rules_through_the_family(prof):
    """What the families say vLLM builds, per range (the serving contract asks them: `contract.family`), by name:
    DFlash's four fused Linears per layer after `model.fc`; DFlash2's two kernel projections per layer and the
    selector's hidden projection, built dense except `kernel_projection` where the range builds it with the draft's
    quant config; a range without a DFlash2 class refused in one sentence, before any work and in the check."""
    p = contract.profile(prof)
    for path in (TINY / "drafter", TINY / "drafter-dflash2"):
        config = _config(path)
        fam, n = contract.family(config), config["transformer_layer_config"]["num_hidden_layers"]
        assert fam is families.family_of(config)
        base = [f"model.layers.{i + 7}.{m}" for i in range(n)
                for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        quantized = fam.vllm_quantized_linears(config, 7, p)
        if fam.name == "dflash":
            assert fam.vllm_linears(config, 7) == quantized == ["model.fc"] + base
            assert fam.vllm_parameters(config, 7) == [] and fam.profile_problems(p) == []
            fam.refuse_profile(p, "quant")
            assert fam.vllm_record(p) == p.record()
            continue
        convs = [f"model.layers.{i + 7}.{c}.kernel_projection" for i in range(n) for c in ("attention_conv", "mlp_conv")]
        assert sorted(fam.vllm_linears(config, 7)) == sorted(
            ["model.fc"] + base + convs + ["model.candidate_selector.hidden_projection"])
        facts = fam.range_facts(p)  # DFlash2's own facts of the range, kept in its family module
        assert sorted(quantized) == sorted(["model.fc"] + base + (convs if facts.conv_draft_quant else []))
        assert sorted(contract.hf_shards(x, 7)[0] for x in fam.vllm_linears(config, 7)
                      if x not in quantized or x.endswith(".kernel_projection")) == sorted(fam.dense_linears(config))
        record = fam.vllm_record(p)
        assert record == {**p.record(), "dflash2_versions": fam.served_versions(p),
                          "rules": {**p.cites, **facts.cites}}
        assert list(record) == [*p.record(), "dflash2_versions"]  # the keys in the order records were written
        assert fam.recorded_versions(record) == fam.served_versions(p) == {
            "0.26": "none", "0.28-0.31": "0.29.0-0.31.0",
            "0.32+": "0.32.0 and newer (read in 0.32.0-0.34.0)"}[p.name]  # the words records and cards carry
        if facts.first is None:
            with pytest.raises(SpecquantError) as ours:
                fam.refuse_profile(p, "quant")
            assert str(ours.value) == (
                f"`quant.vllm` = '{p.name}': vLLM {p.versions} has no DFlash2 model class "
                f"({facts.cites['dflash2']}), so it cannot serve this DFlash2 drafter; write it for vLLM 0.29 "
                "and newer with quant.vllm=0.28-0.31 or 0.32+.")
            assert fam.profile_problems(p) == [f"it is a DFlash2 drafter and vLLM {p.versions} has no DFlash2 model "
                                               f"class ({facts.cites['dflash2']})"]
        else:
            fam.refuse_profile(p, "quant")
            assert fam.profile_problems(p) == []


def test_checkpoint_info_of_what_quantize_drafter_writes(quantized_world):
    root, results = quantized_world
    want = {"nvfp4": ("fp4", False, True), "nvfp4a16": ("fp4", True, False), "w4a16": ("int4", True, False)}
    for variant, (fmt, weight_only, fp4_act) in want.items():
        path = root / "qw" / "drafter" / variant
        info = CheckpointInfo.read(path)
        assert (info.kind, info.family, info.format, info.quantized) == ("drafter", "dflash", "speculators", True)
        assert info.scheme == results[variant]["scheme"] == variant
        assert (info.weight_format, info.weight_only, info.fp4_activation) == (fmt, weight_only, fp4_act)
        assert list(info.ignore) == results[variant]["ignore_written"]
        parsed = light_config(path)
        assert (info.num_layers, info.num_target_layers) == (parsed.num_hidden_layers, parsed.num_target_layers)
        assert info.architectures == tuple(_config(path)["architectures"])
        vllm_class, vllm_weight_only = contract.vllm_scheme(info.quantization_config)  # serving's view agrees
        assert vllm_weight_only in (None, weight_only) and ("Fp4" in vllm_class) == (fmt == "fp4")
    bf16 = CheckpointInfo.read(root / "qw" / "drafter" / "bf16")
    assert (bf16.quantized, bf16.scheme, bf16.weight_only, bf16.fp4_activation) == (False, None, False, False)


def test_scheme_of_names_every_recipes_preset():
    """The one quantization_config parser gives back each `recipes.SCHEMES` name from the preset's own config
    group, as compressed-tensors writes it."""
    from compressed_tensors.quantization import QuantizationConfig

    from pipeline.quant.recipes import SCHEMES

    for name, scheme in SCHEMES.items():
        qc = QuantizationConfig(config_groups={"group_0": scheme.base()}).model_dump(mode="json")
        assert scheme_of(qc) == name
        info = CheckpointInfo.from_config({**_config(TINY / "target"), "quantization_config": qc})
        assert (info.scheme, info.weight_format) == (name, scheme.number_format)
        assert info.weight_only == (not scheme.quantize_activations)
        vllm_class = {"fp4": "CompressedTensorsW4A4Fp4", "int4": "CompressedTensorsWNA16",
                      "fp8": "CompressedTensorsW8A8Fp8"}[scheme.number_format]  # what serve-check expects vLLM builds
        assert contract.vllm_scheme(qc) == (vllm_class, {"fp4": info.weight_only, "fp8": False}.get(
            scheme.number_format))
    assert scheme_of(None) is None and scheme_of({"config_groups": {}}) is None


class ToyFlash(DFlash):
    """A third family for the test: DFlash's layers under its own speculators type, served dense-only."""

    name = "toyflash"
    card_name = "ToyFlash"
    serve_mode = "load-and-probe"
    validated: list = []

    def detects(self, config) -> bool:
        return (config.get("speculators_model_type") if isinstance(config, dict)
                else getattr(config, "toy", None)) == "toyflash"

    def validate(self, config, tensors=None) -> None:
        self.validated.append(config)

    def card_lines(self) -> list[str]:
        return ["- ToyFlash: nothing kept dense"]


def test_a_third_family_is_one_register_call():
    config = {**_config(TINY / "drafter"), "speculators_model_type": "toyflash", "architectures": ["ToyFlash"]}
    with pytest.raises(SpecquantError, match="no drafter of a registered family"):
        families.family_of(config, "toy/config.json")
    toy = families.register(ToyFlash())
    try:
        assert families.family_of(config) is toy and families.get("toyflash") is toy
        assert families.names()[-1] == "toyflash"
        info = CheckpointInfo.from_config(_config(TINY / "drafter"))
        assert info.family == "dflash"  # the others are still asked after it
        validation.validate_drafter_config(type("Parsed", (), {"toy": "toyflash"})())
        assert len(ToyFlash.validated) == 1
        assert families.family_of(config).card_lines() == ["- ToyFlash: nothing kept dense"]
        with pytest.raises(ValueError, match="already registered"):
            families.register(ToyFlash())
    finally:
        families.unregister("toyflash")
    assert "toyflash" not in families.names()


def test_bad_input_is_one_sentence():
    with pytest.raises(SpecquantError) as e:
        families.get("medusa")
    assert "drafter.family" in str(e.value) and "dflash, dflash2" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecquantError, match="no config.json"):
        CheckpointInfo.read(REPO / "docs")


def test_the_registry_and_checkpoint_info_import_no_torch():
    code = ("import sys; from pipeline.models.checkpoint_info import CheckpointInfo; "
            f"i = CheckpointInfo.read({str(TINY / 'drafter-dflash2')!r}); "
            "assert i.drafter_family.serve_mode == 'load-and-probe'; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
