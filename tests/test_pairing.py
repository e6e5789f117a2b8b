"""The served pair on the fixture world: a cache per target variant, a drafter calibrated on the quantized
target's states, the pairing record, and the pairing warning and refusal (exact sentences).

Real stages throughout: quantize-target (llm-compressor W4A16), the cache stage on the compressed-tensors
target (loaded dequantized), quantize-drafter with imatrix observers on each cache, manifest. Sizes come
from the fixture (group size: the largest of 128/64/32/16 dividing every quantized width).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipeline.core.config import compose
from pipeline.core.errors import SpecquantError
from pipeline.core.io import read_json
from pipeline.quant import pairing
from tests._support import DRAFTER, TARGET, copy_world, run_main, target_w4a16_group, w4a16_group

_TLC = read_json(DRAFTER / "config.json", "drafter")["transformer_layer_config"]
_TC = read_json(TARGET / "config.json", "target")
G = w4a16_group()
GT = target_w4a16_group()  # o_proj's heads x head_dim included


def _base(root) -> list[str]:
    return [f"runs_root={root}", "run_name=qw", f"target.path={TARGET}", f"target.tokenizer={TARGET}",
            f"drafter.path={DRAFTER}", "drafter.format=speculators", "cache.storage_dtype=float32",
            "quant.num_samples=12", "quant.heldout_samples=12", "quant.anchors_per_sequence=8",
            "quant.max_seq_len=64", f"target_quant.group_size={GT}"]


def _stage(stage: str, module: str, overrides: list[str]):
    from pipeline.stages.runner import run_stage

    return run_stage(stage, module, compose(overrides), overrides)


@pytest.fixture(scope="module")
def world(fixture_world, tmp_path_factory):
    root = copy_world(fixture_world, tmp_path_factory.mktemp("pworld"))
    base = _base(root)
    _stage("quantize-target", "pipeline.stages.quantize_target", [*base, "target_quant=w4a16"])
    _stage("cache", "pipeline.stages.cache", [*base, "cache.target=w4a16"])
    drafter = [*base, "quant=w4a16-imatrix", f"quant.group_size={G}"]
    _stage("quantize-drafter", "pipeline.stages.quantize_drafter", drafter)
    _stage("quantize-drafter", "pipeline.stages.quantize_drafter", [*drafter, "quant.calibration_target=w4a16"])
    return root


def test_the_cache_of_the_quantized_target_is_its_own_and_names_that_checkpoint(world):
    from pipeline.stages.cache import CacheReader

    run = world / "qw"
    bf16, w4 = read_json(run / "cache" / "index.json", "i"), read_json(run / "cache-w4a16" / "index.json", "i")
    assert (bf16["target_variant"], w4["target_variant"]) == ("bf16", "w4a16")
    served = pairing.target_identity(run / "target" / "w4a16", "w4a16")
    assert w4["inputs"]["target"]["files_sha256"] == served["files_sha256"]
    assert bf16["inputs"]["target"]["files_sha256"] == pairing.target_identity(TARGET, "bf16")["files_sha256"]
    assert w4["target_shape"] == {k: int(_TC[k]) for k in pairing.SHAPE_KEYS}
    assert w4["content_hash"] != bf16["content_hash"]
    a, b = CacheReader(run / "cache")[0]["hidden_states"], CacheReader(run / "cache-w4a16")[0]["hidden_states"]
    rel = float((a - b).norm() / a.norm())
    assert 0 < rel < 0.5, rel  # the W4A16 target's states: close to the bf16 target's, not equal
    # each cache keeps its own stage record (the bf16 one, made without a record here, keeps the plain name)
    assert read_json(run / "stages" / "cache-w4a16.json", "r")["resolved_config"]["cache"]["target"] == "w4a16"
    assert not (run / "stages" / "cache.json").exists()


def test_a_drafter_calibrated_on_the_quantized_target_is_its_own_variant_and_records_that_target(world):
    from pipeline.core.io import hash_tree
    from pipeline.stages import manifest

    run = world / "qw"
    on_bf16, on_w4 = run / "drafter" / "w4a16-imatrix", run / "drafter" / "w4a16-imatrix-on-w4a16"
    assert hash_tree(on_bf16)["model.safetensors"]["sha256"] != hash_tree(on_w4)["model.safetensors"]["sha256"]
    rec = pairing.drafter_record(run_dir(world), "w4a16-imatrix-on-w4a16")
    w4_index = read_json(run / "cache-w4a16" / "index.json", "i")
    assert rec["variant"] == "w4a16" and rec["used"] is True
    assert rec["files_sha256"] == w4_index["inputs"]["target"]["files_sha256"]
    assert rec["cache_content_hash"] == w4_index["content_hash"]
    assert pairing.drafter_record(run_dir(world), "w4a16-imatrix")["variant"] == "bf16"
    manifest.run(compose(_base(world)))
    qrm = json.loads((run / "quant_run_manifest.json").read_text())
    entry = next(c for c in qrm["checkpoints"] if c["variant"] == "w4a16-imatrix-on-w4a16")
    assert entry["calibration_target"]["variant"] == "w4a16"
    assert entry["inputs"]["calibration_cache"]["content_sha256"] == w4_index["content_hash"]
    cal = json.loads((run / "calibration_manifest.json").read_text())
    assert cal["target_caches"]["w4a16"]["content_sha256"] == w4_index["content_hash"]
    assert cal["cache"]["target_variant"] == "bf16"


def run_dir(world):
    from pipeline.artifacts.rundir import RunDir

    return RunDir(world / "qw")


def test_pairing_with_another_target_of_the_same_shape_is_a_warning_sentence(world):
    rd = run_dir(world)
    bf16 = pairing.target_identity(TARGET, "bf16")
    w4 = pairing.target_identity(rd.target("w4a16"), "w4a16")
    rec = pairing.drafter_record(rd, "w4a16-imatrix-on-w4a16")
    assert pairing.check_pair("w4a16-imatrix-on-w4a16", rec, w4) is None  # the pair it was calibrated for
    assert pairing.check_pair("w4a16-imatrix", pairing.drafter_record(rd, "w4a16-imatrix"), bf16) is None
    assert pairing.check_pair("w4a16-imatrix-on-w4a16", rec, bf16) == (
        f"drafter `w4a16-imatrix-on-w4a16` was calibrated on the hidden states of target `w4a16` "
        f"(files {rec['files_sha256'][:12]}) but is paired here with target `bf16` "
        f"(files {bf16['files_sha256'][:12]}); the pair is measured as served, but "
        "quant.calibration_target=bf16 would calibrate a drafter for this target")
    bf16_rec = pairing.drafter_record(rd, "w4a16-imatrix")
    assert pairing.check_pair("w4a16-imatrix", bf16_rec, w4).startswith(
        "drafter `w4a16-imatrix` was calibrated on the hidden states of target `bf16`")
    assert pairing.base_variant("w4a16-imatrix-on-w4a16", rec) == "w4a16-imatrix"


def test_a_drafter_calibrated_on_the_quantized_target_is_published_for_that_target(world, tmp_path, capfd):
    """publish names the target a drafter was calibrated for: `-on-w4a16` names the run's W4A16 target (or its
    configured Hub id) in its config and card, with no pairing warning; the bf16-calibrated twin keeps the
    configured target; both folders verify."""
    from pipeline.provenance.verify import verify_dir
    from pipeline.stages import manifest, publish

    shutil.copytree(world / "qw", tmp_path / "qw")
    base = [*_base(tmp_path), "publish.target_model=Qwen/Qwen3-8B"]
    manifest.run(compose(base))
    capfd.readouterr()
    publish.run(compose([*base, "publish.variants=[w4a16-imatrix-on-w4a16,w4a16-imatrix]"]))
    assert "warning" not in capfd.readouterr().err
    folder = tmp_path / "qw" / "publish"
    on_w4 = str(tmp_path / "qw" / "target" / "w4a16")  # run_dir/target/w4a16, as run_dir is configured

    def verifier(v):
        return read_json(folder / v / "config.json", "c")["speculators_config"]["verifier"]["name_or_path"]

    card = (folder / "w4a16-imatrix-on-w4a16" / "README.md").read_text()
    assert verifier("w4a16-imatrix-on-w4a16") == on_w4 and verifier("w4a16-imatrix") == str(TARGET)  # as written
    assert f"Pairs with `{on_w4}`" in card and f"vllm serve {on_w4} " in card and "Qwen/Qwen3-8B" not in card
    assert "has no Hub id in this run" in card and "publish.quantized_target_models" in card  # why a path
    assert "Calibrated for the quantized target" not in card  # no caveat: the card names the right target
    assert "Pairs with `Qwen/Qwen3-8B`" in (folder / "w4a16-imatrix" / "README.md").read_text()
    for v in ("w4a16-imatrix-on-w4a16", "w4a16-imatrix"):
        assert verify_dir(folder / v) == [], v
    # the run's own checkpoint is unchanged (one verifier per run); only the published copy names the pair
    assert read_json(tmp_path / "qw" / "drafter" / "w4a16-imatrix-on-w4a16" / "config.json", "c")[
        "speculators_config"]["verifier"]["name_or_path"] == str(TARGET)

    # with the quantized target's Hub id configured, that id is the name
    publish.run(compose([*base, "publish.variants=[w4a16-imatrix-on-w4a16]",
                         "+publish.quantized_target_models.w4a16=org/Qwen3-8B-W4A16"]))
    card = (folder / "w4a16-imatrix-on-w4a16" / "README.md").read_text()
    assert verifier("w4a16-imatrix-on-w4a16") == "org/Qwen3-8B-W4A16"
    assert "Pairs with `org/Qwen3-8B-W4A16`" in card and "has no Hub id" not in card
    assert verify_dir(folder / "w4a16-imatrix-on-w4a16") == []


def _deeper_target(out):
    """A real checkpoint of the fixture target's architecture with one more decoder layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(TARGET)
    conf.num_hidden_layers += 1
    if getattr(conf, "layer_types", None):
        conf.layer_types = [*conf.layer_types, conf.layer_types[-1]]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(conf).save_pretrained(out)
    return out


def test_pairing_with_a_target_of_another_shape_is_refused_before_anything_loads(world, tmp_path):
    rd = run_dir(world)
    other = _deeper_target(tmp_path / "deeper")
    served = pairing.target_identity(other, "bf16")
    n = int(_TC["num_hidden_layers"])
    with pytest.raises(SpecquantError) as err:
        pairing.check_pair("w4a16-imatrix", pairing.drafter_record(rd, "w4a16-imatrix"), served)
    assert str(err.value) == (
        f"`drafter/w4a16-imatrix` = 'w4a16-imatrix': it was calibrated against target `bf16` with "
        f"num_hidden_layers={n}, but is paired with target `bf16` ({other}) with num_hidden_layers={n + 1}; "
        "pair it with the target it was made for, or re-run cache and quantize-drafter for this target.")
    # the serve check refuses it the same way, before it looks for vLLM or a GPU; nothing is written
    copy = tmp_path / "runs"
    shutil.copytree(world / "qw", copy / "qw")
    rc, _, err = run_main("serve-check", *[o for o in _base(copy) if not o.startswith("target.")],
                          f"target.path={other}", f"target.tokenizer={other}", "serve.python=python3",
                          "serve.targets=[bf16]", "serve.variants=[w4a16-imatrix]")
    assert rc == 2, err
    assert err.strip().splitlines()[-1].startswith(
        "error: `drafter/w4a16-imatrix` = 'w4a16-imatrix': it was calibrated against target `bf16` with "
        f"num_hidden_layers={n}, but is paired with target `bf16`")
    assert "Traceback" not in err
    assert not (copy / "qw" / "eval" / "serve_check.json").exists()
    # and publish refuses to ship it as that target's drafter, before anything is assembled
    rc, _, err = run_main("publish", *[o for o in _base(copy) if not o.startswith("target.")],
                          f"target.path={other}", f"target.tokenizer={other}", "publish.variants=[w4a16-imatrix]")
    assert rc == 2, err
    assert err.strip().splitlines()[-1] == (
        f"error: `drafter/w4a16-imatrix` = 'w4a16-imatrix': it was calibrated against target `bf16` with "
        f"num_hidden_layers={n}, but is paired with target `bf16` ({other}) with num_hidden_layers={n + 1}; "
        "pair it with the target it was made for, or re-run cache and quantize-drafter for this target.")
    assert not (copy / "qw" / "publish").exists()


def test_calibrating_on_a_target_without_its_cache_or_a_data_free_recipe_is_refused(world, tmp_path):
    from pipeline.stages import quantize_drafter

    shutil.copytree(world / "qw", tmp_path / "qw", ignore=shutil.ignore_patterns("cache-w4a16"))
    base = _base(tmp_path)
    with pytest.raises(SpecquantError, match=r"^`quant.calibration_target` = 'w4a16': no cache of that target's "
                                             r"hidden states in .*cache-w4a16; run `make cache "):
        quantize_drafter.calibration_cache(compose([*base, "quant=w4a16-imatrix", "quant.calibration_target=w4a16"]),
                                           run_dir(tmp_path))
    with pytest.raises(SpecquantError, match=r"^`quant.calibration_target` = 'nvfp4': this run has no quantized "
                                             r"target"):
        quantize_drafter.calibration_cache(compose([*base, "quant=w4a16-imatrix", "quant.calibration_target=nvfp4"]),
                                           run_dir(tmp_path))
    with pytest.raises(SpecquantError, match=r"^`quant.calibration_target` = 'w4a16': quant `w4a16` is data-free"):
        quantize_drafter.validate(compose([*base, "quant=w4a16", f"quant.group_size={G}",
                                           "quant.calibration_target=w4a16"]))
    with pytest.raises(SpecquantError, match=r"^`cache.target` = 'nvfp4': no quantized target"):
        from pipeline.stages import cache

        cache.run(compose([*base, "cache.target=nvfp4"]))


def test_a_pair_cache_of_other_target_files_or_a_misspelt_target_is_refused(world, tmp_path):
    """The cache of the quantized target must hold the states of that target as it is now: a target
    re-quantized with other settings after its cache was made is named, and a typo gets the near name."""
    from pipeline.stages import cache, quantize_drafter

    shutil.copytree(world / "qw", tmp_path / "qw")
    base = _base(tmp_path)
    cfg = compose([*base, "quant=w4a16-imatrix", "quant.calibration_target=w4a16"])
    assert quantize_drafter.calibration_cache(cfg, run_dir(tmp_path)) == tmp_path / "qw" / "cache-w4a16"
    shutil.rmtree(tmp_path / "qw" / "target" / "w4a16")
    _stage("quantize-target", "pipeline.stages.quantize_target", [*base, "target_quant=w4a16", "target_quant.observer=minmax"])
    with pytest.raises(SpecquantError, match=r"^`quant.calibration_target` = 'w4a16': .*cache-w4a16 holds the hidden "
                                             r"states of other target files \(\w{12}\) than .*target/w4a16 now has "
                                             r"\(\w{12}\); re-run `make cache ARGS=\"cache.target=w4a16 run_name=qw\"`"):
        quantize_drafter.calibration_cache(cfg, run_dir(tmp_path))
    with pytest.raises(SpecquantError, match=r"^`cache.target` = 'W4A16': no quantized target .*; did you mean w4a16 \(names are case-sensitive\)\.$"):
        cache.run(compose([*base, "cache.target=W4A16"]))


def test_serve_check_without_vllm_refuses_first_and_alone(world, tmp_path):
    """Issue 36: on a machine without vLLM the one-sentence refusal comes before any pairing warning, alone (the
    pairs here would each warn: drafters calibrated on one target served beside the other)."""
    import sys

    copy = tmp_path / "runs"
    shutil.copytree(world / "qw", copy / "qw")
    rc, _, err = run_main("serve-check", *_base(copy), f"serve.python={sys.executable}")
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: `serve.python`") and "cannot import vLLM" in err, err
    assert "warning" not in err
    assert not (copy / "qw" / "eval" / "serve_check.json").exists()


def test_serve_check_pairs_a_quantized_target_with_the_drafters_made_for_it(world):
    """serve.pairs=calibrated (the default): the configured target serves every drafter; a quantized target serves
    the drafters calibrated on it, their bf16-calibrated recipe and bf16 (every drafter when none was made for it);
    serve.pairs=all and a named serve.variants serve every drafter everywhere; a bad value is one sentence."""
    from pipeline.stages import serve_check

    rd = run_dir(world)
    drafters = {v: rd.drafter(v) for v in sorted(rd.drafter_variants(), key=lambda v: (v != "bf16", v))}
    assert {"w4a16-imatrix", "w4a16-imatrix-on-w4a16"} <= set(drafters)
    targets = {"bf16": TARGET, "w4a16": rd.target("w4a16"), "other": rd.target("w4a16")}
    got = serve_check.pairs_to_serve(compose(_base(world)), rd, targets, drafters)
    order = list(drafters)
    assert got["bf16"] == order and got["other"] == order
    assert got["w4a16"] == [v for v in order if v in {"bf16", "w4a16-imatrix", "w4a16-imatrix-on-w4a16"}]
    assert set(got["w4a16"]) >= {"w4a16-imatrix", "w4a16-imatrix-on-w4a16"}
    every = serve_check.pairs_to_serve(compose([*_base(world), "serve.pairs=all"]), rd, targets, drafters)
    assert every == {t: order for t in targets}
    named = serve_check.pairs_to_serve(compose([*_base(world), "serve.variants=[w4a16-imatrix]"]), rd, targets,
                                       {"w4a16-imatrix": drafters["w4a16-imatrix"]})
    assert named == {t: ["w4a16-imatrix"] for t in targets}
    with pytest.raises(SpecquantError, match=r"^`serve\.pairs` = .some.: .*use calibrated"):
        serve_check.pairs_to_serve(compose([*_base(world), "serve.pairs=some"]), rd, targets, drafters)


def test_evaluate_pairs_calibrated_evaluates_what_a_quantized_target_would_serve(world, tmp_path):
    """eval.pairs=calibrated (serve.pairs' rule): the main table's target evaluates every drafter, the quantized
    target the drafter calibrated on it, that recipe on bf16 states, bf16 and the eval.pairs_every_target globs;
    the report says n/a for the rest and the calibrated-vs-bf16 comparison still runs where both were evaluated;
    a bad eval.pairs is one sentence before any weight loads."""
    from pipeline.stages import evaluate
    from tests._support import build_fixture_tokenizer

    base = _base(world)
    _stage("quantize-drafter", "pipeline.stages.quantize_drafter", [*base, "quant=w4a16", f"quant.group_size={G}"])
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": "Say hello to the world."}) + "\n")
    tok = build_fixture_tokenizer(tmp_path / "tok")
    base = [*base, f"target.tokenizer={tok}", f"eval.prompt_sets=[{{name:chat,path:'{tmp_path / 'chat.jsonl'}'}}]"]
    quick = [*base, "eval.limit=1", "eval.max_new_tokens=8", "eval.targets=[bf16,w4a16]", "eval.pairs=calibrated"]
    rd = run_dir(world)
    res = read_json(evaluate.run(compose(quick))["output"] + "/results.json", "results")
    matrix = res["pairs"]["matrix"]
    assert set(matrix["bf16"]) == set(rd.drafter_variants()) >= {"w4a16", "w4a16-imatrix", "w4a16-imatrix-on-w4a16"}
    assert set(matrix["w4a16"]) == set(matrix["bf16"]) - {"w4a16"}
    comp = {(c["variant"], c["served_with"]) for c in res["pairs"]["comparison"]}
    assert comp == {("w4a16-imatrix-on-w4a16", "bf16"), ("w4a16-imatrix-on-w4a16", "w4a16")}
    report = (rd.eval / "report.md").read_text()
    assert "`n/a`: not evaluated" in report and "## The served pair: each target x the drafters paired with it" in report
    # eval.workers=3: the pairs in three processes, the main table's drafters split across two of them (each
    # loads its targets and makes their reference outputs itself); not one byte changes
    first = (rd.eval / "results.json").read_bytes()
    evaluate.run(compose([*quick, "eval.workers=3"]))
    assert (rd.eval / "results.json").read_bytes() == first and (rd.eval / "report.md").read_text() == report
    with pytest.raises(SpecquantError, match=r"^`eval\.workers` = 0: it must be at least 1"):
        evaluate.run(compose([*quick, "eval.workers=0"]))
    res = read_json(evaluate.run(compose([*quick, "eval.pairs_every_target=[w4a1?]"]))["output"] + "/results.json", "r")
    assert set(res["pairs"]["matrix"]["w4a16"]) == set(res["pairs"]["matrix"]["bf16"])
    every = (rd.eval / "report.md").read_text()
    assert "`n/a`: not evaluated" not in every and "## The served pair: every target x every drafter" in every
    with pytest.raises(SpecquantError, match=r"^`eval\.pairs` = .some.: .*use all"):
        evaluate.run(compose([*base, "eval.pairs=some"]))
