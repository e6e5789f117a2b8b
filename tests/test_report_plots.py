"""The evaluation report's "which variant to ship" rule and its plots, on a results.json shaped as evaluate writes
it (numbers of the tiny world's `make all`): the rule picks per GPU generation and target from the measurements,
and each plot is deterministic and shows the few-percent differences it is about."""

from __future__ import annotations

import copy

import pytest

from pipeline.evaluation import plots, report

SUBSETS = ("chat", "math", "code")
# tau (chat, math, code, all) with the bf16 target, then all-prompt tau with the w4a16 target
TAUS = {"bf16": (4.545, 3.623, 3.761, 3.870, 3.779), "nvfp4": (4.456, 3.600, 3.564, 3.765, 3.779),
        "nvfp4-nocalib": (4.500, 3.562, 3.584, 3.765, 3.779), "nvfp4a16": (4.500, 3.608, 3.662, 3.816, 3.779),
        "nvfp4a16-gptq": (4.52, 3.63, 3.80, 3.895, 3.801), "w4a16": (4.582, 3.639, 3.795, 3.897, 3.766),
        "w4a16-gptq": (4.55, 3.62, 3.76, 3.853, 3.755), "w4a16-imatrix": (4.55, 3.61, 3.75, 3.850, 3.76),
        "w4a16-gptq-on-w4a16": (4.54, 3.60, 3.75, 3.842, 3.774)}
SCHEMES = {"bf16": None, "nvfp4": "nvfp4", "nvfp4-nocalib": "nvfp4", "nvfp4a16": "nvfp4a16",
           "nvfp4a16-gptq": "nvfp4a16", "w4a16": "w4a16", "w4a16-gptq": "w4a16", "w4a16-imatrix": "w4a16",
           "w4a16-gptq-on-w4a16": "w4a16"}


def _stats(tau: float, shift: float) -> dict:
    pos = [round(max(0.0, min(1.0, 0.93 - 0.11 * k + shift * (1 + k / 3))), 4) for k in range(7)]
    return {"tau": tau, "position_acceptance": pos, "steps": 100, "drafted_tokens": 700, "accepted_tokens": 300,
            "acceptance_rate": 0.43}


def results() -> dict:
    variants, bf16_row, w4_row = {}, {}, {}
    for v, t in TAUS.items():
        quantized = v != "bf16"
        variants[v] = {"scheme": SCHEMES[v], "calibration": "none" if v in ("nvfp4-nocalib", "nvfp4a16", "w4a16")
                       else "cache", "path": f"runs/tiny/drafter/{v}",
                       "quantization": {"quantized": quantized, "activations_quantized": v.startswith("nvfp4") and
                                        "a16" not in v, "ignore": []},
                       "subsets": {s: _stats(t[j], (t[j] - TAUS["bf16"][j]) / 40 + 0.002 * (j - 1)) for j, s in enumerate(SUBSETS)},
                       "overall": _stats(t[3], 0.0), "lossless_mismatches": {s: 0 for s in SUBSETS}}
        bf16_row[v] = {**copy.deepcopy({k: variants[v][k] for k in ("subsets", "overall", "lossless_mismatches")}),
                       "calibration_target": None}
        w4_row[v] = {**copy.deepcopy(bf16_row[v]), "overall": _stats(t[4], 0.0)}
    comparison = [{"calibrated": c, "calibration_free": f, "layer_output_error_heldout": {c: {"mean": ec}, f: {"mean": ef}},
                   "top1_heldout": {"top1_a": ta, "top1_b": tb}, "tau": {"calibrated": TAUS[c][3],
                                                                          "calibration_free": TAUS[f][3]}}
                  for c, f, ec, ef, ta, tb in (("nvfp4a16-gptq", "nvfp4a16", 0.0130, 0.0352, 0.9931, 0.9965),
                                               ("w4a16-gptq", "w4a16", 0.0145, 0.0435, 0.9954, 0.9954),
                                               ("w4a16-imatrix", "w4a16", 0.0382, 0.0435, 0.9885, 0.9954))]
    return {"block_size": 8, "max_new_tokens": 120, "reference_variant": "bf16", "variant_order": list(TAUS),
            "variants": variants, "drafter": {"name": "tiny-dflash", "path": "assets/tiny/drafter"},
            "target": {"name": "tiny", "variant": "bf16", "path": "assets/tiny/target"},
            "subsets": [{"name": s, "num_prompts": 20} for s in SUBSETS], "calibration_comparison": comparison,
            "pairs": {"matrix": {"bf16": bf16_row, "w4a16": w4_row}}}


def test_the_ship_rule_picks_per_gpu_and_target_from_the_numbers():
    got = {(r["gpu"].split(" ")[0], r["target"]): r for r in report.recommend(results())}
    # Hopper/Ada and Ampere: weight-only 4-bit candidates only (vLLM serves NVFP4 weight-only there)
    assert (got[("Hopper", "bf16")]["ship"], got[("Hopper", "bf16")]["ties"]) == ("w4a16", ["nvfp4a16-gptq"])
    assert got[("Hopper", "w4a16")]["ship"] == "nvfp4a16-gptq"
    assert got[("Blackwell", "w4a16")]["ship"] == "nvfp4a16-gptq"
    # a variant that is not lossless, or keeps < 95% of bf16's tau, is never shipped
    r = results()
    r["pairs"]["matrix"]["bf16"]["w4a16"]["lossless_mismatches"]["code"] = 1
    r["pairs"]["matrix"]["bf16"]["nvfp4a16-gptq"]["overall"]["tau"] = 3.6
    hopper = next(x for x in report.recommend(r) if x["gpu"].startswith("Hopper") and x["target"] == "bf16")
    assert hopper["ship"] == "w4a16-gptq" and "w4a16" not in hopper["ties"] and "nvfp4a16-gptq" not in hopper["ties"]
    for v in list(r["pairs"]["matrix"]["w4a16"]):
        r["pairs"]["matrix"]["w4a16"][v]["overall"]["tau"] = 1.0 if v != "bf16" else 3.8
    none = [x for x in report.recommend(r) if x["target"] == "w4a16"]
    assert all(x["ship"] is None for x in none)
    assert "none qualifies: keep the `bf16` drafter" in "\n".join(report.recommendation_section(r))


def test_the_report_says_which_variant_to_ship_with_its_rule():
    text = "\n".join(report.recommendation_section(results()))
    assert text.startswith("## Which variant to ship") and report.ship_rule() in text
    assert "| Hopper / Ada (sm 89-90, FP8 tensor cores) | bf16 | **`w4a16`** | 3.897 | +0.7% |" in text
    assert "| Ampere (sm 80-86) | bf16 | **`w4a16`** | 3.897 | +0.7% |" in text


@pytest.mark.parametrize("fn,name", [(plots.tau_bars, "tau_per_subset.png"),
                                     (plots.acceptance_curves, "acceptance_per_position.png"),
                                     (plots.calibration_pairs, "calibration_vs_datafree.png")])
def test_plots_are_deterministic(tmp_path, fn, name):
    a, b = fn(results(), tmp_path / f"a-{name}"), fn(results(), tmp_path / f"b-{name}")
    assert a.read_bytes() == b.read_bytes() and a.read_bytes().startswith(b"\x89PNG")


def test_tau_plot_zooms_on_the_differences(monkeypatch, tmp_path):
    """The τ plot's axis spans the variants' changes vs bf16 (a few percent), not 0 to the block size."""
    seen = {}
    real = plots.save_png

    def grab(fig, path, **kw):
        seen["xlim"] = fig.axes[0].get_xlim()
        return real(fig, path, **kw)

    monkeypatch.setattr(plots, "save_png", grab)
    plots.tau_bars(results(), tmp_path / "t.png")
    lo, hi = seen["xlim"]
    assert -8 < lo < -5.2 and 1 < hi < 4  # code -5.2% .. +1.1%, in percent


def test_hopper_and_ada_ship_an_fp8_drafter_within_the_tie_band_and_ampere_never_does():
    r = results()
    for row in r["pairs"]["matrix"].values():  # an FP8 drafter 0.5% under the best bf16-target candidate
        row["fp8-dynamic"] = copy.deepcopy(row["w4a16"])
        row["fp8-dynamic"]["overall"]["tau"] = round(row["w4a16"]["overall"]["tau"] * 0.995, 3)
    r["variants"]["fp8-dynamic"] = {**copy.deepcopy(r["variants"]["w4a16"]), "scheme": "fp8-dynamic"}
    got = {(x["gpu"].split(" ")[0], x["target"]): x for x in report.recommend(r)}
    assert got[("Hopper", "bf16")]["ship"] == "fp8-dynamic" and "w4a16" in got[("Hopper", "bf16")]["ties"]
    assert got[("Ampere", "bf16")]["ship"] == "w4a16" and "fp8-dynamic" not in got[("Ampere", "bf16")]["ties"]
    assert got[("Blackwell", "bf16")]["ship"] == "w4a16" and "fp8-dynamic" in got[("Blackwell", "bf16")]["ties"]
    # outside the band (2% under) the FP8 drafter is not shipped on Hopper either
    r["pairs"]["matrix"]["bf16"]["fp8-dynamic"]["overall"]["tau"] = round(3.897 * 0.98, 3)
    hopper = next(x for x in report.recommend(r) if x["gpu"].startswith("Hopper") and x["target"] == "bf16")
    assert hopper["ship"] == "w4a16" and "fp8-dynamic" not in hopper["ties"]
