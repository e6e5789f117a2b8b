"""The tiny world's DFlash2 drafter (issue 33): the shipped checkpoint, and the DFlash2 run `make all` adds
(experiment=tiny-dflash2) through the real stages on a few prompts: data, cache, quantize-drafter w4a16,
evaluate (the DFlash drafter beside it, every variant lossless in the reference loop), manifest, publish.

Sizes are read from the checkpoint's config and tensors, prompt counts from the eval files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from pipeline.core.config import compose
from pipeline.models import families
from pipeline.models.formats import load_drafter_config
from pipeline.serving import contract
from tests._support import REPO, one_thread  # noqa: F401 - autouse: one thread

ASSET = REPO / "assets" / "tiny" / "drafter-dflash2"
DFLASH = REPO / "assets" / "tiny" / "drafter"
LIMIT = 2  # prompts per eval subset


def _tensors(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}


def test_shipped_drafter_is_dflash2_with_its_modules_and_lossless_tau():
    cfg = load_drafter_config(ASSET)
    assert cfg.is_dflash2 and cfg.has_conv and cfg.has_selector
    shapes = _tensors(ASSET)
    h, taps, groups = cfg.hidden_size, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, taps, h)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (2 * taps * groups, h)
    for book in ("predecessor_codebook", "successor_codebook"):  # bare, no `.weight`
        assert shapes[f"candidate_selector.{book}"] == (cfg.vocab_size, cfg.selector_rank)
    assert shapes["candidate_selector.hidden_projection.weight"] == (cfg.selector_rank, h)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in shapes)
    # the DFlash drafter's geometry and aux layers: the same target, the same cache
    base = load_drafter_config(DFLASH)
    assert (cfg.aux_layer_ids, cfg.block_size, cfg.num_hidden_layers) == (base.aux_layer_ids, base.block_size,
                                                                          base.num_hidden_layers)
    # tau.json: every eval prompt, lossless, recorded beside the DFlash drafter's in the README
    tau = json.loads((ASSET / "tau.json").read_text())
    prompts = {p.stem: sum(1 for line in p.read_text().splitlines() if line.strip())
               for p in (REPO / "assets" / "tiny" / "eval").glob("*.jsonl")}
    assert {k: len(v["per_prompt_tau"]) for k, v in tau["sets"].items()} == prompts
    assert tau["lossless_mismatches"] == 0 and tau["mean_tau"] > 1
    dflash_tau = json.loads((DFLASH / "tau.json").read_text())["mean_tau"]
    readme = (ASSET / "README.md").read_text()
    assert f"**Mean tau = {tau['mean_tau']}** (DFlash drafter: {dflash_tau};" in readme


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny-dflash2 experiment's run, each stage through run_stage as the entry point runs it."""
    from pipeline.stages.runner import run_stage

    root = tmp_path_factory.mktemp("dflash2-run")
    ov = ["experiment=tiny-dflash2", f"runs_root={root}", "data.num_samples=12", "quant=w4a16", "quant.num_samples=8",
          f"eval.limit={LIMIT}", "eval.max_new_tokens=32"]
    results = {}
    for stage in ("data", "cache", "quantize-drafter", "evaluate", "manifest", "publish"):
        results[stage] = run_stage(stage, f"pipeline.stages.{stage.replace('-', '_')}", compose(ov), ov)
    return {"root": root / "tiny-dflash2", "cfg": compose(ov), "results": results}


def test_evaluate_runs_the_dflash2_variants_beside_the_dflash_drafter_lossless(run):
    res = json.loads((run["root"] / "eval" / "results.json").read_text())
    assert res["variant_order"][:3] == ["source", "bf16", "baseline"] and "w4a16" in res["variants"]
    assert Path(res["variants"]["baseline"]["path"]) == Path("assets/tiny/drafter")
    for v, d in res["variants"].items():
        assert sum(d["lossless_mismatches"].values()) == 0, v
        assert all(s["tau"] >= 1 for s in d["subsets"].values()), v
        assert sum(s["num_prompts"] for s in res["subsets"]) == LIMIT * len(res["subsets"])
    # the baseline is in the main table only: never a pair-matrix drafter nor a recommendation
    assert "baseline" not in res["pairs"]["matrix"]["bf16"]
    report = (run["root"] / "eval" / "report.md").read_text()
    assert "| `baseline` |" in report and "`eval.baseline_drafter`" in report


def test_dflash2_variants_manifest_and_publish_folder(run):
    prof = contract.profile(run["cfg"].quant.vllm)
    qrm = json.loads((run["root"] / "quant_run_manifest.json").read_text())
    entry = next(c for c in qrm["checkpoints"] if c["kind"] == "drafter" and c["variant"] == "w4a16")
    assert entry["vllm"]["dflash2_versions"] == families.get("dflash2").served_versions(prof)
    ckpt = load_drafter_config(run["root"] / "drafter" / "w4a16")
    layers = range(ckpt.num_hidden_layers)
    ignore = set(entry["ignore"])
    assert {f"layers.{i}.{c}.kernel_projection" for i in layers for c in ("attention_conv", "mlp_conv")} <= ignore
    folder = run["root"] / "publish" / "w4a16"
    conf = json.loads((folder / "config.json").read_text())
    assert conf["speculators_model_type"] == "dflash2"
    card = (folder / "README.md").read_text()
    assert "A DFlash2 drafter quantized to **w4a16**" in card
    assert f"vLLM {families.get('dflash2').served_versions(prof)}" in card and "`hidden_projection`" in card
    assert load_drafter_config(run["root"] / "drafter" / "bf16").is_dflash2  # the reference, not published

    from tests._support import run_main

    rc, out, err = run_main("verify", str(folder))
    assert rc == 0, err[-2000:]
