"""Generate a DFlash2 golden fixture folder, of any geometry, with the two public reference implementations.

Not part of the suite and never imported by it (tests/fixtures/dflash2/README.md says what every tensor is).
The reference code is loaded from where you put it: z-lab's `dflash/model.py` (the commit that added
DFlash2, 07ebd93) by path, speculators (>= 0.8, which has `speculators.models.dflash2`) from PYTHONPATH;
nothing of either is copied here. Both run in one scratch interpreter (torch 2.13.0+cpu, transformers
5.17.0), never the project's .venv:

    python3.11 -m venv /tmp/dfl2/venv && /tmp/dfl2/venv/bin/pip install torch==2.13.0 transformers==5.17.0 \\
        pydantic pydantic-settings loguru rich typer "datasets<=5.1.0"
    pip download --no-deps speculators==0.9.0 -d /tmp/dfl2/wheels && unzip the wheel into /tmp/dfl2/spec
    PYTHONPATH=/tmp/dfl2/spec /tmp/dfl2/venv/bin/python tests/gen_dflash2_fixtures.py tests/fixtures/dflash2 \\
        --zlab /tmp/dfl2/zlab/dflash/model.py
    # another geometry, e.g.:  ... /tmp/fx2-b8 --zlab ... --hidden 48 --heads 6 --kv-heads 3 --head-dim 8 \\
    #     --intermediate 96 --vocab 80 --block-size 8 --group-size 12 --kernel-size 3 --rank 12 --top-k 5
    SPECQUANT_DFLASH2_FIXTURES=/tmp/fx2-b8 .venv/bin/python -m pytest -n 0 tests/test_dflash2.py

speculators' modules for its data-generation client and hidden-state transfer (openai, hs_connectors) are
imported by its package but never used by the model: they are stubbed when absent. CPU, fp32,
deterministic, 1 thread. The target's weights are not stored (only its embedding and head, and the hidden
states the drafter reads), so the folder stays a few hundred KB.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

# run as a script from the checkout (sys.path[0] = tests/): the DFlash generator's stub of speculators' unused imports
from gen_dflash_fixtures import _stub_unused_speculators_imports  # noqa: E402
from safetensors.torch import save_file

SEEDS = {"target": 1234, "drafter": 4321, "tokens": 7}
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter in sorted name order from one generator: 1-D 1 + 0.1 N(0,1); embed_tokens and the
    selector's codebooks N(0,1); a convolution's base_kernel [2, taps, H] 0.5 N(0,1) plus 1 on tap 0 (so the
    convolution is far from the identity); any other matrix [out, in] N(0,1) * in^-0.5."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            x = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.1 * x)
            elif "embed_tokens" in name or any(c in name for c in CODEBOOKS):
                p.copy_(x)
            elif name.endswith("base_kernel"):
                x = 0.5 * x
                x[:, 0] += 1
                p.copy_(x)
            else:
                p.copy_(x * p.shape[-1] ** -0.5)


def greedy_extend(target, ids: list[int], length: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        while len(ids) < length:
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def load_zlab(path: Path):
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def recorded_einsum(log: list):
    """z-lab's selector computes its pairwise term with torch.einsum: record each result (scores = unary + it)."""
    real = torch.einsum

    def einsum(*args, **kw):
        out = real(*args, **kw)
        log.append(out.detach().clone())
        return out

    torch.einsum = einsum
    try:
        yield
    finally:
        torch.einsum = real


def record_convs(model, prefix: str, out: dict) -> list:
    """Wrap every layer's conv prepare/finish (instance attributes) to record inputs and outputs; returns undo."""
    undo = []
    for i, layer in enumerate(model.layers):
        for side in ("attention_conv", "mlp_conv"):
            conv = getattr(layer, side)
            name = f"{prefix}_layer{i}_{side}"

            def prepare(x, _orig=conv.prepare, _n=name):
                y, dyn = _orig(x)
                out[f"{_n}_in"], out[f"{_n}_prepared"] = x.detach().clone(), y.detach().clone()
                return y, dyn

            def finish(x, dyn, _orig=conv.finish, _n=name):
                y = _orig(x, dyn)
                out[f"{_n}_sublayer_out"], out[f"{_n}_finished"] = x.detach().clone(), y.detach().clone()
                return y

            conv.prepare, conv.finish = prepare, finish
            undo.append(conv)
    return undo


def canonical(candidates: torch.Tensor, *per_candidate: torch.Tensor) -> list[torch.Tensor]:
    """Candidates in ascending id order (the reference's top-k is unsorted), the per-candidate tensors with them."""
    order = candidates.argsort(dim=-1)
    return [candidates.gather(-1, order)] + [t.gather(-1, order) for t in per_candidate]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--zlab", type=Path, required=True, help="z-lab/dflash's dflash/model.py (commit 07ebd93)")
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8, help="conv_group_size")
    ap.add_argument("--kernel-size", type=int, default=2, help="conv_kernel_size (taps)")
    ap.add_argument("--rank", type=int, default=8, help="selector_rank")
    ap.add_argument("--top-k", type=int, default=6, help="selector_top_k")
    a = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    _stub_unused_speculators_imports()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out: Path = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        run(a, out, Path(tmp))
    return 0


def run(a, out: Path, tmp: Path) -> None:
    import transformers
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    zlab = load_zlab(a.zlab)
    bs, V, H = a.block_size, a.vocab, a.hidden
    mask_id = V - 1
    prompt_len, seq_len = 10 + bs, 20 + 3 * bs

    # ------------------------------------------------------------ target (weights not stored)
    tcfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=a.intermediate,
                       num_hidden_layers=a.target_layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads, head_dim=a.head_dim, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    target = Qwen3ForCausalLM(tcfg).eval()
    randomize(target, SEEDS["target"])
    target.save_pretrained(tmp / "target")  # for speculators' verifier only
    g = torch.Generator().manual_seed(SEEDS["tokens"])
    sequence = greedy_extend(target, torch.randint(0, mask_id, (prompt_len,), generator=g).tolist(), seq_len)
    with torch.no_grad():
        hs = target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    layer_ids = zlab.build_target_layer_ids(a.target_layers, a.drafter_layers)  # z-lab ids: HF index l + 1
    features = torch.cat([hs[i + 1][0] for i in layer_ids], -1)  # [seq, n_aux * H]
    embed, head = target.model.embed_tokens.weight.detach().clone(), target.lm_head.weight.detach().clone()

    # ------------------------------------------------------------ z-lab DFlash2 drafter
    dflash_config = {"block_size": bs, "conv_group_size": a.group_size, "conv_kernel_size": a.kernel_size,
                     "mask_token_id": mask_id, "selector_rank": a.rank, "selector_top_k": a.top_k,
                     "target_layer_ids": layer_ids}
    dcfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=a.intermediate,
                       num_hidden_layers=a.drafter_layers, num_attention_heads=a.heads,
                       num_key_value_heads=a.kv_heads, head_dim=a.head_dim, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                       layer_types=["full_attention"] * a.drafter_layers, attn_implementation="eager")
    dcfg.architectures = ["DFlash2DraftModel"]
    dcfg.is_causal = False
    dcfg.dflash_config = dflash_config
    dcfg.num_target_layers = a.target_layers
    draft = zlab.DFlash2DraftModel(dcfg).eval()
    randomize(draft, SEEDS["drafter"])
    draft.save_pretrained(out / "zlab" / "checkpoint")
    head_mod = torch.nn.Linear(H, V, bias=False)
    head_mod.weight.data.copy_(head)

    inputs = {"sequence_input_ids": torch.tensor([sequence]), "embed_tokens_weight": embed,
              "lm_head_weight": head}
    expected: dict[str, torch.Tensor] = {}
    cache = DynamicCache(config=dcfg)
    # step 1: the prompt's context rows, the block after it; step 2: 3 new context rows (two accepted + bonus)
    steps = [(0, prompt_len, sequence[prompt_len]), (prompt_len, prompt_len + 3, sequence[prompt_len + 3])]
    zlab_scores_log: list[torch.Tensor] = []
    for n, (c0, start, bonus) in enumerate(steps, 1):
        block = torch.tensor([[bonus] + [mask_id] * (bs - 1)])
        pos = torch.arange(c0, start + bs)[None]
        ctx = features[c0:start][None]
        inputs.update({f"target_hidden_step{n}": ctx, f"block_input_ids_step{n}": block,
                       f"position_ids_step{n}": pos})
        layer_out = {}
        hooks = [layer.register_forward_hook(lambda _m, _i, o, _k=k, _d=layer_out: _d.__setitem__(_k, o.detach().clone()))
                 for k, layer in enumerate(draft.layers)]
        undo = record_convs(draft, f"step{n}", expected)
        with torch.no_grad():
            hidden = draft(target_hidden=ctx, noise_embedding=torch.nn.functional.embedding(block, embed),
                           position_ids=pos, past_key_values=cache, use_cache=True)
            zlab._crop_to(cache, start)
            draft_hidden = hidden[:, 1 - bs:]
            logits = draft.compute_logits(draft_hidden, head_mod)
            log: list[torch.Tensor] = []
            with recorded_einsum(log):
                path, candidates, _ = draft.propose(draft_hidden, block[:, 0], head_mod, 0.0)
        for h in hooks:
            h.remove()
        for conv in undo:
            del conv.prepare, conv.finish
        unary = logits.gather(-1, candidates)
        scores = unary + torch.stack(log, 1)
        zlab_scores_log.append(scores)
        cands, unary_c, scores_c = canonical(candidates, unary, scores)
        chosen = scores.max(-1).values
        expected.update({f"step{n}_hidden": hidden, f"step{n}_draft_logits": logits,
                         f"step{n}_selector_candidates": cands, f"step{n}_selector_unary": unary_c,
                         f"step{n}_selector_scores": scores_c, f"step{n}_path": path,
                         f"step{n}_path_scores": chosen, f"step{n}_argmax_tokens": logits.argmax(-1)})
        expected.update({f"step{n}_layer{k}_out": v for k, v in layer_out.items()})
        for k in range(a.drafter_layers):
            kk, vv = cache.layers[k].keys, cache.layers[k].values
            expected[f"step{n}_cropped_cache_k_layer{k}"], expected[f"step{n}_cropped_cache_v_layer{k}"] = kk, vv
    (out / "zlab").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in inputs.items()}, out / "zlab" / "inputs.safetensors")
    save_file({k: v.contiguous() for k, v in expected.items()}, out / "zlab" / "expected.safetensors")

    # ------------------------------------------------------------ speculators DFlash2 (same weights)
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import core as spec_core
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tl = Qwen3Config(**{k: v for k, v in dcfg.to_dict().items()
                        if k not in ("architectures", "dflash_config", "is_causal", "num_target_layers")})
    tl._attn_implementation = "eager"
    scfg = DFlash2SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=V, block_size=bs,
        aux_hidden_state_layer_ids=[i + 1 for i in layer_ids], mask_token_id=mask_id,
        conv_kernel_size=a.kernel_size, conv_group_size=a.group_size, selector_rank=a.rank, selector_top_k=a.top_k,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=bs - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="target", architectures=["Qwen3ForCausalLM"])))
    with contextlib.chdir(tmp):  # the verifier "target" is the temporary target directory, never the Hub
        spec = DFlash2DraftModel(scfg).eval()
    state = {k.removesuffix(".weight") if any(c in k for c in CODEBOOKS) else k: v
             for k, v in draft.state_dict().items() if "rotary" not in k}
    missing, unexpected = spec.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                               "verifier_norm.weight"}, (missing, unexpected)
    with torch.no_grad():
        spec.embed_tokens.weight.copy_(embed)
        spec.lm_head.weight.copy_(head)
        spec.verifier_lm_head.weight.copy_(head)
        spec.verifier_norm.weight.copy_(target.model.norm.weight)
    spec.save_pretrained(out / "speculators" / "checkpoint")
    (out / "speculators" / "checkpoint" / "config.py").unlink(missing_ok=True)  # speculators' own source

    T = 14 + bs
    anchors = torch.tensor([4, 9, 6, 0])
    valid = torch.tensor([True, True, True, False])
    got = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda _m, _i, o: got.__setitem__("pre", (o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        target(torch.tensor([sequence[:T]]))
    hook.remove()
    sinp = {"input_ids": torch.tensor([sequence[:T]]), "hidden_states": features[:T][None],
            "verifier_last_hidden_states": got["pre"], "loss_mask": torch.tensor([[0] * 4 + [1] * (T - 4)]),
            "document_ids": torch.zeros(1, T, dtype=torch.long), "position_ids": torch.arange(T)[None],
            "anchor_positions": anchors, "anchor_valid": valid}
    spec_core.select_anchors = lambda *_a, **_k: (anchors.clone(), valid.clone())
    batch = {k: sinp[k] for k in ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
                                  "document_ids", "position_ids")}
    with torch.no_grad():
        s_hidden, s_logits, _, _, idx = spec._backbone_forward(**batch, max_anchors=len(anchors))
        predecessors = spec._predecessor_ids(sinp["input_ids"], idx).reshape(1, -1)
        s_cands = s_logits.topk(a.top_k, dim=-1).indices
        s_scores = spec.candidate_selector.score_candidates(s_logits, s_hidden, predecessors, s_cands)
        # the convolution alone, on the first layer's attention input rows of the anchored blocks
        conv_in = spec.layers[0].input_layernorm(spec.embed_tokens(torch.where(
            torch.arange(len(idx)) % bs == 0, sinp["input_ids"][0, idx.clamp(max=T - 1)], mask_id))[None])
        conv_prepared, conv_dyn = spec.layers[0].attention_conv.prepare(conv_in)
        conv_finished = spec.layers[0].attention_conv.finish(conv_prepared, conv_dyn)
        # speculators' selector on z-lab's step-1 path (the path's own predecessors)
        z1 = expected["step1_path"]
        prev1 = torch.cat([inputs["block_input_ids_step1"][:, :1], z1[:, :-1]], 1)
        spec_step1 = spec.candidate_selector.score_candidates(
            expected["step1_draft_logits"], expected["step1_hidden"][:, 1:], prev1, expected["step1_selector_candidates"])
    cand_scores_diff = (spec_step1 - expected["step1_selector_scores"]).abs().max().item()
    s_cands_c, s_scores_c = canonical(s_cands, s_scores)
    save_file({k: v.contiguous() for k, v in sinp.items()}, out / "speculators" / "inputs.safetensors")
    save_file({"hidden": s_hidden, "logits": s_logits, "anchored_block_indices": idx,
               "selector_predecessor_ids": predecessors, "selector_candidates": s_cands_c,
               "selector_scores": s_scores_c, "conv_in": conv_in, "conv_prepared": conv_prepared,
               "conv_output_coefficients": conv_dyn.contiguous(), "conv_finished": conv_finished},
              out / "speculators" / "expected.safetensors")

    # ------------------------------------------------------------ cross-check: speculators rows = z-lab inference
    worst = 0.0
    for j, anc in enumerate(anchors.tolist()):
        if not valid[j]:
            continue
        blk = torch.tensor([[sequence[anc]] + [mask_id] * (bs - 1)])
        with torch.no_grad():
            zh = draft(target_hidden=features[:anc][None], noise_embedding=torch.nn.functional.embedding(blk, embed),
                       position_ids=torch.arange(anc + bs)[None])
        worst = max(worst, (zh[0] - s_hidden[0, j * bs:(j + 1) * bs]).abs().max().item())
    differs = int((expected["step1_path"] != expected["step1_argmax_tokens"]).sum()
                  + (expected["step2_path"] != expected["step2_argmax_tokens"]).sum())
    geometry = {"target_layers": a.target_layers, "drafter_layers": a.drafter_layers, "hidden": H, "heads": a.heads,
                "kv_heads": a.kv_heads, "head_dim": a.head_dim, "intermediate": a.intermediate, "vocab": V,
                "block_size": bs, "mask_token_id": mask_id, "zlab_target_layer_ids": layer_ids,
                "conv_group_size": a.group_size, "conv_kernel_size": a.kernel_size, "selector_rank": a.rank,
                "selector_top_k": a.top_k}
    provenance = {
        "zlab_model_py_sha256": hashlib.sha256(a.zlab.read_bytes()).hexdigest(),
        "speculators_version": _spec_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cross_check_max_abs": {"speculators_training_rows_vs_zlab_inference": worst,
                                "speculators_selector_scores_vs_zlab_step1": cand_scores_diff},
        "selector_path_differs_from_argmax_slots": differs,
    }
    (out / "geometry.json").write_text(json.dumps(geometry, indent=1) + "\n")
    (out / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    print(json.dumps(provenance, indent=1))
    shutil.rmtree(tmp / "target", ignore_errors=True)


def _spec_version() -> str:
    try:
        return importlib.metadata.version("speculators")
    except importlib.metadata.PackageNotFoundError:  # unpacked wheel on PYTHONPATH: read its dist-info
        import speculators

        for info in Path(speculators.__file__).parents[1].glob("speculators-*.dist-info"):
            return info.name.removeprefix("speculators-").removesuffix(".dist-info")
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
