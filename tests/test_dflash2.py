"""DFlash2 (our DFlash drafter + convolution + candidate selector) against the reference fixtures.

The fixture folder (`SPECQUANT_DFLASH2_FIXTURES`, default tests/fixtures/dflash2; its README says how each
tensor was made by z-lab's DFlash2 code at 07ebd93 and speculators 0.9.0) is the only source of sizes:
layers, hidden, vocabulary, aux layers, block size, group size, taps, rank and top-K all come from its
geometry.json and checkpoints, so the same tests run on a folder of another geometry made by
tests/gen_dflash2_fixtures.py.

Tolerance: float tensors <= 1e-5 max abs diff, relative to the reference's largest magnitude where that
exceeds 1 (fp32; `maxdiff`);
the selector's chosen path and candidate sets exactly; candidates compared as sets (the reference's top-K
is unsorted), their scores matched by token id.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline.commands.convert import convert
from pipeline.core.errors import SpecquantError
from pipeline.models.compat import check_compatible
from pipeline.models.dflash import DFlashConfig
from pipeline.models.formats import CODEBOOK_KEYS, load_drafter, load_drafter_config, read_tensors
from pipeline.models.layout import DFLASH2_FIELDS, light_config
from tests._support import REPO, run_main

FIX = (REPO / "tests" / "fixtures" / "dflash2") if not os.environ.get("SPECQUANT_DFLASH2_FIXTURES") \
    else __import__("pathlib").Path(os.environ["SPECQUANT_DFLASH2_FIXTURES"]).resolve()
G = json.loads((FIX / "geometry.json").read_text())
BS, V, H = G["block_size"], G["vocab"], G["hidden"]
ZLAB, SPEC = FIX / "zlab" / "checkpoint", FIX / "speculators" / "checkpoint"
TOL = 1e-5


def maxdiff(a, b) -> float:
    """Max abs diff, relative to the reference's largest magnitude where that exceeds 1 (pre-norm layer
    outputs reach ~10 here: fp32 rounding grows with them)."""
    b = b.float().reshape(a.shape)
    return (a.float() - b).abs().max().item() / max(1.0, b.abs().max().item())


def by_id(candidates: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    order = candidates.argsort(dim=-1)
    return [candidates.gather(-1, order)] + [v.gather(-1, order) for v in values]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The target as a drafter sees it: its embedding and head (the fixture stores no other target weight)."""
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    d = tmp_path_factory.mktemp("target")
    save_file({"model.embed_tokens.weight": inp["embed_tokens_weight"], "lm_head.weight": inp["lm_head_weight"]},
              d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": V,
                                               "hidden_size": H, "num_hidden_layers": G["target_layers"],
                                               "tie_word_embeddings": False}))
    return d


@pytest.fixture(scope="module")
def drafter(target_dir):
    torch.set_num_threads(1)
    return load_drafter(ZLAB, target=target_dir)


def test_fixture_sizes_are_the_checkpoints():
    cfg = load_drafter_config(ZLAB)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size) == \
        (V, H, G["drafter_layers"], BS)
    assert [cfg.conv_group_size, cfg.conv_kernel_size, cfg.selector_rank, cfg.selector_top_k] == \
        [G["conv_group_size"], G["conv_kernel_size"], G["selector_rank"], G["selector_top_k"]]
    assert cfg.aux_layer_ids == [i + 1 for i in G["zlab_target_layer_ids"]]


def test_reference_save_has_weight_suffixed_codebooks_and_ours_reads_them_bare(drafter):
    with safe_open(str(ZLAB / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        assert {f"{k}.weight" for k in CODEBOOK_KEYS} <= keys  # z-lab's nn.Embedding codebooks
        for k in CODEBOOK_KEYS:
            assert torch.equal(getattr(drafter.candidate_selector, k.split(".")[1]), fh.get_tensor(f"{k}.weight"))
    state = drafter.state_dict()
    assert set(CODEBOOK_KEYS) <= state.keys() and not any(f"{k}.weight" in state for k in CODEBOOK_KEYS)
    sel = drafter.candidate_selector
    assert sel.predecessor_codebook.shape == (V, G["selector_rank"]) and sel.top_k == G["selector_top_k"]
    conv = drafter.layers[0].attention_conv
    assert conv.base_kernel.shape == (2, G["conv_kernel_size"], H)
    assert conv.kernel_projection.weight.shape == (2 * G["conv_kernel_size"] * H // G["conv_group_size"], H)


def test_convolution_matches_zlab(drafter):
    """Every conv of every layer in both z-lab steps: the prepared input and the finished output."""
    exp = load_file(FIX / "zlab" / "expected.safetensors")
    worst, n = 0.0, 0
    for step in (1, 2):
        for i, layer in enumerate(drafter.layers):
            for side in ("attention_conv", "mlp_conv"):
                name = f"step{step}_layer{i}_{side}"
                conv = getattr(layer, side)
                with torch.no_grad():
                    prepared, dynamic = conv.prepare(exp[f"{name}_in"])
                    finished = conv.finish(exp[f"{name}_sublayer_out"], dynamic)
                worst = max(worst, maxdiff(prepared, exp[f"{name}_prepared"]),
                            maxdiff(finished, exp[f"{name}_finished"]))
                n += 1
    assert n == 4 * G["drafter_layers"] and worst <= TOL, worst


def test_convolution_matches_speculators_inside_each_block(drafter):
    """speculators' convolution over many anchored blocks in a row: no block sees another's rows."""
    exp = load_file(FIX / "speculators" / "expected.safetensors")
    conv = drafter.layers[0].attention_conv
    with torch.no_grad():
        prepared, dynamic = conv.prepare(exp["conv_in"], BS)
        finished = conv.finish(exp["conv_prepared"], dynamic, BS)
    assert maxdiff(prepared, exp["conv_prepared"]) <= TOL
    assert maxdiff(dynamic, exp["conv_output_coefficients"]) <= TOL
    assert maxdiff(finished, exp["conv_finished"]) <= TOL


@pytest.fixture(scope="module")
def steps(drafter):
    """Both z-lab inference steps (the second on the first's cropped cache), with every layer's output."""
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    cache = drafter.new_cache()
    out = {}
    for n in (1, 2):
        caps = {}
        hooks = [layer.register_forward_hook(lambda _m, _i, o, _k=k, _c=caps: _c.__setitem__(_k, o.detach().clone()))
                 for k, layer in enumerate(drafter.layers)]
        with torch.no_grad():
            args = (inp[f"target_hidden_step{n}"], inp[f"block_input_ids_step{n}"], inp[f"position_ids_step{n}"])
            before = len(cache)
            hidden = drafter.draft_hidden(*args, cache=cache)
            after_hidden = len(cache)
            cache.crop(before)  # the same step again for the selector (draft_path crops the same way)
            path = drafter.draft_path(*args, cache=cache)
        for h in hooks:
            h.remove()
        assert len(cache) == after_hidden
        out[n] = {"hidden": hidden, "path": path, "layers": caps,
                  "cache": [(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values, strict=True)]}
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_draft_logits_match_zlab(drafter, steps, n):
    exp = load_file(FIX / "zlab" / "expected.safetensors")
    got = steps[n]
    assert maxdiff(got["hidden"], exp[f"step{n}_hidden"]) <= TOL
    for k in range(G["drafter_layers"]):
        assert maxdiff(got["layers"][k], exp[f"step{n}_layer{k}_out"]) <= TOL
    with torch.no_grad():
        logits = drafter.lm_head(got["hidden"][:, 1:])
    assert maxdiff(logits, exp[f"step{n}_draft_logits"]) <= TOL
    for k, (kk, vv) in enumerate(got["cache"]):
        assert maxdiff(kk, exp[f"step{n}_cropped_cache_k_layer{k}"]) <= TOL
        assert maxdiff(vv, exp[f"step{n}_cropped_cache_v_layer{k}"]) <= TOL


@pytest.mark.parametrize("n", [1, 2])
def test_selector_path_matches_zlab(steps, n):
    """The chosen path exactly; per slot the same candidate set, with the same unary and selector scores."""
    exp = load_file(FIX / "zlab" / "expected.safetensors")
    path = steps[n]["path"]
    assert torch.equal(path.tokens, exp[f"step{n}_path"])
    cands, unary, scores = by_id(path.candidates, path.unary, path.scores)
    assert cands.shape[-1] == G["selector_top_k"]
    assert torch.equal(cands, exp[f"step{n}_selector_candidates"])
    assert maxdiff(unary, exp[f"step{n}_selector_unary"]) <= TOL
    assert maxdiff(scores, exp[f"step{n}_selector_scores"]) <= TOL
    assert maxdiff(path.scores.max(-1).values, exp[f"step{n}_path_scores"]) <= TOL


def test_the_fixture_exercises_the_selector():
    """At least one slot where the path is not the head's argmax: the selector is what the path test checks."""
    exp = load_file(FIX / "zlab" / "expected.safetensors")
    assert any(not torch.equal(exp[f"step{n}_path"], exp[f"step{n}_argmax_tokens"]) for n in (1, 2))


def test_calibration_forward_and_selector_scores_match_speculators(drafter):
    """speculators' training forward (anchored blocks, fixed anchors): our calibration path, conv included."""
    inp = load_file(FIX / "speculators" / "inputs.safetensors")
    exp = load_file(FIX / "speculators" / "expected.safetensors")
    with torch.no_grad():
        out = drafter(input_ids=inp["input_ids"], hidden_states=inp["hidden_states"],
                      position_ids=inp["position_ids"], document_ids=inp["document_ids"],
                      anchor_positions=inp["anchor_positions"], anchor_valid=inp["anchor_valid"])
        assert maxdiff(out.hidden_states, exp["hidden"]) <= TOL
        assert maxdiff(out.logits, exp["logits"]) <= TOL
        sel = drafter.candidate_selector
        cands = exp["selector_candidates"]
        pair = sel.pairwise(sel.hidden_projection(out.hidden_states), exp["selector_predecessor_ids"], cands)
        scores = out.logits.gather(-1, cands) + pair
    assert maxdiff(scores, exp["selector_scores"]) <= TOL


def test_both_reference_formats_load_the_same_model(target_dir, drafter):
    other = load_drafter(SPEC, target=target_dir)
    a, b = drafter.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_convert_round_trips_both_formats(tmp_path):
    src = read_tensors(ZLAB)
    to_spec = convert(ZLAB, tmp_path / "spec", "speculators", verifier="../target",
                      verifier_architectures=["Qwen3ForCausalLM"])
    back = convert(to_spec, tmp_path / "zlab", "zlab")
    again = convert(back, tmp_path / "spec2", "speculators", verifier="../target",  # z-lab keeps no verifier
                    verifier_architectures=["Qwen3ForCausalLM"])
    for out in (to_spec, back, again):
        with safe_open(str(out / "model.safetensors"), "pt") as fh:
            keys = set(fh.keys())
        assert set(CODEBOOK_KEYS) <= keys and not any(k.endswith("_codebook.weight") for k in keys)  # bare
        got = read_tensors(out)
        assert got.keys() == src.keys() and all(torch.equal(got[k], src[k]) for k in src)
    assert _config(to_spec) == _config(again)
    ours_z, ref_z = _config(back), _config(ZLAB)
    for key in ("architectures", "is_causal", "dflash_config", "num_target_layers", "vocab_size", "hidden_size",
                "num_hidden_layers", "layer_types", "rope_parameters"):
        assert ours_z[key] == ref_z[key], key
    ours_s, ref_s = _config(to_spec), _config(SPEC)
    for key in ("architectures", "speculators_model_type", "aux_hidden_state_layer_ids", "block_size",
                "mask_token_id", "draft_vocab_size", "sliding_window_non_causal", "sample_from_anchor",
                *DFLASH2_FIELDS):
        assert ours_s[key] == ref_s[key], key
    assert ours_s["speculators_config"]["algorithm"] == ref_s["speculators_config"]["algorithm"] == "dflash2"
    assert ours_s["speculators_config"]["proposal_methods"] == ref_s["speculators_config"]["proposal_methods"]
    assert load_drafter_config(to_spec).to_dict() == {**load_drafter_config(back).to_dict(),
                                                     "verifier_name_or_path": "../target",
                                                     "verifier_architectures": ["Qwen3ForCausalLM"],
                                                     "_name_or_path": str(to_spec)}


def test_convert_cli_from_the_speculators_reference(tmp_path):
    code, out, err = run_main("convert", "--to", "zlab", str(SPEC), str(tmp_path / "z"))
    assert code == 0, err
    assert _config(tmp_path / "z")["dflash_config"] == _config(ZLAB)["dflash_config"]


def test_a_dflash_config_has_no_dflash2_fields_or_modules():
    from pipeline.models.dflash import DFlashDrafter

    cfg = DFlashConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                       num_attention_heads=G["heads"], num_key_value_heads=G["kv_heads"], head_dim=G["head_dim"],
                       block_size=BS, mask_token_id=V - 1, aux_layer_ids=[1])
    assert not set(DFLASH2_FIELDS) & cfg.to_dict().keys() and not cfg.is_dflash2
    with torch.device("meta"):
        keys = DFlashDrafter(cfg).state_dict().keys()
    assert not any("conv" in k or "selector" in k for k in keys)


def test_fresh_dflash2_starts_as_identity_convolutions():
    from pipeline.models.dflash import DFlashDrafter

    cfg = load_drafter_config(ZLAB)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg)
    conv = m.layers[0].mlp_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, H)) and not conv.base_kernel[:, 1:].any()
    assert not conv.kernel_projection.weight.any()
    assert m.candidate_selector.predecessor_codebook.std() > 0


# ----------------------------------------------------------------- compatibility: one sentence each
TARGET = {"vocab_size": V, "hidden_size": H, "num_hidden_layers": G["target_layers"]}


def fails(field: str, target=TARGET, **over) -> str:
    d = light_config(ZLAB)
    for k, v in over.items():
        setattr(d, k, v)
    with pytest.raises(SpecquantError) as exc:
        check_compatible(d, target)
    msg = str(exc.value)
    assert msg.startswith(f"`{field}` = ") and "\n" not in msg and msg.endswith(".") and msg.count("; ") == 1, msg
    return msg


def test_the_fixture_pair_is_compatible():
    check_compatible(light_config(ZLAB), TARGET)
    check_compatible(light_config(SPEC), TARGET)


@pytest.mark.faults("bad_input")
def test_vocab_and_hidden_size_against_the_target():
    fails("drafter.vocab_size", target={**TARGET, "vocab_size": V + 16})
    fails("drafter.target_hidden_size", target={**TARGET, "hidden_size": H * 2})


@pytest.mark.faults("bad_input")
def test_group_size_must_divide_the_hidden_size():
    bad = next(g for g in range(G["conv_group_size"] + 1, 4 * H) if H % g)
    msg = fails("drafter.conv_group_size", conv_group_size=bad)
    assert str(H) in msg


@pytest.mark.faults("bad_input")
def test_selector_top_k_within_the_vocabulary():
    assert str(V) in fails("drafter.selector_top_k", selector_top_k=V + 1)
    fails("drafter.selector_top_k", selector_top_k=0)


@pytest.mark.faults("bad_input")
def test_taps_within_the_block_and_block_size():
    assert str(BS) in fails("drafter.conv_kernel_size", conv_kernel_size=BS + 1)
    fails("block_size", block_size=1)
    fails("drafter.selector_rank", selector_rank=0)


@pytest.mark.faults("bad_input")
def test_a_half_dflash2_config_is_refused(tmp_path):
    d = _config(ZLAB)
    d["dflash_config"].pop("selector_top_k")
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(SpecquantError) as exc:
        load_drafter_config(tmp_path)
    assert "selector_top_k" in str(exc.value) and "\n" not in str(exc.value)
