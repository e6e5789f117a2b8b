"""Where a speculative step's time goes in vLLM, at Qwen3-8B / DFlash-b16 shapes (issue 34).

    python -m bench.speed configs                      # here: bench/speed_models.json (config.json files)
    python -m bench.speed build --work DIR             # GPU machine: random-weight checkpoints under DIR
    python -m bench.speed run --work DIR --out OUT [--only NAME,...] [--budget-s 540] [--profile]
    python -m bench.speed report OUT/speed.json ... --json bench/results/<date>-h200-speed.json
    python -m bench.speed plot bench/results/<date>-h200-speed*.json --png docs/img/h200-speed.png

`build` writes, from bench/speed_models.json and seeded random tensors (torch + safetensors only, no
pipeline stage, no llm-compressor): the bf16 target, a W4A16 target (compressed-tensors pack-quantized,
group 128, every decoder linear; embed and LM head bf16), the bf16 drafter, a W4A16 drafter (fc, o_proj
and the MLP 4-bit; q/k/v dense, as quantize-drafter does), the same with `fc` dense, and a one-layer bf16
drafter (to split the drafter's layers from the rest of a step). The 4-bit tensors are random codes
with a fixed scale: the kernels and bytes are those of a real checkpoint, the numbers are not (nothing is
accepted at random weights, which is fine for the cost of a step).

`run` serves each configuration of CONFIGS through serve-check's own worker
(`python -m pipeline.serving.worker JOB RESULT`, CUDA graphs on, `speed` block), one engine at a time,
and writes OUT/speed.json after every engine (a run cut short keeps what it measured) with, per engine:
ms per step, tokens/s at batch 1 and 16, weight bytes, peak memory, load time, the kernel per layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS_JSON = HERE / "speed_models.json"
GROUP = 128

# name: (target, drafter or None, num_speculative_tokens, extra environment)
MARLIN = {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"}
CONFIGS: dict[str, tuple[str, str | None, int, dict]] = {
    "bf16/-": ("target-bf16", None, 0, {}),
    "bf16/bf16/k15": ("target-bf16", "drafter-bf16", 15, {}),
    "bf16/w4a16/k15": ("target-bf16", "drafter-w4a16", 15, {}),
    "bf16/w4a16-marlin/k15": ("target-bf16", "drafter-w4a16", 15, MARLIN),
    "bf16/w4a16-fcdense/k15": ("target-bf16", "drafter-w4a16-fcdense", 15, {}),
    "bf16/bf16-1layer/k15": ("target-bf16", "drafter-bf16-1layer", 15, {}),
    "bf16/bf16/k7": ("target-bf16", "drafter-bf16", 7, {}),
    "bf16/bf16/k3": ("target-bf16", "drafter-bf16", 3, {}),
    "bf16/w4a16/k7": ("target-bf16", "drafter-w4a16", 7, {}),
    "bf16/w4a16/k3": ("target-bf16", "drafter-w4a16", 3, {}),
    "w4a16/-": ("target-w4a16", None, 0, {}),
    "w4a16/bf16/k15": ("target-w4a16", "drafter-bf16", 15, {}),
    "w4a16/w4a16/k15": ("target-w4a16", "drafter-w4a16", 15, {}),
    "w4a16/w4a16-marlin/k15": ("target-w4a16", "drafter-w4a16", 15, MARLIN),
    # the matrix (second run): NVFP4 drafters and the NVFP4A16 target (Marlin FP4 on Hopper), and a target
    # with a 32k vocabulary to split the LM heads' share of a step from the rest
    "bf16/nvfp4/k15": ("target-bf16", "drafter-nvfp4", 15, {}),
    "w4a16/nvfp4/k15": ("target-w4a16", "drafter-nvfp4", 15, {}),
    "nvfp4a16/-": ("target-nvfp4a16", None, 0, {}),
    "nvfp4a16/bf16/k15": ("target-nvfp4a16", "drafter-bf16", 15, {}),
    "nvfp4a16/w4a16/k15": ("target-nvfp4a16", "drafter-w4a16", 15, {}),
    "nvfp4a16/nvfp4/k15": ("target-nvfp4a16", "drafter-nvfp4", 15, {}),
    "bf16v32k/-": ("target-bf16-v32k", None, 0, {}),
    "bf16v32k/bf16/k15": ("target-bf16-v32k", "drafter-bf16-v32k", 15, {}),
    # third run: the W4A16 target through Marlin instead of Machete (the drafter kernels follow the same switch),
    # and the verify pass: the target alone at batch x (k+1) sequences computes the rows a pair's verify computes
    # (batch 16 = one sequence's verify of 16 tokens, 256 = sixteen sequences'), so t(16) - t(1) bounds the
    # verify's extra rows at batch 1 (its LM head rows included); t(256) does not bound them at batch 16 (fourth
    # run: 24.9 ms, more than the whole pair: 256 sequences read 16x the KV of 16 and are scheduled as 256)
    "w4a16-marlin/-": ("target-w4a16", None, 0, MARLIN),
    "w4a16-marlin/bf16/k15": ("target-w4a16", "drafter-bf16", 15, MARLIN),
    "w4a16-marlin/nvfp4/k15": ("target-w4a16", "drafter-nvfp4", 15, MARLIN),
    "bf16/-/verify-rows": ("target-bf16", None, 0, {}),
    # fifth run: a vocabulary-trimmed draft head (`draft_vocab_size` 32,768 + `d2t`, the drafter's own head rows;
    # vLLM 0.26 `qwen3_dflash.py:673-689, :715-730`): the drafter's head reads 32,768 / 151,936 of the bytes;
    # beside the targets alone and the full-head pairs of the same run
    "w4a16-marlin/w4a16-head32k/k15": ("target-w4a16", "drafter-w4a16-head32k", 15, MARLIN),
    "w4a16-marlin/nvfp4-head32k/k15": ("target-w4a16", "drafter-nvfp4-head32k", 15, MARLIN),
    "w4a16-marlin/bf16-head32k/k15": ("target-w4a16", "drafter-bf16-head32k", 15, MARLIN),
    "bf16/w4a16-head32k/k15": ("target-bf16", "drafter-w4a16-head32k", 15, {}),
    "bf16/bf16-head32k/k15": ("target-bf16", "drafter-bf16-head32k", 15, {}),
    "w4a16/w4a16-head32k/k15": ("target-w4a16", "drafter-w4a16-head32k", 15, {}),
    # sixth run (issue 45): FP8 W8A8, the format Hopper's tensor cores run natively. The target: every decoder
    # linear FP8 per-channel weights with dynamic per-token activations (`fp8-dynamic`, CUTLASS scaled_mm); the
    # drafters as quantize-drafter writes them (fc, o_proj, MLP; q/k/v dense): `fp8` (static per-tensor
    # activation scale, the calibrated preset), `fp8-dynamic`, and `fp8` with the 32k head
    "fp8/-": ("target-fp8", None, 0, {}),
    "bf16/fp8/k15": ("target-bf16", "drafter-fp8", 15, {}),
    "bf16/fp8-dynamic/k15": ("target-bf16", "drafter-fp8-dynamic", 15, {}),
    "w4a16-marlin/fp8/k15": ("target-w4a16", "drafter-fp8", 15, MARLIN),
    "fp8/bf16/k15": ("target-fp8", "drafter-bf16", 15, {}),
    "fp8/w4a16/k15": ("target-fp8", "drafter-w4a16", 15, {}),
    "fp8/fp8/k15": ("target-fp8", "drafter-fp8", 15, {}),
    "fp8/fp8-head32k/k15": ("target-fp8", "drafter-fp8-head32k", 15, {}),
    "w4a16-marlin/fp8-head32k/k15": ("target-w4a16", "drafter-fp8-head32k", 15, MARLIN),
    # seventh run (issue 45, the whole matrix in one run, engines loaded three at a time and timed alone): the
    # W4A16 drafter through Marlin beside the FP8 target, and the FP8 drafter beside the Machete W4A16 target
    "fp8/w4a16-marlin/k15": ("target-fp8", "drafter-w4a16", 15, MARLIN),
    "w4a16/fp8/k15": ("target-w4a16", "drafter-fp8", 15, {}),
}
# the FP8 matrix's engines in waves of three, most wanted first (`--only fp8-matrix`; a run cut short by
# --budget-s keeps the first): the targets alone; the bf16, FP8 and W4A16 (Marlin) drafters beside the bf16, FP8
# and W4A16 Marlin targets; the dynamic and 32k-head FP8 drafters; then the Machete W4A16 target's row
FP8_MATRIX = ("bf16/-", "fp8/-", "w4a16-marlin/-",
              "bf16/bf16/k15", "fp8/bf16/k15", "w4a16-marlin/bf16/k15",
              "bf16/fp8/k15", "fp8/fp8/k15", "w4a16-marlin/fp8/k15",
              "bf16/w4a16-marlin/k15", "fp8/w4a16-marlin/k15", "w4a16/w4a16-marlin/k15",
              "bf16/fp8-dynamic/k15", "fp8/fp8-head32k/k15", "w4a16-marlin/fp8-head32k/k15",
              "w4a16/-", "w4a16/bf16/k15", "w4a16/w4a16/k15",
              "w4a16/fp8/k15")
# configs run at their own batch sizes (default: --batches) and with a larger KV cache where those need it
BATCHES = {"bf16/-/verify-rows": [1, 16, 256]}
KV_BYTES = {"bf16/-/verify-rows": 48 << 30}
NVFP4_GROUP = 16
# configs whose engine is also profiled (`--profile`): one more run per batch under torch's profiler after the
# timed runs (pipeline.serving.worker_speed.profile_steps), split by bench/steptrace.py
PROFILED = ("bf16/-", "bf16/bf16/k15", "w4a16-marlin/-", "w4a16-marlin/bf16/k15", "w4a16-marlin/w4a16-head32k/k15")
HEAD_VOCAB = 32768  # the trimmed draft head's rows


# ---- here: the config.json files --------------------------------------------------------------------
def write_configs() -> None:
    """bench/speed_models.json: the target's and the drafter's config.json at 8B shape, from the same code
    as bench/run_8b.py (bench.shapes) and quantize-drafter's speculators writer."""
    from bench.shapes import QWEN3_8B, drafter_config, target_config
    from pipeline.models.dflash import DFlashConfig
    from pipeline.models.formats import speculators_config_dict

    t = target_config(QWEN3_8B).to_dict()
    t.update(rope_theta=1_000_000.0, architectures=["Qwen3ForCausalLM"], dtype="bfloat16")
    cfg = drafter_config(DFlashConfig, QWEN3_8B)
    cfg.verifier_name_or_path, cfg.verifier_architectures = "TARGET", ["Qwen3ForCausalLM"]
    d = speculators_config_dict(cfg)
    d["dtype"] = d["transformer_layer_config"]["dtype"] = "bfloat16"
    MODELS_JSON.write_text(json.dumps({"target": t, "drafter": d}, indent=1, sort_keys=True) + "\n")
    print(MODELS_JSON)


# ---- GPU machine: checkpoints -----------------------------------------------------------------------
def _w4a16_config(ignore: list[str]) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                          "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": GROUP, "dynamic": False,
                                                      "actorder": None, "observer": "minmax"}}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


def _nvfp4_config(ignore: list[str], activations: bool) -> dict:
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": NVFP4_GROUP,
           "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "input_activations": {**fp4, "dynamic": "local"} if activations else None,
                                          "output_activations": None, "weights": {**fp4, "dynamic": False}}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


FP8_BLOCK = 128


def _fp8_config(ignore: list[str], kind: str) -> dict:
    """compressed-tensors `float-quantized` (what llm-compressor writes for its FP8 presets): `fp8-dynamic`
    per-channel weights and dynamic per-token activations (FP8_DYNAMIC), `fp8` per-tensor weights and a static
    per-tensor activation scale (FP8), `fp8-block` 128x128 weight blocks, dynamic per-group-of-128 activations
    (FP8_BLOCK)."""
    base = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "actorder": None,
            "observer": "minmax", "block_structure": None}
    w, a = {**base, "dynamic": False}, {**base}
    if kind == "fp8-dynamic":
        w["strategy"] = "channel"
        a.update(strategy="token", dynamic=True)
    elif kind == "fp8":
        w["strategy"] = "tensor"
        a.update(strategy="tensor", dynamic=False)
    else:
        w.update(strategy="block", block_structure=[FP8_BLOCK, FP8_BLOCK])
        a.update(strategy="group", group_size=FP8_BLOCK, dynamic=True)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "input_activations": a, "output_activations": None, "weights": w}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}}


def _linear(state: dict, name: str, out_f: int, in_f: int, quant: bool | str, gen, dev) -> None:
    """One Linear: bf16 (std 0.02), W4A16 (`True` or "w4a16": int4 codes uniform in [-7, 7], stored +8 as
    pack-quantized nibbles, so the weights have mean zero; group scale 0.005) or NVFP4 ("nvfp4", "nvfp4a16":
    random e2m1 bytes, symmetric, block scale 64 over a global scale giving std ~0.02)."""
    import torch

    if not quant:
        state[f"{name}.weight"] = (torch.randn(out_f, in_f, generator=gen, device=dev, dtype=torch.bfloat16)
                                   * 0.02).cpu()
        return
    if quant in (True, "w4a16"):
        codes = torch.randint(1, 16, (out_f, in_f // 8, 8), generator=gen, device=dev, dtype=torch.int64)
        shifts = torch.arange(0, 32, 4, device=dev, dtype=torch.int64)
        packed = ((codes << shifts).sum(-1) & 0xFFFFFFFF)
        state[f"{name}.weight_packed"] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).cpu()
        state[f"{name}.weight_scale"] = torch.full((out_f, in_f // GROUP), 0.005, dtype=torch.bfloat16)
        state[f"{name}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
        return
    if str(quant).startswith("fp8"):  # e4m3 codes of std ~1.3 with a scale of 0.015: weights of std ~0.02
        state[f"{name}.weight"] = (torch.randn(out_f, in_f, generator=gen, device=dev) * 1.3).clamp(-448, 448).to(
            torch.float8_e4m3fn).cpu()
        if quant == "fp8-dynamic":
            state[f"{name}.weight_scale"] = torch.full((out_f, 1), 0.015, dtype=torch.float32)
        elif quant == "fp8":
            state[f"{name}.weight_scale"] = torch.tensor([0.015], dtype=torch.float32)
            state[f"{name}.input_scale"] = torch.tensor([0.02], dtype=torch.float32)
        else:
            state[f"{name}.weight_scale"] = torch.full((-(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)), 0.015,
                                                       dtype=torch.float32)
        return
    state[f"{name}.weight_packed"] = torch.randint(0, 256, (out_f, in_f // 2), generator=gen, device=dev,
                                                   dtype=torch.uint8).cpu()
    state[f"{name}.weight_scale"] = torch.full((out_f, in_f // NVFP4_GROUP), 64.0).to(torch.float8_e4m3fn)
    state[f"{name}.weight_global_scale"] = torch.tensor([64.0 / 0.0068], dtype=torch.float32)
    if quant == "nvfp4":
        state[f"{name}.input_global_scale"] = torch.tensor([10.0], dtype=torch.float32)


def _layer(state: dict, prefix: str, c: dict, quant: set[str], gen, dev, kind: bool | str = True) -> None:
    import torch

    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    for n in ("input_layernorm", "post_attention_layernorm"):
        state[f"{prefix}.{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for n in ("q_norm", "k_norm"):
        state[f"{prefix}.self_attn.{n}.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    for n, o, k in (("q_proj", nh * hd, h), ("k_proj", nkv * hd, h), ("v_proj", nkv * hd, h), ("o_proj", h, nh * hd)):
        _linear(state, f"{prefix}.self_attn.{n}", o, k, kind if n in quant else False, gen, dev)
    for n, o, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
        _linear(state, f"{prefix}.mlp.{n}", o, k, kind if n in quant else False, gen, dev)


def _save(state: dict, config: dict, out: Path, shard_bytes: int = 4 << 30) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + n
    shards.append(cur)
    index = {}
    for j, sh in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / fname), metadata={"format": "pt"})
        index.update({k: fname for k in sh})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(config, indent=1))


SMALL_VOCAB = 32768  # the LM-head split: the same target and drafter with a 32k instead of a 152k vocabulary


def build(work: Path, seed: int = 0, only_models: list[str] | None = None) -> dict:
    import torch

    from bench.shapes import QWEN3_8B, build_tokenizer

    models = json.loads(MODELS_JSON.read_text())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    info: dict = {}
    all_linear = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    no_qkv = all_linear - {"q_proj", "k_proj", "v_proj"}
    tc = models["target"]
    for name, quant, kind, vocab in (("target-bf16", set(), False, None), ("target-w4a16", all_linear, "w4a16", None),
                                     ("target-nvfp4a16", all_linear, "nvfp4a16", None),
                                     ("target-bf16-v32k", set(), False, SMALL_VOCAB),
                                     ("target-fp8", all_linear, "fp8-dynamic", None)):
        out = work / name
        if (out / "config.json").is_file() or (only_models and name not in only_models):
            continue
        t0 = time.perf_counter()
        gen = torch.Generator(device=dev).manual_seed(seed)
        state: dict = {}
        cfg = dict(tc)
        cfg["vocab_size"] = vocab or tc["vocab_size"]
        state["model.embed_tokens.weight"] = (torch.randn(cfg["vocab_size"], tc["hidden_size"], generator=gen,
                                                          device=dev, dtype=torch.bfloat16) * 0.02).cpu()
        for li in range(tc["num_hidden_layers"]):
            _layer(state, f"model.layers.{li}", tc, quant, gen, dev, kind)
        state["model.norm.weight"] = torch.ones(tc["hidden_size"], dtype=torch.bfloat16)
        _linear(state, "lm_head", cfg["vocab_size"], tc["hidden_size"], False, gen, dev)
        if kind == "w4a16":
            cfg["quantization_config"] = _w4a16_config(["lm_head"])
        elif str(kind).startswith("fp8"):
            cfg["quantization_config"] = _fp8_config(["lm_head"], kind)
        elif kind:
            cfg["quantization_config"] = _nvfp4_config(["lm_head"], activations=False)
        _save(state, cfg, out)
        build_tokenizer(QWEN3_8B, out)
        info[name] = {"s": round(time.perf_counter() - t0, 1), "bytes": _dir_bytes(out)}
        del state
    dc = models["drafter"]
    lc = dc["transformer_layer_config"]
    ignore = ["re:.*self_attn\\.(q|k|v|qkv)_proj$", "re:(.*\\.)?lm_head$", "re:(.*\\.)?embed_tokens$"]
    n_layers = lc["num_hidden_layers"]
    for name, quant, fc_quant, layers, kind, verifier, head in (
            ("drafter-bf16", set(), False, n_layers, False, "target-bf16", None),
            ("drafter-w4a16", no_qkv, True, n_layers, "w4a16", "target-bf16", None),
            ("drafter-w4a16-fcdense", no_qkv, False, n_layers, "w4a16", "target-bf16", None),
            ("drafter-bf16-1layer", set(), False, 1, False, "target-bf16", None),
            ("drafter-nvfp4", no_qkv, True, n_layers, "nvfp4", "target-bf16", None),
            ("drafter-bf16-v32k", set(), False, n_layers, False, "target-bf16-v32k", None),
            ("drafter-bf16-head32k", set(), False, n_layers, False, "target-bf16", HEAD_VOCAB),
            ("drafter-w4a16-head32k", no_qkv, True, n_layers, "w4a16", "target-bf16", HEAD_VOCAB),
            ("drafter-nvfp4-head32k", no_qkv, True, n_layers, "nvfp4", "target-bf16", HEAD_VOCAB),
            ("drafter-fp8", no_qkv, True, n_layers, "fp8", "target-bf16", None),
            ("drafter-fp8-dynamic", no_qkv, True, n_layers, "fp8-dynamic", "target-bf16", None),
            ("drafter-fp8-head32k", no_qkv, True, n_layers, "fp8", "target-bf16", HEAD_VOCAB)):
        out = work / name
        if (out / "config.json").is_file() or (only_models and name not in only_models):
            continue
        t0 = time.perf_counter()
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        state = {}
        h = lc["hidden_size"]
        _linear(state, "fc", h, h * len(dc["aux_hidden_state_layer_ids"]), kind if fc_quant else False, gen, dev)
        state["hidden_norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        for li in range(layers):
            _layer(state, f"layers.{li}", lc, quant, gen, dev, kind)
        state["norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if head:  # its own head over `head` target tokens (here the first ones: d2t offsets 0) and the map
            _linear(state, "lm_head", head, h, False, gen, dev)
            state["d2t"] = torch.zeros(head, dtype=torch.int64)
        cfg = json.loads(json.dumps(dc))
        cfg["speculators_config"]["verifier"]["name_or_path"] = str(work / verifier)
        tl = cfg["transformer_layer_config"]
        tl["num_hidden_layers"], tl["max_window_layers"] = layers, layers
        tl["layer_types"] = tl["layer_types"][:layers]
        if head:
            cfg["draft_vocab_size"] = head
        if verifier != "target-bf16":
            tl["vocab_size"] = cfg["draft_vocab_size"] = SMALL_VOCAB
            cfg["mask_token_id"] = SMALL_VOCAB - 1
        if quant:
            ign = ignore + ([] if fc_quant else ["re:(.*\\.)?fc$"])
            q = (_w4a16_config(ign) if kind == "w4a16" else _fp8_config(ign, kind) if kind.startswith("fp8")
                 else _nvfp4_config(ign, activations=kind == "nvfp4"))
            cfg["quantization_config"] = tl["quantization_config"] = q
        _save(state, cfg, out)
        info[name] = {"s": round(time.perf_counter() - t0, 1), "bytes": _dir_bytes(out)}
    return info


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# ---- GPU machine: the runs --------------------------------------------------------------------------
def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def _capture_sizes(batches: list[int], k: int) -> list[int]:
    """CUDA-graph sizes for decode at these batch sizes (vLLM rounds to multiples of k+1 for a pair)."""
    sizes, b = set(), 1
    while b <= max(batches):
        sizes.add(b * (k + 1))
        b *= 2
    sizes.update(x * (k + 1) for x in batches)
    return sorted(sizes)


def _job(name: str, work: Path, out: Path, prompts: list, batches: list[int], max_tokens: int, prompt_len: int,
         profile: bool, profile_tokens: int, parallel: int) -> dict:
    target, drafter, k, _ = CONFIGS[name]
    cb = BATCHES.get(name, batches)
    job = {"name": name, "target_variant": name.split("/")[0], "linear_backend": "auto",
           "variant": name.split("/", 1)[1] if drafter else None,  # serve-check's job fields (verdict reads them)
           "target": str(work / target), "tokenizer": str(work / "target-bf16"),
           "drafter": str(work / drafter) if drafter else None, "num_speculative_tokens": k,
           "enforce_eager": False, "max_model_len": prompt_len + max_tokens + 64,
           "kv_cache_memory_bytes": KV_BYTES.get(name, (8 if parallel == 1 else 4) << 30),  # 16 x 704 tokens: 1.7 GB "dtype": "bfloat16", "attention_backend": "FLASH_ATTN",
           "max_tokens": 8, "seed": 0, "prompts": {"random": prompts[:2]},
           "compilation_config": {"cudagraph_capture_sizes": _capture_sizes(cb, k)},
           "speed": {"batches": cb, "max_tokens": max_tokens, "prompts": prompts[:max(cb)]}}
    if parallel > 1:  # vLLM refuses to start when less than utilization x total is free: the wave shares it
        job["gpu_memory_utilization"] = round(0.9 / parallel, 3)
    if profile and name in PROFILED:
        job["speed"]["profile"] = {"dir": str(out / "traces"), "batches": cb, "tokens": profile_tokens,
                                   "prefix": name.replace("/", "_")}
    return job


def _wave(names: list[str], jobs: dict[str, dict], out: Path, parallel: int) -> dict[str, dict]:
    """Start one worker per name at once; with more than one, each loads, waits for the others
    (`worker_engine.speed_gate`) and is timed alone under a lock. Returns the result per name."""
    import shutil
    import tempfile

    root = str(HERE.parent)
    gate = Path(tempfile.mkdtemp(prefix="speed-gate-", dir=out)) if parallel > 1 else None
    procs = {}
    for i, name in enumerate(names):
        jf, rf = out / f".job-{i}.json", out / f".result-{i}.json"
        rf.unlink(missing_ok=True)
        jf.write_text(json.dumps(jobs[name]))
        env = {**os.environ, **CONFIGS[name][3], "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHONUNBUFFERED": "1", **({"SPECQUANT_SPEED_GATE": str(gate)} if gate else {})}
        print(f"[speed] {name}: start", flush=True)
        err_file = open(out / f".stderr-{i}.log", "w")  # noqa: SIM115 - closed once the worker has exited
        pr = subprocess.Popen([sys.executable, "-m", "pipeline.serving.worker", str(jf), str(rf)], env=env,
                              stdout=subprocess.DEVNULL, stderr=err_file)
        procs[name] = (pr, jf, rf, out / f".stderr-{i}.log", err_file, time.perf_counter())
    while gate and not (gate / "go").exists():  # go once every engine is loaded or gone
        ready = {p.name for p in gate.glob("ready-*")}
        if all(pr.poll() is not None or f"ready-{pr.pid}" in ready for pr, *_ in procs.values()):
            (gate / "go").write_text("")
        time.sleep(0.5)
    results = {}
    for name, (pr, jf, rf, ef, err_file, t0) in procs.items():
        pr.wait()
        err_file.close()
        err = ef.read_text(errors="replace")
        r = json.loads(rf.read_text()) if rf.is_file() else {"ok": False, "error": err[-3000:]}
        r["process_s"] = round(time.perf_counter() - t0, 1)
        r["env"] = CONFIGS[name][3]
        r["parallel"] = parallel
        r.update(_kernels(r))
        if not r.get("ok"):
            r["stderr_tail"] = err[-3000:]
        for f in (jf, rf, ef):
            f.unlink(missing_ok=True)
        results[name] = r
    if gate:
        shutil.rmtree(gate, ignore_errors=True)
    return results


def run(work: Path, out: Path, only: list[str], budget_s: float, batches: list[int], max_tokens: int,
        prompt_len: int, profile: bool = False, profile_tokens: int = 32, parallel: int = 1) -> None:
    """Serve each named config (`fp8-matrix`: FP8_MATRIX), `parallel` engines loading at once, each timed
    alone; OUT/speed.json is rewritten after every wave and a rerun skips what it already measured."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "speed.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    res.setdefault("engines", {})
    res.update(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               command=" ".join(["python -m bench.speed", *sys.argv[1:]]), batches=batches, max_tokens=max_tokens,
               prompt_tokens=prompt_len, shapes="Qwen3-8B target (36 layers) / DFlash-b16 drafter (5 layers), random weights")
    vocab = json.loads(MODELS_JSON.read_text())["target"]["vocab_size"]
    # token ids below the 32k vocabulary of the LM-head split's target, so every engine gets the same prompts
    prompts = _prompts(max(batches + [b for bs in BATCHES.values() for b in bs]), prompt_len, min(vocab, SMALL_VOCAB), 0)
    t_start = time.perf_counter()
    names = [n for x in (only or list(CONFIGS)) for n in (FP8_MATRIX if x == "fp8-matrix" else [x])]
    todo = [n for n in dict.fromkeys(names) if not res["engines"].get(n, {}).get("ok")]
    for i in range(0, len(todo), max(parallel, 1)):
        wave = todo[i:i + max(parallel, 1)]
        elapsed = time.perf_counter() - t_start
        if elapsed > budget_s:
            print(f"[speed] budget spent ({elapsed:.0f}s): skipping {', '.join(wave)}", flush=True)
            continue
        jobs = {n: _job(n, work, out, prompts, batches, max_tokens, prompt_len, profile, profile_tokens, len(wave))
                for n in wave}
        for name, r in _wave(wave, jobs, out, len(wave)).items():
            res["engines"][name] = r
            sp = (r.get("speed") or {}).get("batches") or {}
            print(f"[speed] {name}: ok={r.get('ok')} load={r.get('load_s')} " + " ".join(
                f"b{b}={v['ms_per_step']}ms/step" for b, v in sp.items()) + f" {r.get('error', '')}", flush=True)
        path.write_text(json.dumps(res, indent=1, sort_keys=True))


def _kernels(r: dict) -> dict:
    """The linear kernels vLLM built for the target (root `model`) and the drafter (any other root:
    `drafter.model` on the V1 runner, `speculator.model` on vLLM 0.26's V2 runner), with layer counts."""
    out: dict = {"drafter_kernels": {}, "target_kernels": {}}
    for x in r.get("layers") or []:
        if x.get("kernel"):
            side = out["target_kernels" if x.get("root") == "model" else "drafter_kernels"]
            side[x["kernel"]] = side.get(x["kernel"], 0) + 1
    return out


def report(inputs: list[Path], out_json: Path, issue: int = 34) -> str:
    """The runs' speed.json files -> bench/results/<date>-h200-speed.json (`pairs`: target, drafter, batch,
    ms_per_step, tok_s, weight_bytes, peak_bytes, ...) and the markdown table for docs/benchmarks.md."""
    engines, meta = {}, []
    for f in inputs:
        d = json.loads(f.read_text())
        meta.append({k: d.get(k) for k in ("date", "command", "batches", "max_tokens", "prompt_tokens", "shapes")})
        engines.update({k: {**v, **_kernels(v)} for k, v in d["engines"].items()})
    alone = {}
    pairs = []
    for name, r in engines.items():
        target, drafter, k, env = CONFIGS[name]
        for b, x in sorted(((r.get("speed") or {}).get("batches") or {}).items(), key=lambda kv: int(kv[0])):
            row = {"config": name, "target": target.removeprefix("target-"),
                   "drafter": drafter.removeprefix("drafter-") if drafter else None, "num_speculative_tokens": k,
                   "env": env, "batch": int(b), "ms_per_step": x["ms_per_step"], "tok_s": x["tok_s"],
                   "tau": x.get("tau"), "steps_per_seq": x.get("steps_per_seq"),
                   "decode_s_source": x.get("decode_s_source"), "weight_bytes": r.get("weight_bytes"),
                   "peak_bytes": r.get("peak_gpu_bytes"), "gpu_used_bytes": r.get("gpu_used_bytes"),
                   "load_s": r.get("load_s"), "drafter_kernels": r.get("drafter_kernels"),
                   "target_kernels": r.get("target_kernels")}
            if drafter is None:
                alone.setdefault((served_target(row), row["batch"]), row)
            pairs.append(row)
    for row in pairs:
        a = alone.get((served_target(row), row["batch"]))
        if row["drafter"] and a:
            row["overhead_ms"] = round(row["ms_per_step"] - a["ms_per_step"], 3)
            row["overhead_ratio_to_target_step"] = round(row["overhead_ms"] / a["ms_per_step"], 3)
    # each drafter's overhead against the bf16 drafter's (full head) beside the same target, kernel, batch and k
    bf16 = {(served_target(r), r["batch"], r["num_speculative_tokens"]): r for r in pairs
            if r["drafter"] == "bf16" and "overhead_ms" in r}
    for row in pairs:
        ref = bf16.get((served_target(row), row["batch"], row["num_speculative_tokens"]))
        if ref is not None and "overhead_ms" in row and ref["overhead_ms"] > 0:
            row["overhead_vs_bf16_drafter"] = round(row["overhead_ms"] / ref["overhead_ms"], 3)
    first = next(iter(engines.values()), {})
    out = {"issue": issue, "runs": meta, "versions": first.get("versions"), "pairs": pairs}
    out_json.write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| config | target | drafter | k | batch | ms/step | + vs target alone | vs bf16 drafter | tok/s | "
             "drafter kernel | weights GB (target + drafter own) | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in pairs:
        wb = r["weight_bytes"] or {}
        lines.append(f"| {r['config']} | {r['target']} | {r['drafter'] or '-'} | {r['num_speculative_tokens'] or '-'} | "
                     f"{r['batch']} | {r['ms_per_step']:.2f} | "
                     + (f"{r['overhead_ms']:+.2f}" if "overhead_ms" in r else "-")
                     + (f" | {100 * r['overhead_vs_bf16_drafter']:.0f}%" if "overhead_vs_bf16_drafter" in r else " | -")
                     + f" | {r['tok_s']:.0f} | {', '.join(f'{k} x{n}' for k, n in (r['drafter_kernels'] or {}).items()) or '-'} | "
                     f"{(wb.get('target') or 0) / 1e9:.2f} + {(wb.get('drafter') or 0) / 1e9:.2f} | "
                     f"{(r['peak_bytes'] or 0) / 1e9:.1f} |")
    return "\n".join(lines) + "\n"


def served_target(row: dict) -> str:
    """The target as served: `w4a16-marlin` where Machete is disabled for a W4A16 target. The setting moves
    only int4 GEMMs, so an FP8 or bf16 target beside a Marlin W4A16 drafter is the same target as alone."""
    marlin = bool((row.get("env") or {}).get("VLLM_DISABLED_KERNELS"))
    return row["target"] + ("-marlin" if marlin and row["target"] == "w4a16" else "")


# the plot's rows (target as served) and bars (drafter beside it), k = 15
PLOT_TARGETS = {"bf16": "bf16", "w4a16": "W4A16 (Machete)", "w4a16-marlin": "W4A16 (Marlin)", "fp8": "FP8 (W8A8)",
                "nvfp4a16": "NVFP4A16 (Marlin FP4)"}
PLOT_DRAFTERS = {None: "target alone", "bf16": "+ bf16 drafter", "w4a16": "+ W4A16 drafter", "fp8": "+ FP8 drafter",
                 "nvfp4": "+ NVFP4 drafter"}


def plot_cells(results: list[Path]) -> dict[tuple[str, str | None, int], dict]:
    """{(target as served, drafter, batch): row} from bench/results speed files; a later file wins a cell, so
    pass them oldest first. Rows outside the matrix (one-layer or 32k drafters, k != 15) are left out."""
    cells: dict[tuple[str, str | None, int], dict] = {}
    for f in results:
        for row in json.loads(Path(f).read_text())["pairs"]:
            # a Marlin row of any target: the drafter's int4 GEMMs moved too, so it is not the default cell
            marlin = bool((row.get("env") or {}).get("VLLM_DISABLED_KERNELS"))
            target = row["target"] + ("-marlin" if marlin else "")
            if target not in PLOT_TARGETS or row["drafter"] not in PLOT_DRAFTERS:
                continue
            if row["drafter"] and row["num_speculative_tokens"] != 15:
                continue
            cells[(target, row["drafter"], row["batch"])] = {**row, "source": Path(f).name}
    return cells


def plot(results: list[Path], out: Path, title: str) -> Path:
    """ms per decode step, target alone and with each drafter, at batch 1 and 16 (one panel each)."""
    from pipeline.core.plotting import pyplot, save_png

    cells = plot_cells(results)
    plt = pyplot()
    batches = sorted({b for (_, _, b) in cells if b in (1, 16)})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.2), squeeze=False)
    targets = [t for t in PLOT_TARGETS if any(k[0] == t for k in cells)]
    width = 0.8 / len(PLOT_DRAFTERS)
    for ax, b in zip(axes[0], batches):
        for n, (d, label) in enumerate(PLOT_DRAFTERS.items()):
            xs, ys = [], []
            for i, t in enumerate(targets):
                if (t, d, b) in cells:
                    xs.append(i + (n - (len(PLOT_DRAFTERS) - 1) / 2) * width)
                    ys.append(cells[(t, d, b)]["ms_per_step"])
            bars = ax.bar(xs, ys, width, label=label)
            ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
        ax.set_xticks(range(len(targets)), [PLOT_TARGETS[t] for t in targets], fontsize=8)
        ax.set_ylabel("ms per decode step (whole batch)")
        ax.set_title(f"batch {b}, k = 15", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return save_png(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("configs", "build", "run", "report", "plot"))
    p.add_argument("inputs", nargs="*", help="report: the runs' speed.json files; plot: bench/results speed "
                   "files, oldest first (a later one wins a cell)")
    p.add_argument("--png", default="docs/img/h200-speed.png", help="plot: where the PNG goes")
    p.add_argument("--title", default="H200, vLLM 0.26.0, Qwen3-8B / DFlash-b16 shapes, random weights",
                   help="plot: its title")
    p.add_argument("--json", default=None, help="report: where the bench/results JSON goes")
    p.add_argument("--issue", type=int, default=34, help="report: the issue the run answers (recorded)")
    p.add_argument("--work", default="/dev/shm/speed")
    p.add_argument("--out", default="speed-out")
    p.add_argument("--only", default="", help="comma-separated CONFIGS names (default all, in order)")
    p.add_argument("--models", default="", help="build: only these checkpoints (comma-separated; default all)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no engine after this many seconds")
    p.add_argument("--parallel", type=int, default=1, help="run: engines loading at once (each is timed alone, "
                   "under a lock, once all of its wave have loaded); the device's memory must hold them all")
    p.add_argument("--profile", action="store_true", help="run: also profile the PROFILED configs (traces under OUT/traces)")
    p.add_argument("--profile-tokens", type=int, default=32, help="run: tokens per profiled run")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    a = p.parse_args(argv)
    if a.cmd == "configs":
        write_configs()
    elif a.cmd == "report":
        print(report([Path(x) for x in a.inputs], Path(a.json), a.issue))
    elif a.cmd == "plot":
        print(plot([Path(x) for x in a.inputs], Path(a.png), a.title))
    elif a.cmd == "build":
        print(json.dumps(build(Path(a.work), only_models=[x for x in a.models.split(",") if x])), flush=True)
    else:
        run(Path(a.work), Path(a.out), [x for x in a.only.split(",") if x], a.budget_s,
            [int(b) for b in a.batches.split(",")], a.max_tokens, a.prompt_len, a.profile, a.profile_tokens,
            a.parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
