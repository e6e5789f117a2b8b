"""The calibrated NVFP4 activation global-scale search (quant.activation_scale=mse), on the fixture world:
real cache, real oneshot, real compressed-tensors QDQ, real checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from pipeline.core.errors import SpecquantError
from pipeline.core.io import read_json
from pipeline.quant import act_scale, cache_batches
from pipeline.stages import quantize_drafter
from tests._support import (
    DRAFTER,
    TARGET,
    copy_world,
    geometry,
    nvfp4_qdq_reference,
    world_cfg,
)

FIXED = act_scale.fixed_input_global_scale(2688.0)  # 1.0, the calibration-free scale


@pytest.fixture(scope="module")
def world(fixture_world, tmp_path_factory):
    """A private copy of the session's fixture world: blend + cache (tests/conftest.py)."""
    return copy_world(fixture_world, tmp_path_factory.mktemp("sworld"))


@pytest.fixture(scope="module")
def searched(world):
    # q/k/v quantized too, so both kinds of fused groups (q/k/v, gate/up) are searched
    return quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true"))


def _groups(record: dict) -> list[list[str]]:
    fused = [n for g in record["groups"] for n in g]
    return record["groups"] + [[n] for n in record["layers"] if n not in fused]


def test_chosen_scales_are_never_worse_than_fixed_or_minmax_on_calibration_data(world, searched):
    rec = searched["activation_scale_search"]
    layers, scales = rec["layers"], searched["input_global_scales"]
    n = geometry()["layers"]
    assert set(layers) == set(scales) and len(layers) == 1 + 7 * n  # fc + n x (q, k, v, o, gate, up, down)
    assert sorted(len(g) for g in rec["groups"]) == [2] * n + [3] * n  # per layer gate/up and q/k/v
    for group in _groups(rec):
        err = {k: sum(layers[n]["error"][k] for n in group) for k in ("chosen", "fixed", "minmax")}
        assert err["chosen"] <= err["fixed"] and err["chosen"] <= err["minmax"], group
        assert err["chosen"] > 0
        assert len({scales[n] for n in group}) == 1, f"fused layers {group} must share one scale (vLLM)"
        for n in group:
            assert layers[n]["chosen_scale"] == scales[n] and layers[n]["fixed_scale"] == FIXED
            assert layers[n]["minmax_scale"] == pytest.approx(min(searched["minmax_input_global_scales"][m]
                                                                  for m in group), rel=1e-6)
    # the checkpoint holds the chosen scales; the check report and plot carry the record
    out = world / "qw" / "drafter" / "nvfp4"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for n, v in scales.items():
            assert float(f.get_tensor(f"{n}.input_global_scale")) == v
    report = read_json(world / "qw" / "checks" / "drafter-nvfp4.json")
    assert report["activation_scale_search"] == rec
    assert set(report["activation_error_heldout"]) == set(layers)
    assert (world / "qw" / "checks" / "drafter-nvfp4-activation-error.png").stat().st_size > 1000


def test_fc_error_matches_an_independent_computation(world, searched):
    # fc reads the cached hidden states themselves: recompute its error over the calibration samples
    # with an independent NVFP4 QDQ (vLLM semantics) and the drafter's own fc weight
    from pipeline.models.formats import load_drafter
    from pipeline.stages.cache import CacheReader

    fc = searched["activation_scale_search"]["layers"]["fc"]
    w = load_drafter(DRAFTER, target=TARGET, dtype=torch.float32).fc.weight.detach()
    reader = CacheReader(world / "qw" / "cache")
    calib, _ = cache_batches.split_indices(len(reader), 12, 12, 0, True)
    x = torch.cat([reader[i]["hidden_states"][:64].flatten(1).float() for i in calib])
    for key in ("fixed", "minmax", "chosen"):
        g = torch.tensor(fc[f"{key}_scale"], dtype=torch.float32)
        err = float(((nvfp4_qdq_reference(x, g) - x) @ w.T).double().square().sum())
        assert fc["error"][key] == pytest.approx(err, rel=1e-5), key
    assert fc["rows"] == x.shape[0]


def test_search_is_deterministic(world, searched):
    again = quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true", "quant.name=again"))
    assert again["input_global_scales"] == searched["input_global_scales"]
    assert again["activation_scale_search"] == searched["activation_scale_search"]
    assert again["outputs"]["model.safetensors"] == searched["outputs"]["model.safetensors"]


def test_search_reads_only_the_first_activation_scale_samples(world, searched):
    head = quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true",
                                          "quant.activation_scale_samples=3", "quant.name=head3"))
    full = searched["activation_scale_search"]
    assert full["samples"] == searched["num_calibration_samples"] == 12 and head["activation_scale_search"]["samples"] == 3
    rows_head = head["activation_scale_search"]["layers"]["fc"]["rows"]
    assert 0 < rows_head < full["layers"]["fc"]["rows"]
    # the oneshot calibration itself still saw all 12 samples
    assert head["minmax_input_global_scales"] == searched["minmax_input_global_scales"]


def test_minmax_mode_keeps_static_minmax_scales(world, searched):
    # with q/k/v quantized, minmax writes q and k/v scales vLLM 0.32+ cannot serve apart: refused before any work
    with pytest.raises(SpecquantError, match=r"^`quant.activation_scale` = 'minmax': with quantized q/k/v"):
        quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true",
                                       "quant.activation_scale=minmax", "quant.name=refused"))
    assert not (world / "qw" / "drafter" / "refused").exists()
    plain = quantize_drafter.run(world_cfg(world, "quant=nvfp4", "quant.activation_scale=minmax", "quant.name=plain"))
    assert plain["activation_scale_search"] is None and plain["activation_scale"] == "minmax"
    assert plain["input_global_scales"] == plain["minmax_input_global_scales"]
    # the same static minmax statistics as the searched run's, on every layer both quantize (q/k/v dense here)
    mine = plain["minmax_input_global_scales"]
    assert mine and {k: v for k, v in searched["minmax_input_global_scales"].items() if k in mine} == mine


def test_hooks_leave_the_forward_alone_and_qdq_is_the_served_one(world, searched):
    from pipeline.models.formats import load_drafter
    from pipeline.quant import checks
    from pipeline.stages.cache import CacheReader

    model = checks.load_dequantized(load_drafter(world / "qw" / "drafter" / "bf16", target=TARGET,
                                                 dtype=torch.float32), world / "qw" / "drafter" / "nvfp4")
    reader = CacheReader(world / "qw" / "cache")
    batch = cache_batches.drafter_batches(reader, [0], 8, model.config.block_size, int(model.config.mask_token_id),
                                          64, 0)[0]
    modules = act_scale.activation_quantized(model)
    layers = {n: act_scale.LayerError(m.weight, m.quantization_scheme.input_activations,
                                      act_scale.candidates(float(m.input_global_scale), FIXED, [0.5, 2.0]))
              for n, m in modules.items()}
    with torch.no_grad():
        before = model(**batch).logits
        handles = [modules[n].register_forward_pre_hook(layer.hook) for n, layer in layers.items()]
        after = model(**batch).logits
        for h in handles:
            h.remove()
    assert torch.equal(before, after) and all(layer.rows > 0 for layer in layers.values())
    # act_scale.qdq is exactly what the quantized Linear does to its input at run time
    lin = model.layers[0].mlp.down_proj
    x = torch.randn(3, 5, lin.in_features, generator=torch.Generator().manual_seed(0))
    x[..., 3] = 5000.0
    with torch.no_grad():
        served = lin(x)
        ours = torch.nn.functional.linear(act_scale.qdq(x, lin.quantization_scheme.input_activations,
                                                        lin.input_global_scale), lin.weight)
    assert torch.equal(served, ours)


def test_chunked_accumulation_matches_one_pass(monkeypatch):
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, group_size=16, strategy="tensor_group",
                            dynamic="local", scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(24, 64, generator=gen), torch.randn(2, 37, 64, generator=gen) * 50
    scales = act_scale.candidates(20.0, FIXED, [0.5, 2.0])
    # fixed and minmax are always candidates (ties go to them), grid values only when new
    assert [label for label, _ in act_scale.candidates(FIXED, FIXED, [1.0, 2.0])] == ["fixed", "minmax", "minmax*2"]
    whole, chunked = act_scale.LayerError(w, args, scales), act_scale.LayerError(w, args, scales)
    whole.add(x)
    monkeypatch.setattr(act_scale, "CHUNK_ELEMENTS", 64 * 5)  # 5 rows at a time: 15 chunks
    chunked.add(x[:1])
    chunked.add(x[1:])
    assert whole.rows == chunked.rows == 74
    assert chunked.errors == pytest.approx(whole.errors, rel=1e-6)  # fp32 matmuls of other shapes
    assert chunked.energy == pytest.approx(whole.energy, rel=1e-6)
    ref = [float(((nvfp4_qdq_reference(x, torch.tensor(g)) - x) @ w.T).double().square().sum()) for _, g in scales]
    assert whole.errors == pytest.approx(ref, rel=1e-6)


def test_search_leaves_the_fixed_scale_where_activations_exceed_it(massive_world):
    # hidden states ~3e4: the fixed scale (absmax 2688) clips fc's input; the search must move away
    # from it, and the scale it picks on calibration data must also beat it on held-apart data
    root, _, result = massive_world  # quantize-drafter quant=nvfp4 quant.observer=minmax on it (conftest)
    fc = result["activation_scale_search"]["layers"]["fc"]
    assert fc["chosen"] != "fixed" and fc["chosen_scale"] < 0.2 * FIXED
    assert fc["error"]["chosen"] < 0.5 * fc["error"]["fixed"]
    held = read_json(root / "qw" / "checks" / "drafter-nvfp4.json")["activation_error_heldout"]["fc"]
    assert held["calibrated_scale"] == fc["chosen_scale"]
    assert held["relative_error"]["calibrated"] < 0.5 * held["relative_error"]["fixed"]


def _report(ids: list[str], bits: str, ref: str):
    """A drafter check report (`pipeline.artifacts.check_report`) with 8 held-apart rows and only `served` set."""
    from pipeline.artifacts.check_report import Agreement, DrafterCheck

    return DrafterCheck(kind="drafter", variant="v", checkpoint="drafter/v", reference="drafter/bf16", scheme="nvfp4",
                        observer="minmax", calibration="cache", reloaded=True, heldout_samples=len(ids),
                        heldout_anchors=8, heldout_sample_ids=ids, weight_error={}, weight_error_summary={},
                        layer_output_error_heldout={}, layer_output_error_summary={},
                        served=Agreement(kl=0.0, top1_agreement=0.0, rows=8, agreement_length=1.0, blocks=8,
                                         top1_match_bits=bits, reference_top1_sha256=ref))


def test_paired_statistics():
    from pipeline.quant import paired

    assert paired.mcnemar_exact(0, 5) == pytest.approx(2 / 32)  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    assert paired.mcnemar_exact(3, 3) == 1.0 and paired.mcnemar_exact(0, 0) == 1.0
    assert paired.mcnemar_exact(2, 10) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    bits = [torch.tensor([True, False, True]), torch.tensor([True, True, False, False, True])]
    hexbits = paired.pack_bits(bits)
    assert paired.unpack_bits(hexbits, 8) == [True, False, True, True, True, False, False, True]
    ref = paired.ids_sha256([torch.arange(8)])
    a = _report(["s/1"], hexbits, ref)
    b = _report(["s/1"], paired.pack_bits([torch.tensor([True] * 8)]), ref)
    cmp = paired.paired_top1(a, b)
    assert (cmp["only_a"], cmp["only_b"], cmp["both"]) == (0, 3, 5) and cmp["mcnemar_p"] == pytest.approx(0.25)
    assert paired.paired_top1(a, dataclasses.replace(b, heldout_sample_ids=["s/2"])) is None  # other rows: no pairing
    units_a, units_b = [(10.0, 4), (6.0, 3), (9.0, 2)], [(8.0, 4), (6.0, 3), (9.0, 3)]
    boot = paired.bootstrap_ratio_difference(units_a, units_b, seed=0, resamples=500)
    assert boot["difference"] == pytest.approx(25 / 9 - 23 / 10)
    assert boot["ci95"][0] <= boot["difference"] <= boot["ci95"][1]
    assert boot == paired.bootstrap_ratio_difference(units_a, units_b, seed=0, resamples=500)


def test_rounding_band_is_reported_reproducible_and_leaves_the_scales_alone(world, searched):
    from pipeline.artifacts.rundir import RunDir
    from pipeline.models.formats import load_drafter
    from pipeline.quant import checks, drafter_checks

    report = read_json(world / "qw" / "checks" / "drafter-nvfp4.json")
    band = report["served_rounding_band"]
    assert band["factors"] == [0.794, 0.891, 1.122, 1.26] and len(band["top1_agreement"]) == 4
    assert all(0.0 < t <= 1.0 for t in band["top1_agreement"])
    assert searched["check"]["served_rounding_band"] == band
    # rebuild the check's inputs and draw again: factor 1 reproduces the served top-1, 1.26 the band's
    # last draw, and the scales are left as found
    cfg = world_cfg(world, "quant=nvfp4", "quant.quantize_qkv=true")
    rd = RunDir.from_cfg(cfg)
    from pipeline.stages.cache import CacheReader

    reader = CacheReader(rd.cache)
    reference_cfg = read_json(DRAFTER / "config.json", "drafter")  # block size and mask id of the fixture drafter
    ids = report["heldout_sample_ids"]
    by_id = {s["id"]: i for i, s in enumerate(reader.index["samples"])}
    bs, mask = int(reference_cfg["block_size"]), int(reference_cfg["mask_token_id"])
    held = cache_batches.drafter_batches(reader, [by_id[i] for i in ids], int(cfg.quant.anchors_per_sequence), bs,
                                         mask, int(cfg.quant.max_seq_len),
                                         int(cfg.seed) + cache_batches.HELDOUT_SEED_OFFSET)
    reference = load_drafter(rd.drafter("bf16"), target=TARGET, dtype=torch.float32)
    quantized = checks.load_dequantized(load_drafter(rd.drafter("bf16"), target=TARGET, dtype=torch.float32),
                                        rd.drafter("nvfp4"))
    before = {n: m.input_global_scale.clone() for n, m in act_scale.activation_quantized(quantized).items()}
    again = drafter_checks.compare(reference, quantized, held, bs, [1.0, 1.26])["served_rounding_band"]
    assert again["top1_agreement"] == [report["served"]["top1_agreement"], band["top1_agreement"][3]]
    assert len(set(band["top1_agreement"])) > 1  # the draws do differ: the lottery is real
    assert all(torch.equal(m.input_global_scale, before[n])
               for n, m in act_scale.activation_quantized(quantized).items())


def test_verdict_needs_significance_and_a_result_outside_the_rounding_band():
    from pipeline.stages.evaluate import verdict

    band = {"min": 0.90, "max": 0.92}
    assert verdict({"mcnemar_p": 0.01, "top1_a": 0.95}, band) == "better"
    assert verdict({"mcnemar_p": 0.01, "top1_a": 0.85}, band) == "worse"
    assert verdict({"mcnemar_p": 0.01, "top1_a": 0.91}, band) == "within noise"  # inside the lottery
    assert verdict({"mcnemar_p": 0.40, "top1_a": 0.95}, band) == "within noise"  # not significant
    assert verdict(None, band) == "not measured"
