"""A drafter's RoPE as vLLM builds it: `rope_parameters.partial_rotary_factor` (a Qwen3.5 target's 0.25) rotates
only that part of each head in vLLM's DFlash draft (`get_rope`), while transformers' Qwen3 rotates the whole head.
The reference loop follows vLLM; the tiny hybrid drafter, trained rotating its whole head, says so in its config.
(Seen on the H200, docs/hybrid.md: served with the target's 0.25 in its config, vLLM accepted ~0.12 tokens per step.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
VLLM = os.environ.get("SPECQUANT_VLLM_CPU")
DRAFTER = REPO / "assets" / "tiny-hybrid" / "drafter"

# every case of one module in one vLLM process (importing vLLM takes most of a case's time): argv[1] is a JSON
# list of [rope args, input file, output file]
VLLM_ROPE = """
import json, sys, torch
from safetensors.torch import load_file, save_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
for a, src, dst in json.loads(sys.argv[1]):
    t = load_file(src)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(a["head_dim"], max_position=a["max_position"], rope_parameters=a["rope_parameters"])
    q, k = rope.forward_native(t["positions"], t["q"].clone(), t["k"].clone())
    save_file({"q": q.contiguous(), "k": k.contiguous()}, dst)
"""
FACTORS = [None, 0.25, 0.5]


def _ours(config, positions, x):
    from pipeline.models.dflash import apply_rope, rope_inv_freq

    inv, scale = rope_inv_freq(config)
    freqs = positions[:, None].float() * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return apply_rope(x, (emb.cos() * scale)[None], (emb.sin() * scale)[None])  # x [1, heads, S, D]


def _case(factor):
    """(the drafter config with `partial_rotary_factor` = factor (None: absent), positions, q, k, get_rope's args)."""
    from pipeline.models.formats import load_drafter_config

    config = load_drafter_config(DRAFTER)
    rp = {k: v for k, v in config.rope_parameters.items() if k != "partial_rotary_factor"}
    if factor is not None:
        rp["partial_rotary_factor"] = factor
    config.rope_parameters = rp
    d, heads, n = config.head_dim, config.num_attention_heads, 37
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, config.max_position_embeddings, (n,), generator=g)
    q = torch.randn(n, heads * d, generator=g)
    k = torch.randn(n, heads * d, generator=g)
    return config, positions, q, k, {"head_dim": d, "max_position": config.max_position_embeddings,
                                     "rope_parameters": rp}


@pytest.fixture(scope="module")
def vllm_rotated(tmp_path_factory) -> dict:
    """{factor: vLLM's rotated q and k} for every FACTORS case, from one process of vLLM's CPU build."""
    from safetensors.torch import load_file, save_file

    if not VLLM:
        pytest.skip("needs vLLM's CPU build (SPECQUANT_VLLM_CPU)")
    folder, cases = tmp_path_factory.mktemp("rope"), []
    for i, factor in enumerate(FACTORS):
        _, positions, q, k, args = _case(factor)
        save_file({"positions": positions, "q": q, "k": k}, str(folder / f"in-{i}.safetensors"))
        cases.append([args, str(folder / f"in-{i}.safetensors"), str(folder / f"out-{i}.safetensors")])
    proc = subprocess.run([VLLM, "-c", VLLM_ROPE, json.dumps(cases)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {factor: load_file(case[2]) for factor, case in zip(FACTORS, cases)}


@pytest.mark.parametrize("factor", FACTORS)
def test_the_reference_rotates_what_vllm_rotates(vllm_rotated, factor):
    config, positions, q, k, _ = _case(factor)
    d, heads, n = config.head_dim, config.num_attention_heads, len(positions)
    assert config.rotary_dim == int(d * (factor or 1.0))
    got = vllm_rotated[factor]
    for name, x in (("q", q), ("k", k)):
        ours = _ours(config, positions, x.view(n, heads, d).transpose(0, 1)[None])[0].transpose(0, 1).reshape(n, -1)
        assert torch.allclose(ours, got[name], atol=1e-5, rtol=1e-5), (name, (ours - got[name]).abs().max())
        if factor is not None:  # the part vLLM does not rotate is left as it is, and the whole-head rotation differs
            tail = x.view(n, heads, d)[..., config.rotary_dim:]
            assert torch.equal(ours.view(n, heads, d)[..., config.rotary_dim:], tail)


def test_the_tiny_hybrid_drafter_says_it_rotates_its_whole_head():
    from pipeline.models.formats import load_drafter_config

    config = load_drafter_config(DRAFTER)
    target = json.loads((REPO / "assets" / "tiny-hybrid" / "target" / "config.json").read_text())
    assert float(target.get("partial_rotary_factor") or target["rope_parameters"]["partial_rotary_factor"]) < 1
    assert config.rotary_dim == config.head_dim
