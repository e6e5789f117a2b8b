"""quantize-drafter on a DFlash2 drafter (issue 33): the real stage on a cached fixture world, per scheme.

The world: the DFlash2 golden fixture's drafter (tests/fixtures/dflash2/speculators/checkpoint, or
`SPECQUANT_DFLASH2_FIXTURES`) and a Qwen3 target of the fixture's geometry (geometry.json) with the fixture's
own embed_tokens / lm_head and seeded random layers, a synthetic blend, and the real cache stage. Every size
is read from the fixture, so the tests run on any geometry `tests/gen_dflash2_fixtures.py` writes.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.core.errors import SpecquantError
from pipeline.models import families
from pipeline.serving import contract

# the fixture world's pieces live in tests/_support (the DFlash2 serve-check tests build the same world)
from tests._support import DFLASH2_DRAFTER as DRAFTER
from tests._support import DFLASH2_FIXTURES as FIXTURES  # noqa: F401
from tests._support import build_dflash2_world as build_world
from tests._support import dflash2_geometry as geometry
from tests._support import dflash2_quantized_widths as quantized_widths
from tests._support import dflash2_w4a16_group as w4a16_group
from tests._support import dflash2_world_cfg as world_cfg
from tests._support import (
    nvfp4_qdq_reference,
    one_thread,  # noqa: F401 - autouse: one thread, as the other quantize tests
)
from tests._support import write_dflash2_blend as write_blend  # noqa: F401
from tests._support import write_dflash2_target as write_target  # noqa: F401


def _blocks_tile() -> bool:
    """Whether FP8_BLOCK's weight blocks tile every quantized Linear of the fixture (quantize-drafter refuses
    `fp8-block` otherwise: test_fp8_block_is_refused_where_its_blocks_do_not_tile)."""
    from pipeline.quant import recipes

    return not any(w % b for w in quantized_widths() for b in recipes.SCHEMES["fp8-block"].block)


def _variants() -> dict[str, tuple[str, ...]]:
    """Every drafter preset in conf/quant/ (every scheme and algorithm: RTN, GPTQ, imatrix, calibration-free),
    W4A16 ones at the fixture's group size; nvfp4a16-imatrix also with q/k/v quantized (vLLM 0.32+ serves that).
    AWQ needs CUDA and is refused for DFlash2 (`test_awq_is_refused_for_a_dflash2_drafter`). FP8 presets too:
    `fp8-block` where its 128x128 blocks tile the fixture's widths (else its refusal is tested)."""
    out = {}
    for f in sorted((Path(__file__).resolve().parent.parent / "conf" / "quant").glob("*.yaml")):
        name = f.stem
        if name.endswith("-awq") or (name == "fp8-block" and not _blocks_tile()):
            continue
        out[name] = (f"quant={name}",) + ((f"quant.group_size={w4a16_group()}",) if name.startswith("w4a16") else ())
    out["nvfp4a16-imatrix-qkv"] = ("quant=nvfp4a16-imatrix", "quant.quantize_qkv=true",
                                   "quant.name=nvfp4a16-imatrix-qkv")
    return out


# quantize-drafter variants run on the world: quant name -> overrides
VARIANTS = _variants()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, dict]:
    """(runs root, {variant: quantize-drafter's result}): the fixture world, cached, with every VARIANTS entry."""
    from pipeline.stages import quantize_drafter

    root = build_world(tmp_path_factory.mktemp("dflash2-world"))
    return root, {v: quantize_drafter.run(world_cfg(root, *ov)) for v, ov in VARIANTS.items()}


def _layers(g: dict | None = None) -> range:
    return range(json.loads((DRAFTER / "config.json").read_text())["transformer_layer_config"]["num_hidden_layers"])


def expected_sets(qkv: bool) -> tuple[set[str], set[str]]:
    """(quantized, dense) Linear names of the fixture drafter as quantize-drafter writes it."""
    g = geometry()
    quantized, dense = {"fc"}, {"candidate_selector.hidden_projection"}
    for i in _layers(g):
        quantized |= {f"layers.{i}.self_attn.o_proj", *(f"layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down"))}
        dense |= {f"layers.{i}.{c}.kernel_projection" for c in ("attention_conv", "mlp_conv")}
        (quantized if qkv else dense).update(f"layers.{i}.self_attn.{p}_proj" for p in "qkv")
    return quantized, dense


def _quantized_layers(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The Linears a checkpoint stores quantized: packed 4-bit codes (`weight_packed`) or E4M3 weights (FP8)."""
    return ({k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")}
            | {k.removesuffix(".weight") for k in tensors if k.endswith(".weight") and tensors[k].dtype == torch.float8_e4m3fn})


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_written_layers_ignore_and_codebooks(world, variant):
    from pipeline.models.formats import read_tensors

    root, results = world
    out = root / "qw" / "drafter" / variant
    tensors = _tensors(out)
    quantized, dense = expected_sets("quant.quantize_qkv=true" in VARIANTS[variant])
    assert _quantized_layers(tensors) == quantized
    linears = {k.removesuffix(".weight") for k in tensors if k.endswith(".weight") and tensors[k].dim() == 2
               and tensors[k].dtype != torch.float8_e4m3fn}
    assert linears == dense
    # base kernels and codebooks: bare Parameters, the source drafter's bytes (neither a recipe nor a rename
    # touched them); the dense projections too
    source = read_tensors(DRAFTER)
    untouched = [k for k in source if k.endswith((".base_kernel", "_codebook"))] + [f"{n}.weight" for n in dense]
    assert any(k.endswith("_codebook") for k in untouched) and not any(k.endswith("_codebook.weight") for k in tensors)
    for k in untouched:
        assert torch.equal(tensors[k], source[k]), k
    # ignore: the dense projections under vLLM's runtime names (model.layers.{i+T}..., model.candidate_selector...)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2"
    ignore = config["quantization_config"]["ignore"]
    assert ignore == config["transformer_layer_config"]["quantization_config"]["ignore"]
    t = geometry()["target_layers"]
    runtime = {"model.candidate_selector.hidden_projection"} | {
        f"model.layers.{i + t}.{c}.kernel_projection" for i in _layers(geometry()) for c in ("attention_conv", "mlp_conv")}
    assert runtime <= set(ignore)
    assert results[variant]["ignore_written"] == ignore
    assert results[variant]["vllm"]["dflash2_versions"].startswith("0.32.0")
    assert "kernel_projection" in results[variant]["vllm"]["rules"]
    assert results[variant]["check"]["top1_of"] == "candidate_selector path"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_contract_reads_what_was_written(world, variant):
    root, _ = world
    out, t = root / "qw" / "drafter" / variant, geometry()["target_layers"]
    assert contract.check_dir(out, t, "0.32+") == []
    qkv = "quant.quantize_qkv=true" in VARIANTS[variant]
    problems = contract.check_dir(out, t, "0.28-0.31")
    assert (problems != []) == qkv and all("qkv_proj" in p for p in problems)
    assert any("DFlash2 model class" in p for p in contract.check_dir(out, t, "0.26"))
    assert contract.check_dir(root / "qw" / "drafter" / "bf16", t) == []


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # NVFP4's magnitudes by code (bit 3: the sign)


def decode(tensors: dict[str, torch.Tensor], layer: str, fmt: str, group: int) -> torch.Tensor:
    """A quantized layer's weight decoded from the file alone (not through compressed-tensors): NVFP4 = two E2M1
    codes per byte, low nibble first, times fp8 block scale / global scale (compressed-tensors' decompressor
    hands it out in bfloat16); W4A16 = eight unsigned nibbles per int32, low first, minus 8, times the group scale."""
    if fmt == "float-quantized":  # FP8: E4M3 weights times a per-tensor, per-channel or per-block float scale
        w, scale = tensors[f"{layer}.weight"].float(), tensors[f"{layer}.weight_scale"].float()
        if scale.dim() == 2 and scale.shape[1] > 1:  # 2-D blocks: one scale per (rows x cols) tile
            rows, cols = -(-w.shape[0] // scale.shape[0]), -(-w.shape[1] // scale.shape[1])
            scale = scale.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
        return w * scale
    packed, scale = tensors[f"{layer}.weight_packed"], tensors[f"{layer}.weight_scale"].float()
    if fmt == "nvfp4-pack-quantized":
        codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten(-2).long()
        values = torch.tensor(E2M1)[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
        scale = scale / tensors[f"{layer}.weight_global_scale"].float()
        return (values * scale.repeat_interleave(group, -1)).to(torch.bfloat16).float()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    values = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1).flatten(-2).float() - 8
    return values * scale.repeat_interleave(group, -1)


def _activation_qdq(x: torch.Tensor, tensors: dict[str, torch.Tensor], layer: str, acts: dict) -> torch.Tensor:
    """An independent activation quantize-dequantize as the checkpoint's `input_activations` say: NVFP4 (groups
    of 16 at the stored input_global_scale), or FP8 E4M3 at the stored static per-tensor `input_scale`, or with a
    dynamic scale per token (or per group of `group_size` channels of a token): amax / 448, saturating."""
    if acts.get("num_bits") == 4:
        return nvfp4_qdq_reference(x, tensors[f"{layer}.input_global_scale"])
    fmax = torch.finfo(torch.float8_e4m3fn).max
    xf = x.float()
    if not acts.get("dynamic"):
        scale = tensors[f"{layer}.input_scale"].float()
        return ((xf / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    g = xf.unflatten(-1, (-1, int(acts["group_size"]))) if acts.get("strategy") == "group" else xf.unsqueeze(-2)
    scale = (g.abs().amax(-1, keepdim=True) / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    return ((g / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reload_through_our_model_gives_close_logits(world, variant):
    """The checkpoint reloaded through our model (the reloader the check and evaluate use) computes what its
    file says: each quantized weight decoded independently from the file, substituted into the bf16 drafter,
    gives the reload's weights-only logits and selector path; with NVFP4 activations quantized by an
    independent QDQ at the stored input_global_scale, its served logits."""
    from compressed_tensors.quantization import disable_quantization

    from pipeline.models.formats import load_drafter
    from pipeline.quant import cache_batches, checks
    from pipeline.stages.cache import CacheReader
    root, _ = world
    target, out = root / "target", root / "qw" / "drafter" / variant
    reference = load_drafter(root / "qw" / "drafter" / "bf16", target=target, dtype=torch.float32)
    # the source drafter: its dense tensors are the quantized checkpoint's (written as calibrated, in float32)
    independent = load_drafter(DRAFTER, target=target, dtype=torch.float32)
    source = independent.state_dict()
    for k, a in reference.state_dict().items():  # drafter/bf16 is the source drafter in bf16 (its own tensors)
        if k not in ("embed_tokens.weight", "lm_head.weight") and a.is_floating_point():
            assert torch.equal(a, source[k].to(torch.bfloat16).float()), k
    reloaded = checks.load_dequantized(copy.deepcopy(reference), out)
    quantized, dense = expected_sets("quant.quantize_qkv=true" in VARIANTS[variant])
    mods = dict(reloaded.named_modules())
    assert all(getattr(mods[n], "quantization_scheme", None) is None for n in dense)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    acts = qc["config_groups"]["group_0"]["input_activations"]
    tensors = _tensors(out)
    own = dict(independent.named_modules())
    with torch.no_grad():
        for layer in quantized:
            w = decode(tensors, layer, qc["format"], int(weights["group_size"] or 0))
            assert torch.equal(w, mods[layer].weight.float()), layer
            own[layer].weight.copy_(w)
    g = geometry()
    reader = CacheReader(root / "qw" / "cache")
    batch = next(iter(cache_batches.drafter_batches(reader, [0, 1], 8, g["block_size"], g["mask_token_id"], 64, 0)))

    def rel(a, b) -> float:
        return float((a.logits - b.logits).norm() / b.logits.norm())

    with torch.no_grad():
        ref = reference(**batch, select=True)
        served = reloaded(**batch, select=True)
        handles = [own[n].register_forward_pre_hook(
            lambda m, args, n=n: (_activation_qdq(args[0], tensors, n, acts),))
            for n in quantized] if acts is not None else []
        try:
            want_served = independent(**batch, select=True)
        finally:
            for h in handles:
                h.remove()
        want = independent(**batch, select=True)
        reloaded.apply(disable_quantization)
        weights_only = reloaded(**batch, select=True)
    assert rel(weights_only, want) < 1e-5 and torch.equal(weights_only.selected, want.selected)
    assert rel(served, want_served) < 1e-3
    assert rel(weights_only, ref) > 0.0 and served.selected.shape == ref.selected.shape == (1, 8 * g["block_size"])


def test_checks_report_top1_through_the_selector(world):
    """The held-apart check compares the selector's chosen tokens: a drafter whose codebooks differ (same logits)
    has KL 0 and top-1 below 1; the written report has one match bit per counted row."""
    from pipeline.artifacts.check_report import load_report
    from pipeline.models.formats import load_drafter
    from pipeline.quant import cache_batches, drafter_checks
    from pipeline.stages.cache import CacheReader

    root, _ = world
    reference = load_drafter(root / "qw" / "drafter" / "bf16", target=root / "target", dtype=torch.float32)
    other = copy.deepcopy(reference)
    with torch.no_grad():
        other.candidate_selector.successor_codebook.mul_(-1.0)
    g = geometry()
    reader = CacheReader(root / "qw" / "cache")
    batches = list(cache_batches.drafter_batches(reader, list(range(6)), 8, g["block_size"], g["mask_token_id"], 64, 0))
    same = drafter_checks.compare(reference, copy.deepcopy(reference), batches, g["block_size"])["served"]
    assert same["top1_agreement"] == 1.0 and same["kl"] == 0.0 and same["agreement_length"] > 1
    flipped = drafter_checks.compare(reference, other, batches, g["block_size"])["served"]
    assert flipped["kl"] == 0.0 and flipped["top1_agreement"] < 1.0 and flipped["rows"] == same["rows"]
    report = load_report(root / "qw" / "checks", "drafter", "nvfp4")
    assert report.served.rows > 0 and 0.0 < report.served.top1_agreement <= 1.0
    assert len(report.weight_error) == 1 + 4 * len(_layers(g))  # fc + (o, gate, up, down) per layer


def test_dflash2_for_vllm_026_is_refused_before_work(world, tmp_path):
    from pipeline.stages import quantize_drafter

    root, _ = world
    with pytest.raises(SpecquantError) as e:
        quantize_drafter.run(world_cfg(root, "quant=nvfp4", "quant.vllm=0.26", "quant.name=nvfp4-026"))
    msg = str(e.value)
    assert "DFlash2" in msg and "quant.vllm" in msg and "\n" not in msg
    assert not (root / "qw" / "drafter" / "nvfp4-026").exists()
    with pytest.raises(SpecquantError, match="quantize_qkv"):  # q/k/v for a range that needs them dense
        quantize_drafter.run(world_cfg(root, "quant=nvfp4", "quant.vllm=0.28-0.31", "quant.quantize_qkv=true",
                                       "quant.name=nvfp4-qkv-031"))


def _problems(config: dict, names: set[str], prof: str) -> list[str]:
    return contract.checkpoint_problems(config, names, geometry()["target_layers"], prof)


def test_contract_refuses_the_known_dflash2_failures(world):
    """The failure forms users hit, on the written nvfp4 checkpoint's config and tensor names: a kernel_projection
    vLLM 0.31+ builds quantized (not in ignore), a quantized kernel/hidden projection, an `fc` entry that does
    not match vLLM's `model.fc`, quantized q/k/v before 0.32."""
    root, _ = world
    config, names, _ = contract.read_dir(root / "qw" / "drafter" / "nvfp4")
    names, t = set(names), geometry()["target_layers"]
    qc = config["quantization_config"]

    def with_ignore(ignore):
        new = {**qc, "ignore": ignore}
        return {**config, "quantization_config": new,
                "transformer_layer_config": {**config["transformer_layer_config"], "quantization_config": new}}

    # kernel_projection under its HF name only: vLLM 0.31+ builds model.layers.{i+T}...kernel_projection quantized
    hf_only = with_ignore([e for e in qc["ignore"] if not (e.startswith("model.") and "kernel_projection" in e)])
    for prof in ("0.28-0.31", "0.32+"):
        problems = _problems(hf_only, names, prof)
        assert len(problems) == 2 * len(_layers(geometry())) and all("kernel_projection" in p for p in problems)
    # a quantized kernel or hidden projection: no release builds one quantized (hidden) / 0.28-0.30 do not (kernel)
    for layer in ("layers.0.attention_conv.kernel_projection", "candidate_selector.hidden_projection"):
        packed = names - {f"{layer}.weight"} | {f"{layer}.weight_packed"}
        for prof in ("0.28-0.31", "0.32+"):
            assert any(layer.split(".")[-1] in p and "quantized" in p for p in _problems(config, packed, prof))
    # fc kept dense and named `fc` only: vLLM reads `model.fc` and builds it quantized
    dense_fc = names - {n for n in names if n.startswith("fc.")} | {"fc.weight"}
    assert _problems(with_ignore(["fc", *qc["ignore"]]), dense_fc, "0.32+") != []
    assert _problems(with_ignore(["fc", "model.fc", *qc["ignore"]]), dense_fc, "0.32+") == []
    # q/k/v quantized: 0.32+ reads them, 0.28-0.31 needs them dense
    qkv = {f"layers.{i}.self_attn.{p}_proj" for i in _layers(geometry()) for p in "qkv"}
    packed = names - {f"{n}.weight" for n in qkv} | {f"{n}.weight_packed" for n in qkv}
    no_qkv = with_ignore([e for e in qc["ignore"] if "qkv" not in e])
    assert _problems(no_qkv, packed, "0.32+") == []
    assert any("dense qkv_proj" in p for p in _problems(no_qkv, packed, "0.28-0.31"))
    assert contract.checkpoint_problems(config, names, t, "0.32+") == []


def test_awq_is_refused_for_a_dflash2_drafter(tmp_path):
    """AWQ's norm -> gate/up smoothing would rescale the MLP convolution's kernel_projection input (CUDA-only, so
    the refusal is checked directly; the stage calls it before any weight is read)."""
    from pipeline.models import families
    from pipeline.models.formats import load_drafter_config

    dconf = load_drafter_config(DRAFTER)
    family = families.family_of(dconf)
    with pytest.raises(SpecquantError, match="kernel_projection"):
        family.check_settings(world_cfg(tmp_path, "quant=w4a16-awq").quant, dconf, "quant")
    family.check_settings(world_cfg(tmp_path, "quant=w4a16-gptq").quant, dconf, "quant")


def test_fp8_block_is_refused_where_its_blocks_do_not_tile(world):
    """FP8_BLOCK stores one scale per 128x128 weight block: a drafter whose widths it does not tile is refused by
    the stage in one sentence naming `quant.scheme`, before any variant folder is written (where the fixture's
    widths do tile, `fp8-block` is one of VARIANTS and is written and checked like the others)."""
    from pipeline.stages import quantize_drafter

    if _blocks_tile():
        pytest.skip(f"the fixture's widths {quantized_widths()} tile 128x128 blocks: fp8-block is tested as a variant")
    root, _ = world
    cfg = world_cfg(root, "quant=fp8-block")
    with pytest.raises(SpecquantError, match=r"quant\.scheme.*fp8-block.*do not tile"):
        quantize_drafter.run(cfg)
    assert not (Path(cfg.run_dir) / "drafter" / "fp8-block").exists()


def test_reference_loop_drafts_the_selector_path_and_is_lossless(world):
    """spec_decode (the reference loop tau is measured with) drafts a DFlash2 drafter's selector path, as vLLM
    serves it, and stays the target's greedy output; for the source and a quantized drafter alike."""
    from transformers import AutoModelForCausalLM

    from pipeline.models import spec_decode
    from pipeline.models.formats import load_drafter
    from pipeline.quant import checks

    root, _ = world
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32).eval()
    source = load_drafter(DRAFTER, target=root / "target", dtype=torch.float32)
    quantized = checks.load_dequantized(copy.deepcopy(source), root / "qw" / "drafter" / "w4a16-gptq")
    g = geometry()
    prompt = torch.randint(2, g["mask_token_id"], (12,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = spec_decode.greedy_generate(target, prompt, 24)
    for drafter in (source, quantized):
        res = spec_decode.spec_generate(target, drafter, prompt, 24, trace=True)
        assert res.output_ids == greedy and len(res.acceptance_lengths) >= 1
        first = res.draft_calls[0]  # the first block, from the prompt's aux hidden states and an empty cache
        with torch.no_grad():
            hs = target(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
            block = torch.full((1, g["block_size"]), g["mask_token_id"])
            block[0, 0] = greedy[len(prompt)]
            path = drafter.draft_path(spec_decode.aux_hidden(hs, list(drafter.config.aux_layer_ids)), block,
                                      torch.tensor([first["position_ids"]]), drafter.new_cache())
        assert first["draft_tokens"] == path.tokens[0].tolist()


def test_every_dflash2_rule_cites_a_wheel():
    fam = families.get("dflash2")
    for prof in contract.PROFILES.values():
        facts = fam.range_facts(prof)  # every range has DFlash2's facts (RANGES in models/families/dflash2.py)
        assert set(facts.cites) >= {"dflash2"}
        if facts.first is None:
            continue
        assert prof.first <= facts.first <= prof.last and facts.conv_draft_quant
        assert set(facts.cites) == {"dflash2", "kernel_projection", "hidden_projection"}
        for rule, cite in facts.cites.items():  # a release of the range, a wheel file and its line numbers
            assert prof.first <= cite.split()[0] <= prof.last and ".py:" in cite, (prof.name, rule)


VLLM_SRC = Path(os.environ.get("SPECQUANT_VLLM_SRC") or "/tmp/cq_wheels/src")  # <version>/vllm/... unpacked wheels


def _linear_quant_config(source: str, attribute: str) -> str:
    """The `quant_config=` argument of `self.<attribute> = ReplicatedLinear(...)` in a vLLM source file."""
    body = source.split(f"self.{attribute} = ReplicatedLinear(", 1)[1].split(")\n", 1)[0]
    return body.split("quant_config=", 1)[1].split(",", 1)[0].strip()


@pytest.mark.parametrize("version", ["0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"])
def test_profiles_agree_with_the_wheels_dflash2_model(version):
    """Where the unpacked wheels are at hand (`SPECQUANT_VLLM_SRC`): kernel_projection takes the draft's quant
    config from 0.31 (None before), hidden_projection never; a speculators `dflash2` reader from 0.29."""
    model = VLLM_SRC / version / "vllm" / "model_executor" / "models" / "qwen3_dflash2.py"
    if not model.is_file():
        pytest.skip(f"no unpacked vLLM {version} wheel under {VLLM_SRC}")
    source = model.read_text()
    assert _linear_quant_config(source, "kernel_projection") == ("None" if version < "0.31.0" else "quant_config")
    assert _linear_quant_config(source, "hidden_projection") == "None"
    algos = (VLLM_SRC / version / "vllm" / "transformers_utils" / "configs" / "speculators" / "algos.py").read_text()
    assert ('@register_speculator("dflash2")' in algos) == (version >= "0.29.0")
    prof = next(p for p in contract.PROFILES.values() if p.first <= version <= p.last)
    first = families.get("dflash2").range_facts(prof).first
    assert first is not None and first <= max(version, "0.29.0")
