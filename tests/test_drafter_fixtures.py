"""Parity of our DFlash drafter with the golden fixtures (tests/fixtures/dflash/README.md).

Tolerances from the README: float tensors <= 1e-5 max abs diff, losses <= 1e-5, argmax tokens,
masks, indices and metric counts exact. Every size (layers, block size, vocabulary, aux layers, context
lengths) is read from the fixture folder (`SPECQUANT_FIXTURES`, tests/_support.py), never assumed.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.models import calibration as C
from pipeline.models.formats import load_drafter
from pipeline.models.spec_decode import greedy_generate, spec_generate
from tests._support import DFLASH as FIX
from tests._support import geometry

TOL = 1e-5
G = geometry()
BS, MASK = G["block_size"], G["mask_token_id"]


def maxdiff(a, b) -> float:
    return (a.float() - b.float().reshape(a.shape)).abs().max().item()


@pytest.fixture(scope="module")
def target():
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def zlab_drafter():
    return load_drafter(FIX / "zlab" / "checkpoint", target=FIX / "target")


@pytest.fixture(scope="module")
def fixture_a(zlab_drafter):
    """Run both z-lab steps with hooks capturing every intermediate the fixture records."""
    m = zlab_drafter
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    caps: dict[str, torch.Tensor] = {}

    def grab(name):
        return lambda _m, _i, out: caps.__setitem__(name, out.detach().clone())

    named = {"fc_out": m.fc, "context_fused": m.hidden_norm, "hidden": m.norm, "noise_embedding": m.embed_tokens,
             **{f"layer{i}_out": layer for i, layer in enumerate(m.layers)}}
    hooks = [mod.register_forward_hook(grab(n)) for n, mod in named.items()]
    cache = m.new_cache()
    got = {}
    try:
        with torch.no_grad():
            for s in (1, 2):
                logits = m.draft_block(inp[f"target_hidden_step{s}"], inp[f"block_input_ids_step{s}"],
                                       inp[f"position_ids_step{s}"], cache)
                got.update({f"step{s}_{k}": v for k, v in caps.items()})
                got[f"step{s}_logits"] = logits
                got[f"step{s}_draft_logits"] = logits[:, 1:]
                got[f"step{s}_draft_tokens"] = logits[:, 1:].argmax(-1)
                for layer in range(len(m.layers)):
                    got[f"step{s}_cropped_cache_k_layer{layer}"] = cache.keys[layer].clone()
                    got[f"step{s}_cropped_cache_v_layer{layer}"] = cache.values[layer].clone()
                caps.clear()
    finally:
        for h in hooks:
            h.remove()
    return got, load_file(FIX / "zlab" / "expected.safetensors")


def test_fixture_a_every_expected_tensor(fixture_a):
    got, exp = fixture_a
    assert set(exp) <= set(got), sorted(set(exp) - set(got))
    assert {f"step1_layer{i}_out" for i in range(G["layers"])} <= set(exp)  # one per draft layer, none skipped
    for name, want in exp.items():
        if want.is_floating_point():
            assert maxdiff(got[name], want) <= TOL, (name, maxdiff(got[name], want))
        else:
            assert torch.equal(got[name].reshape(want.shape), want), name
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    assert exp["step1_draft_tokens"].shape == (1, BS - 1)  # the block's drafted slots; slot 0 is the bonus token
    ctx1, ctx2 = inp["target_hidden_step1"].shape[1], inp["target_hidden_step2"].shape[1]
    assert exp["step1_cropped_cache_k_layer0"].shape[2] == ctx1  # the crop kept the context rows only ...
    assert exp["step2_cropped_cache_k_layer0"].shape[2] == ctx1 + ctx2  # ... of both steps


def test_fixture_a_cached_step2_equals_no_cache_forward(zlab_drafter):
    """Step 2 through the draft cache equals one forward over the context rows of both steps (README)."""
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    exp = load_file(FIX / "zlab" / "expected.safetensors")
    ctx = torch.cat([inp["target_hidden_step1"], inp["target_hidden_step2"]], dim=1)
    pos = torch.arange(int(inp["position_ids_step2"][0, -1]) + 1)[None]  # context rows 0.. then the block
    with torch.no_grad():
        logits = zlab_drafter.draft_block(ctx, inp["block_input_ids_step2"], pos, None)
    assert maxdiff(logits, exp["step2_logits"]) <= TOL


def test_fixture_a_context_rows_follow_hf_hidden_state_indexing():
    """target_hidden_step1 = concat(HF hidden_states[l + 1] for z-lab target_layer_ids l) (README)."""
    inp = load_file(FIX / "zlab" / "inputs.safetensors")
    hs = inp["target_all_hidden_states"]
    n = inp["target_hidden_step1"].shape[1]
    assert [m - 1 for m in G["aux_layer_ids"]] == G["zlab_layer_ids"]
    want = torch.cat([hs[lid + 1, :n] for lid in G["zlab_layer_ids"]], -1)
    assert torch.equal(inp["target_hidden_step1"][0], want)


def test_e2e_trace_matches_reference_loop(target, zlab_drafter):
    trace = json.loads((FIX / "zlab" / "e2e_trace.json").read_text())
    res = spec_generate(target, zlab_drafter, trace["prompt_input_ids"], trace["max_new_tokens"], trace=True)
    assert res.output_ids == trace["output_ids"]
    assert res.acceptance_lengths == trace["acceptance_lengths"]
    assert res.draft_calls == trace["draft_calls"]
    assert greedy_generate(target, trace["prompt_input_ids"], trace["max_new_tokens"]) == trace["output_ids"]


@pytest.fixture(scope="module")
def fixture_b():
    m = load_drafter(FIX / "speculators" / "checkpoint", target=FIX / "target")
    inp = load_file(FIX / "speculators" / "inputs.safetensors")
    batch = {k: inp[k] for k in ("input_ids", "hidden_states", "position_ids", "document_ids", "loss_mask")}
    batch["anchor_positions"] = inp["anchor_positions"][None]
    batch["anchor_valid"] = inp["anchor_valid"][None]
    with torch.no_grad():
        out = m(**batch)
    return m, inp, out, load_file(FIX / "speculators" / "expected.safetensors")


def test_fixture_b_logits_hidden_mask_indices(fixture_b):
    _, inp, out, exp = fixture_b
    assert maxdiff(out.logits, exp["logits"]) <= TOL
    assert maxdiff(out.hidden_states, exp["hidden"]) <= TOL
    anchors = inp["anchor_positions"]
    assert torch.equal(C.block_attention_mask(inp["document_ids"][0], anchors, BS), exp["attention_mask_bool"])
    assert torch.equal(C.anchored_indices(anchors, BS), exp["anchored_block_indices"])
    alm = C.aligned_loss_mask(inp["loss_mask"], anchors, inp["anchor_valid"], BS)
    assert torch.equal(alm.reshape(exp["aligned_loss_mask"].shape).long(), exp["aligned_loss_mask"].long())


def test_fixture_b_targets_losses_metrics(fixture_b):
    _, inp, out, exp = fixture_b
    a = inp["anchor_positions"]
    targets = C.verifier_targets(inp["verifier_last_hidden_states"], inp["verifier_norm_weight"],
                                 inp["lm_head_weight"], a, BS)
    assert maxdiff(targets, exp["targets"]) <= TOL
    mask = C.aligned_loss_mask(inp["loss_mask"], a, inp["anchor_valid"], BS)
    want = json.loads((FIX / "speculators" / "expected_metrics.json").read_text())
    # gamma 4.0 and dpace alpha 0.5: the loss settings the README says the reference ran with
    kl = C.kl_fixed_exp_loss(out.logits, targets, mask, BS, gamma=4.0).item()
    ce = C.ce_dpace_loss(out.logits, targets, mask, BS, alpha=0.5).item()
    assert abs(kl - want["kl_fixedexp"]["loss"]) <= TOL
    assert abs(ce - want["ce_dpace"]["loss"]) <= TOL
    metrics = C.block_metrics(out.logits, targets, mask, BS)
    for name in ("kl_fixedexp", "ce_dpace"):
        for key, value in metrics.items():
            assert want[name][key] == value, (name, key)


def test_fixture_b_rows_equal_zlab_inference_per_anchor(fixture_b):
    """The training forward's block rows equal a z-lab inference forward with the same-document context."""
    m, inp, out, _ = fixture_b
    pos, doc = inp["position_ids"][0], inp["document_ids"][0]
    for j, a in enumerate(inp["anchor_positions"].tolist()):
        rows = [t for t in range(a) if doc[t] == doc[a]]
        block = torch.full((1, BS), MASK)
        block[0, 0] = inp["input_ids"][0, a]
        positions = torch.cat([pos[rows], pos[a] + torch.arange(BS)])[None]
        with torch.no_grad():
            logits = m.draft_block(inp["hidden_states"][:, rows], block, positions, None)
        assert maxdiff(logits[0], out.logits[0, BS * j:BS * j + BS]) <= TOL, j


def test_calibration_batch_runs_through_forward(fixture_b):
    """build_calibration_batch packs cache-reader items; forward takes the dict as is."""
    m, inp, _, _ = fixture_b
    doc, loss = inp["document_ids"][0], inp["loss_mask"][0]
    t = doc.numel()
    hs = inp["hidden_states"][0].view(t, len(G["aux_layer_ids"]), G["hidden"])
    bounds = [(int((doc == d).nonzero().min()), int((doc == d).nonzero().max()) + 1) for d in doc.unique().tolist()]
    samples = [{"input_ids": inp["input_ids"][0, s:e], "loss_mask": loss[s:e], "hidden_states": hs[s:e]}
               for s, e in bounds]
    # valid anchors: loss_mask 1 and a whole block inside the document
    ok = {i for s, e in bounds for i in range(s, e - BS + 1) if loss[i]}
    want = min(6, len(ok))
    g = torch.Generator().manual_seed(0)
    batch = C.build_calibration_batch(samples, 6, BS, MASK, g)
    assert set(batch) == set(C.BATCH_KEYS)
    assert torch.equal(batch["document_ids"][0], inp["document_ids"][0])
    assert torch.equal(batch["position_ids"][0], inp["position_ids"][0])
    anchors, valid = batch["anchor_positions"][0], batch["anchor_valid"][0]
    assert valid.sum() == want and set(anchors[valid].tolist()) <= ok
    assert anchors[valid].tolist() == sorted(anchors[valid].tolist())
    again = C.build_calibration_batch(samples, 6, BS, MASK, torch.Generator().manual_seed(0))
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    with torch.no_grad():
        out = m(**batch)
    assert out.logits.shape == (1, 6 * BS, G["vocab"])
    many = len(ok) + 4  # more anchors asked for than there are valid positions: the rest are padding
    padded = C.build_calibration_batch(samples, many, BS, MASK, torch.Generator().manual_seed(1))
    pv = padded["anchor_valid"][0]
    assert pv.sum() == len(ok) and (padded["anchor_positions"][0][~pv] == 0).all()
