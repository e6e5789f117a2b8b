"""Generate a DFlash golden fixture folder, of any geometry, with the two public reference implementations.

Not part of the suite and never imported by it. It follows tests/fixtures/dflash/README.md step by step
(random weights by sorted parameter name, greedy sequences, two z-lab inference steps, the reference
`dflash_generate` loop, speculators' converter and its training forward with fixed anchors, the eager
losses), so with the default arguments it reproduces the shipped fixtures (checked: `--check-against`),
and with others it writes the same folder for another geometry, e.g.

    git clone https://github.com/z-lab/dflash /tmp/dflash && git -C /tmp/dflash checkout 44947fbf
    pip install --no-deps --target /tmp/spec speculators==0.9.0
    PYTHONPATH=/tmp/spec .venv/bin/python tests/gen_dflash_fixtures.py /tmp/fx-b8 --zlab /tmp/dflash/dflash/model.py \\
        --target-layers 8 --drafter-layers 3 --hidden 48 --heads 6 --kv-heads 3 --head-dim 8 --intermediate 96 \\
        --vocab 96 --block-size 8
    SPECQUANT_FIXTURES=/tmp/fx-b8 make test

The reference code is loaded from where you put it (z-lab's model.py by path, speculators from
PYTHONPATH); nothing of it is copied here. speculators' modules for its data-generation client and
hidden-state transfer (openai, hs_connectors) are imported by its package but never used by the model,
converter or losses: they are stubbed when absent. Runs on CPU, fp32, deterministic, 1 thread.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

M_SEEDS = {"target": 1234, "drafter": 4321, "tokens": 7}


def _stub_unused_speculators_imports() -> None:
    class _Any(types.ModuleType):
        __path__: list = []

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            top = name.split(".")[0]
            if top in ("openai", "hs_connectors") and importlib.machinery.PathFinder.find_spec(top) is None:
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Any(spec.name)

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _Finder())


def randomize(model: torch.nn.Module, seed: int) -> None:
    """README: every parameter in sorted name order from one generator: 1-D 1 + 0.1 N(0,1), embed_tokens
    N(0,1), any other matrix [out, in] N(0,1) * in^-0.5."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            x = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.copy_(1 + 0.1 * x)
            elif "embed_tokens" in name:
                p.copy_(x)
            else:
                p.copy_(x * p.shape[1] ** -0.5)


def greedy_extend(target, ids: list[int], length: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        while len(ids) < length:
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def hidden_states(target, ids: list[int]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """HF output_hidden_states (index 0 embeddings ... last after the final norm) and the last decoder
    layer's output before the final norm."""
    got = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: got.__setitem__("pre", (out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    return tuple(h[0] for h in out.hidden_states), got["pre"][0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--zlab", type=Path, required=True, help="z-lab/dflash's dflash/model.py (commit 44947fb)")
    ap.add_argument("--target-layers", type=int, default=6)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--part", choices=("zlab", "speculators"), required=True,
                    help="zlab: target, z-lab drafter and fixture A (run under transformers 4.57.1, z-lab's pin); "
                         "speculators: fixture B from the z-lab checkpoint (run under 5.17.0 with speculators 0.9.0)")
    ap.add_argument("--check-against", type=Path, help="a fixture folder to compare every tensor with")
    a = ap.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out: Path = a.out.resolve()
    if a.part == "speculators":
        speculators_part(out)
        return compare(out, a.check_against) if a.check_against else 0
    zlab_part(a, out)
    return 0


def sizes(a) -> dict:
    """Sequence lengths scale with the block so every step and anchor has room (the defaults: the README's)."""
    bs = a.block_size
    return {"prompt": 10 + 2 * (bs - 4), "sequence": 32 + 4 * (bs - 4), "doc1": 12 + 2 * (bs - 4),
            "doc2_prompt": 4, "doc2": 8 + 2 * (bs - 4)}


def zlab_part(a, out: Path) -> None:
    from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

    spec = importlib.util.spec_from_file_location("zlab_dflash_model", a.zlab)
    zlab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zlab)
    zlab._cuda_time = time.perf_counter  # its stats timer synchronizes CUDA; on CPU a plain clock

    out.mkdir(parents=True, exist_ok=False)
    bs, mask_id, vocab = a.block_size, a.vocab - 1, a.vocab
    n = sizes(a)
    prompt_len, seq_len = n["prompt"], n["sequence"]
    shape = dict(hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 head_dim=a.head_dim, intermediate_size=a.intermediate, vocab_size=vocab, rms_norm_eps=1e-6,
                 rope_theta=1e6, tie_word_embeddings=False, attention_bias=False, bos_token_id=0, eos_token_id=1,
                 max_position_embeddings=256)

    # ------------------------------------------------------------ target
    tcfg = Qwen3Config(num_hidden_layers=a.target_layers, **shape)
    tcfg.architectures = ["Qwen3ForCausalLM"]
    target = Qwen3ForCausalLM(tcfg).eval()
    randomize(target, M_SEEDS["target"])
    target.save_pretrained(out / "target")
    target = Qwen3ForCausalLM.from_pretrained(out / "target", dtype=torch.float32, attn_implementation="eager").eval()

    # ------------------------------------------------------------ z-lab drafter
    layer_ids = zlab.build_target_layer_ids(a.target_layers, a.drafter_layers)
    dcfg = Qwen3Config(num_hidden_layers=a.drafter_layers, max_window_layers=a.drafter_layers, **shape)
    dcfg.architectures = ["DFlashDraftModel"]
    dcfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    dcfg.block_size = bs
    dcfg.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": layer_ids}
    dcfg.num_target_layers = a.target_layers
    dcfg._attn_implementation = "eager"
    drafter = zlab.DFlashDraftModel(dcfg).eval()
    randomize(drafter, M_SEEDS["drafter"])
    drafter.save_pretrained(out / "zlab" / "checkpoint")

    # ------------------------------------------------------------ token sequences
    g = torch.Generator().manual_seed(M_SEEDS["tokens"])
    prompt = torch.randint(0, mask_id, (prompt_len,), generator=g).tolist()
    sequence = greedy_extend(target, prompt, seq_len)
    hs, pre = hidden_states(target, sequence)

    def ctx(rows: slice) -> torch.Tensor:
        return torch.cat([hs[lid + 1][rows] for lid in layer_ids], -1)[None]

    # ------------------------------------------------------------ fixture A: two inference steps
    embed, lm_head = target.model.embed_tokens, target.lm_head
    caps: dict[str, torch.Tensor] = {}
    named = {"fc_out": drafter.fc, "context_fused": drafter.hidden_norm, "hidden": drafter.norm,
             **{f"layer{i}_out": layer for i, layer in enumerate(drafter.layers)}}
    hooks = [mod.register_forward_hook(lambda _m, _i, o, n=n: caps.__setitem__(n, o.detach().clone()))
             for n, mod in named.items()]
    cache = DynamicCache()
    accepted = 2  # step 2: a hypothetical acceptance of 2 drafted tokens plus the bonus token
    steps = {1: (slice(0, prompt_len), prompt_len, torch.arange(prompt_len + bs)),
             2: (slice(prompt_len, prompt_len + accepted + 1), prompt_len + accepted + 1,
                 torch.arange(prompt_len, prompt_len + accepted + 1 + bs))}
    inputs = {"sequence_input_ids": torch.tensor([sequence]), "context_input_ids": torch.tensor([prompt]),
              "target_all_hidden_states": torch.stack(hs), "target_last_prenorm_hidden": pre,
              "embed_tokens_weight": embed.weight.detach().clone(), "lm_head_weight": lm_head.weight.detach().clone()}
    expected = {}
    with torch.no_grad():
        for s, (rows, start, pos) in steps.items():
            block = torch.full((1, bs), mask_id)
            block[0, 0] = sequence[start]
            inputs |= {f"target_hidden_step{s}": ctx(rows), f"block_input_ids_step{s}": block,
                       f"position_ids_step{s}": pos[None]}
            noise = embed(block)
            hidden = drafter(target_hidden=ctx(rows), noise_embedding=noise, position_ids=pos[None],
                             past_key_values=cache, use_cache=True, is_causal=False)
            logits = lm_head(hidden)
            cache.crop(start)
            expected |= {f"step{s}_{k}": v for k, v in caps.items() if not (s == 2 and k == "fc_out")}
            expected |= {f"step{s}_noise_embedding": noise, f"step{s}_logits": logits,
                         f"step{s}_draft_logits": logits[:, 1 - bs:],
                         f"step{s}_draft_tokens": logits[:, 1 - bs:].argmax(-1)}
            for i in range(a.drafter_layers):
                layer = cache.layers[i]
                expected[f"step{s}_cropped_cache_k_layer{i}"] = layer.keys.clone()
                expected[f"step{s}_cropped_cache_v_layer{i}"] = layer.values.clone()
            caps.clear()
    for h in hooks:
        h.remove()
    save_file({k: v.clone().contiguous() for k, v in inputs.items()}, out / "zlab" / "inputs.safetensors")
    save_file({k: v.clone().contiguous() for k, v in expected.items()}, out / "zlab" / "expected.safetensors")

    # ------------------------------------------------------------ fixture A: the reference greedy loop
    calls = []
    forward = drafter.forward

    def traced(**kw):
        before = kw["past_key_values"].get_seq_length()
        hidden = forward(**kw)
        calls.append({"cache_len_before": before, "ctx_len": int(kw["target_hidden"].shape[1]),
                      "position_ids": kw["position_ids"][0].tolist(),
                      "draft_tokens": lm_head(hidden)[0, 1 - bs:].argmax(-1).tolist()})
        return hidden

    drafter.forward = traced
    new_tokens = 16
    res = zlab.dflash_generate(drafter, target, torch.tensor([prompt]), new_tokens, None, 0.0, return_stats=True)
    drafter.forward = forward
    output_ids = res.output_ids[0].tolist()
    trace = {"prompt_input_ids": prompt, "max_new_tokens": new_tokens, "temperature": 0.0, "output_ids": output_ids,
             "acceptance_lengths": res.acceptance_lengths, "draft_calls": calls,
             "output_equals_target_greedy": output_ids == greedy_extend(target, prompt, prompt_len + new_tokens)}
    (out / "zlab" / "e2e_trace.json").write_text(json.dumps(trace, indent=1))
    (out / "sizes.json").write_text(json.dumps({**n, "block_size": bs}) + "\n")  # for the speculators part
    (out / "README.md").write_text(
        f"# DFlash golden fixtures, generated\n\nWritten by `tests/gen_dflash_fixtures.py {' '.join(sys.argv[1:])}` "
        "following tests/fixtures/dflash/README.md (same layout, seeds and semantics) with the reference "
        f"implementations: z-lab/dflash 44947fb under transformers 4.57.1, speculators 0.9.0 under 5.17.0.\n\n"
        f"Target {a.target_layers} layers, drafter {a.drafter_layers} layers, hidden {a.hidden}, heads {a.heads}/"
        f"{a.kv_heads}, head_dim {a.head_dim}, intermediate {a.intermediate}, vocab {vocab} (mask {mask_id}), "
        f"block size {bs}, z-lab target_layer_ids {layer_ids}; prompt {prompt_len} tokens, sequence {seq_len}.\n")
    print(f"wrote {out} (fixture A): target {a.target_layers} layers, drafter {a.drafter_layers} layers, block {bs}, "
          f"vocab {vocab}, hidden {a.hidden}, z-lab layer ids {layer_ids}")


def speculators_part(out: Path) -> None:
    _stub_unused_speculators_imports()
    from transformers import Qwen3ForCausalLM

    n = json.loads((out / "sizes.json").read_text())
    bs = n["block_size"]
    inp = load_file(out / "zlab" / "inputs.safetensors")
    sequence = inp["sequence_input_ids"][0].tolist()
    target = Qwen3ForCausalLM.from_pretrained(out / "target", dtype=torch.float32, attn_implementation="eager").eval()
    mask_id = int(target.config.vocab_size) - 1
    g = torch.Generator().manual_seed(M_SEEDS["tokens"])
    prompt = torch.randint(0, mask_id, (n["prompt"],), generator=g).tolist()  # the same generator: the prompt first
    assert prompt == sequence[:n["prompt"]]
    doc2 = greedy_extend(target, torch.randint(0, mask_id, (n["doc2_prompt"],), generator=g).tolist(), n["doc2"])

    # ------------------------------------------------------------ fixture B: speculators
    from speculators.convert.dflash.converter import DFlashConverter
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash import core as spec_core

    @contextlib.contextmanager
    def cwd(path: Path):
        before = Path.cwd()
        os.chdir(path)
        try:
            yield
        finally:
            os.chdir(before)

    with cwd(out):
        DFlashConverter().convert(input_path="zlab/checkpoint", output_path="speculators/checkpoint",
                                  base_model="target", validate=True)
        scfg = DFlashSpeculatorConfig.from_pretrained("speculators/checkpoint")
        scfg.transformer_layer_config._attn_implementation = "eager"
        model = spec_core.DFlashDraftModel.from_pretrained("speculators/checkpoint", config=scfg).eval()
    aux = list(scfg.aux_hidden_state_layer_ids)
    doc1 = sequence[:n["doc1"]]  # document 0: the start of the z-lab sequence
    docs = [doc1, doc2]
    rows_hs, rows_pre = [], []
    for d in docs:
        dh, dp = hidden_states(target, d)
        rows_hs.append(torch.cat([dh[m] for m in aux], -1))
        rows_pre.append(dp)
    n0, n1 = len(doc1), len(doc2)
    loss_mask = [0] * 4 + [1] * (n0 - 4) + [0] * 2 + [1] * (n1 - 2)
    anchors = torch.tensor([4, 4 + bs + 1, n0 + 2, 0])
    valid = torch.tensor([True, True, True, False])
    sinp = {"input_ids": torch.tensor([doc1 + doc2]), "hidden_states": torch.cat(rows_hs)[None],
            "verifier_last_hidden_states": torch.cat(rows_pre)[None], "loss_mask": torch.tensor([loss_mask]),
            "document_ids": torch.tensor([[0] * n0 + [1] * n1]),
            "position_ids": torch.tensor([list(range(n0)) + list(range(n1))]),
            "anchor_positions": anchors, "anchor_valid": valid,
            "embed_tokens_weight": model.embed_tokens.weight.detach().clone(),
            "lm_head_weight": model.lm_head.weight.detach().clone(),
            "verifier_norm_weight": model.verifier_norm.weight.detach().clone()}
    spec_core.select_anchors = lambda *_a, **_k: (anchors.clone(), valid.clone())
    batch = {k: sinp[k] for k in ("hidden_states", "input_ids", "loss_mask", "verifier_last_hidden_states",
                                  "document_ids", "position_ids")}
    with torch.no_grad():
        hidden, logits, targets, alm, idx = model._backbone_forward(**batch, max_anchors=len(anchors))
        mask, _, _, _ = model._build_attention_mask(sinp["loss_mask"], len(anchors), sinp["document_ids"], "cpu")
        metrics = {}
        for name, fn, weighting in (("kl_fixedexp", "kl_div", "fixed-exp-decay"), ("ce_dpace", "ce", "dpace")):
            _, loss, m = model(**batch, loss_config=resolve_loss_config(fn, "eager"), gamma=4.0,
                               max_anchors=len(anchors), per_position_loss_weight=weighting, dpace_alpha=0.5)
            metrics[name] = {"loss": float(loss), **{k: float(v) for k, v in m.items()}}
    bool_mask = (mask.reshape(mask.shape[-2:]) == 0)
    save_file({k: v.contiguous() for k, v in sinp.items()}, out / "speculators" / "inputs.safetensors")
    save_file({"hidden": hidden, "logits": logits, "targets": targets, "aligned_loss_mask": alm.long(),
               "anchored_block_indices": idx, "attention_mask_bool": bool_mask.contiguous()},
              out / "speculators" / "expected.safetensors")
    (out / "speculators" / "expected_metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "sizes.json").unlink()
    print(f"wrote {out} (fixture B): speculators aux_hidden_state_layer_ids {aux}")


def compare(mine: Path, ref: Path) -> int:
    worst, bad = 0.0, []
    for rel in ("zlab/inputs", "zlab/expected", "speculators/inputs", "speculators/expected",
                "target/model", "zlab/checkpoint/model", "speculators/checkpoint/model"):
        a, b = load_file(mine / f"{rel}.safetensors"), load_file(ref / f"{rel}.safetensors")
        if a.keys() != b.keys():
            bad.append(f"{rel}: keys {sorted(a.keys() ^ b.keys())}")
        for k in a.keys() & b.keys():
            if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype:
                bad.append(f"{rel}:{k} {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
            elif a[k].is_floating_point():
                worst = max(worst, (a[k] - b[k]).abs().max().item())
            elif not torch.equal(a[k], b[k]):
                bad.append(f"{rel}:{k} differs")
    for rel in ("zlab/e2e_trace.json", "speculators/expected_metrics.json"):
        ja, jb = json.loads((mine / rel).read_text()), json.loads((ref / rel).read_text())
        if rel.endswith("metrics.json"):
            for n in jb:
                for k, v in jb[n].items():
                    if abs(ja[n][k] - v) > 1e-5:
                        bad.append(f"{rel}:{n}.{k} {ja[n][k]} vs {v}")
        elif ja != jb:
            bad.append(f"{rel} differs")
    print(f"max float diff vs {ref}: {worst:.2e}; {len(bad)} other differences")
    for b in bad:
        print("  " + b)
    return 0 if not bad and worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
