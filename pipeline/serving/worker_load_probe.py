"""serve-check worker, load-and-probe mode (DFlash2, `job["kind"] == LOAD_PROBE`, `run_load_probe`), run
inside vLLM's interpreter (standard library, vLLM and torch only; see `pipeline.serving.worker`).

No engine (vLLM 0.32's V1 runner refuses DFlash2, its V2 runner needs Triton): vLLM's own DFlash2 model class built
from a real VllmConfig and loaded through the engine's loader, its modules and schemes reported, one draft block run
through them (`job["probe"]` in, `job["probe_out"]` out, with `job["target_head"]`: where the target's embedding
and head are, from the project's target families, `pipeline.models.targets.head_lookup`); `job["meta"]`: built on
the meta device at a checkpoint's real shapes, nothing loaded.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from pipeline.serving.worker_common import (
    LogLines,
    finish,
    platform_name,
    record_error,
    register_cpu_emulation,
    settle_logging,
)

LOAD_PROBE = "load_probe"  # the job kind this mode runs (`pipeline.serving.records.LOAD_PROBE`, the stage's side)
DFLASH2_NO_ENGINE = ("loaded by vLLM {vllm}'s DFlash2 model class ({cls}), no engine run: weights read by its own "
                     "load_weights, one draft block run through its modules with the attention computed in torch")
_SENTINEL = 0xA5  # every parameter byte is set to this before loading: a row still all 0xA5 was never written


def _fill_sentinel(model) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and p.data.is_contiguous():
                p.data.view(-1).view(torch.uint8).fill_(_SENTINEL)


def _unwritten(model) -> tuple[list[str], list[str]]:
    """(parameters no byte of which the loader wrote, parameters with some output row it never wrote)."""
    import torch

    missing, partial = [], []
    for name, p in model.named_parameters():
        if not p.numel() or not p.data.is_contiguous():
            continue
        raw = p.data.reshape(p.shape[0] if p.dim() > 1 else 1, -1).view(torch.uint8)
        untouched = (raw == _SENTINEL).all(dim=1)
        if bool(untouched.all()):
            missing.append(name)
        elif bool(untouched.any()):
            partial.append(name)
    return missing, partial


def _runtime_name(name: str, num_target_layers: int) -> str:
    """A module path of the drafter under vLLM's runtime name: draft layer i is `model.layers.{i + T}` (the
    prefix its quant config matches), though it sits at index i of the ModuleList."""
    return re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m.group(1)) + num_target_layers}.", name)


def _module_schemes(model, num_target_layers: int) -> dict[str, dict]:
    """Every linear layer of the drafter under vLLM's runtime name: its compressed-tensors scheme (or dense)
    and the parameters it holds; the bare DFlash2 Parameters (base kernels, codebooks) with dtype and shape."""
    out: dict[str, dict] = {}
    for name, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or not hasattr(m, "input_size") or name.endswith(("embed_tokens", "lm_head")):
            continue
        scheme = getattr(m, "scheme", None)
        out[getattr(m, "prefix", None) or _runtime_name(name, num_target_layers)] = {
            "kind": "linear", "quant_method": type(qm).__name__,
            "scheme": type(scheme).__name__ if scheme is not None else None,
            "weight_only": getattr(scheme, "use_a16", None),
            "params": sorted(n for n, _ in m.named_parameters(recurse=False))}
    for name, p in model.named_parameters():
        if name.endswith(("base_kernel", "_codebook")):
            out[_runtime_name(name, num_target_layers)] = {"kind": "parameter", "dtype": str(p.dtype).removeprefix(
                "torch."), "shape": list(p.shape)}
    return out


def _target_head(target: str, lookup: dict) -> dict:
    """The target's embed_tokens / lm_head tensors (a DFlash drafter borrows both; the engine shares them),
    under the names its layout stores them, as the job gives them (`job["target_head"]`, written on the project
    side by `pipeline.models.targets.head_lookup`: `model.` or a multimodal wrapper's `model.language_model.`,
    and the prefixes of parts that are never the text decoder's)."""
    from safetensors import safe_open

    wanted = {lookup["embed"]: "embed_tokens", lookup["lm_head"]: "lm_head"}
    skip = tuple(lookup["skip_prefixes"])
    found = {}
    for f in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in wanted:
                    found[wanted[k]] = fh.get_tensor(k)
                elif k.endswith(("embed_tokens.weight", "lm_head.weight")) and not k.startswith(skip):
                    # another prefix (a base model saved alone): by suffix, never the MTP head's or vision tower's
                    found.setdefault("lm_head" if k.endswith("lm_head.weight") else "embed_tokens", fh.get_tensor(k))
    if "lm_head" not in found and "embed_tokens" in found:  # tied head
        found["lm_head"] = found["embed_tokens"]
    return found


class _TorchBlockAttention:  # bound as the Attention module's forward (the module itself stays)
    """Stands in for one draft layer's `Attention` (which needs the engine's KV cache and metadata): the block's
    queries attend to [context K/V from vLLM's own precompute ; the block's K/V], in torch, as the layer was built:
    non-causal or causal (`causal`), and within its `sliding_window` when it has one, with vLLM's convention: the
    window `(w - 1, 0)` (vllm 0.32 v1/attention/backends/flash_attn.py:1079-1082), made `(w - 1, w - 1)` for a
    non-causal layer (`_maybe_symmetrize_window`, flash_attn.py:581-592): a query at position p sees keys at
    positions p - w < k, and k < p + w when non-causal, k <= p when causal."""

    def __init__(self, attn, ctx_k, ctx_v, positions=None, window=None, causal=False):
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_size
        self.scale, self.ctx_k, self.ctx_v = attn.impl.scale if hasattr(attn, "impl") else attn.scale, ctx_k, ctx_v
        # positions: (context positions [C], block positions [n]); needed only for a window or causal attention
        self.positions, self.window, self.causal = positions, window, causal

    def __call__(self, q, k, v):
        import torch

        n = q.shape[0]
        q = q.view(n, self.heads, self.head_dim).transpose(0, 1)
        k = torch.cat([self.ctx_k, k.view(n, self.kv_heads, self.head_dim)], 0).transpose(0, 1)
        v = torch.cat([self.ctx_v, v.view(n, self.kv_heads, self.head_dim)], 0).transpose(0, 1)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = (q.float() @ k.float().transpose(1, 2)) * self.scale
        if self.window is not None or self.causal:
            q_pos = self.positions[1].long()
            gap = q_pos[:, None] - torch.cat([self.positions[0].long(), q_pos])[None, :]  # query - key position
            keep = torch.ones_like(gap, dtype=torch.bool)
            if self.window is not None:
                keep &= gap < self.window
                if not self.causal:
                    keep &= gap > -self.window
            if self.causal:
                keep &= gap >= 0
            scores = scores.masked_fill(~keep[None], float("-inf"))
        out = scores.softmax(-1) @ v.float()
        return out.to(q.dtype).transpose(0, 1).reshape(n, self.heads * self.head_dim)


def _draft_block(model, probe: dict) -> dict:
    """One draft block through vLLM's DFlash2 modules: fc, the context K/V with the math of
    `precompute_and_store_context_kv` through each layer's own modules (hidden_norm, qkv_proj, k_norm, rotary_emb;
    its fused CPU path differed by 5% in float32, docs/serving.md), the decoder layers (convolutions included) with the attention in torch, the final norm, the
    target head, top-K candidates (`compute_candidates`), the selector's edge scores, and the greedy path over
    them (the engine's own path walk lives in its V2 speculator, GPU only)."""
    import torch

    inner = model.model
    aux, block_ids = probe["aux_hidden"], probe["block_ids"].long()
    ctx_pos, blk_pos = probe["context_positions"].long(), probe["block_positions"].long()
    dtype = inner.norm.weight.dtype
    with torch.no_grad():
        ctx = inner.hidden_norm(model.combine_hidden_states(aux.to(dtype)))
        for layer in inner.layers:  # the context K/V of `precompute_and_store_context_kv`, layer by layer
            a = layer.self_attn
            qkv, _ = a.qkv_proj(ctx)
            _, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            k = a.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).reshape(k.shape)
            _, k = a.rotary_emb(ctx_pos, k.clone(), k)
            # the window and causality vLLM resolved for this layer (`_resolve_layer_attention`, 0.32
            # qwen3_dflash.py:120-180, kept on the module as `sliding_window` and `causal`)
            a.attn.forward = _TorchBlockAttention(a.attn, k.reshape(-1, a.num_kv_heads, a.head_dim),
                                                  v.reshape(-1, a.num_kv_heads, a.head_dim), (ctx_pos, blk_pos),
                                                  getattr(a, "sliding_window", None), bool(getattr(a, "causal", False)))
        hidden = model(input_ids=block_ids, positions=blk_pos)
        logits = model.compute_logits(hidden)[:, : model.config.vocab_size]
        slots = hidden[1:]
        candidates, unary = model.compute_candidates(slots)
        edges = inner.candidate_selector(candidates[None], unary[None], slots[None], block_ids[:1])[0]
        path, scores, prev = [], [], 0
        for slot in range(slots.shape[0]):
            row = edges[slot, prev]  # slot 0: every predecessor row is the anchor
            prev = int(row.argmax())
            path.append(int(candidates[slot, prev]))
            scores.append(row)
    return {"hidden": hidden.float(), "logits": logits.float(), "candidates": candidates,
            "unary": unary.float(), "path": torch.tensor(path), "path_scores": torch.stack(scores).float()}


class _Built(Exception):
    """A meta-device build is done once the module list is read."""


def _vllm_config(job: dict):
    """The VllmConfig the engine builds for the target, the drafter's speculative config attached after
    validation: its V1 runner refuses DFlash2 drafts (vLLM 0.32 config/vllm.py:2990-2991), which is about the
    runner, not the model. Returns (config, the draft's model config)."""
    from vllm.engine.arg_utils import EngineArgs

    base = dict(model=job["target"], skip_tokenizer_init=True, enforce_eager=True, seed=int(job.get("seed", 0)),
                max_model_len=int(job.get("max_model_len", 512)), dtype=job.get("dtype", "auto"))
    config = EngineArgs(**base).create_engine_config()
    spec_args = EngineArgs(**base, speculative_config={
        "method": "dflash", "model": job["drafter"], "num_speculative_tokens": int(job["num_speculative_tokens"])})
    spec = spec_args.create_speculative_config(config.model_config, config.parallel_config)
    config.speculative_config = spec
    return config, spec.draft_model_config


def _build(job: dict, config, draft, result: dict, at: list[str]):
    """A world of one on gloo, vLLM's class for the draft resolved and created (on the meta device with
    `job["meta"]`), its modules reported. Returns (model, loader, class); raises `_Built` for a meta build."""
    import tempfile

    import torch
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp(prefix='sq-dist-')}")
    initialize_model_parallel(1, 1)
    cls, arch = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    result["model_class"] = f"{cls.__module__}.{cls.__name__}"
    result["architecture"] = arch
    result["dflash_config"] = dict(getattr(draft.hf_config, "dflash_config", {}) or {})
    result["num_target_layers"] = config.model_config.get_total_num_hidden_layers()
    # the engine's own path for a draft model (BaseModelLoader.load_model, vLLM 0.32
    # model_loader/base_loader.py:63-110): create_model under the draft dtype, the default loader reading
    # the checkpoint's files into the model's own load_weights, then process_weights_after_loading
    loader = get_model_loader(config.load_config)
    at[0] = "build"
    # `meta`: the class built at a checkpoint's real shapes with no weights (a config folder is enough)
    with set_default_torch_dtype(draft.dtype), torch.device("meta" if job.get("meta") else "cpu"):
        model = loader.create_model(vllm_config=config, model_config=draft)
    result["modules"] = _module_schemes(model, result["num_target_layers"])
    result["dtype"] = str(draft.dtype).removeprefix("torch.")
    result["quant_config"] = type(model.model.quant_config).__name__ if model.model.quant_config else None
    result["parameters"] = sum(p.numel() for p in model.parameters())
    if job.get("meta"):
        result["meta"] = True
        raise _Built
    return model, loader, cls


def _load(job: dict, model, loader, draft, result: dict, at: list[str], t0: float) -> None:
    """Every tensor of the checkpoint through the model's own `load_weights` over sentinel-filled parameters:
    what it never wrote (borrowed from the target, optional, or missing) and what it wrote only in part; with a
    probe, the target's embedding and head copied in as the engine shares them with a DFlash draft."""
    import torch
    from safetensors import safe_open
    from vllm.utils.torch_utils import set_default_torch_dtype

    result["checkpoint_tensors"] = 0
    for f in Path(job["drafter"]).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            result["checkpoint_tensors"] += len(list(fh.keys()))
    _fill_sentinel(model)
    at[0] = "load"
    with set_default_torch_dtype(draft.dtype):
        loader.load_weights(model, draft)
    missing, partial = (sorted(_runtime_name(n, result["num_target_layers"]) for n in names)
                        for names in _unwritten(model))
    borrowed = [n for n in missing if n.endswith(("embed_tokens.weight", "lm_head.weight"))]
    # read from an optional mask_embedding.pt beside the checkpoint, unused without it (qwen3_dflash.py:929);
    # the attention's KV-cache quantization scales and zero points, created with any quant config and left
    # at their defaults when a checkpoint has no KV-cache scheme
    optional = [n for n in missing if n == "model.mask_embedding"
                or re.search(r"\.attn\.[qkv]_(scale|zero_point)$", n)]
    result["borrowed_from_target"], result["optional_unset"] = borrowed, optional
    result["unwritten"] = [n for n in missing if n not in borrowed + optional]
    result["partly_written"] = partial
    result["load_s"] = round(time.perf_counter() - t0, 3)
    if job.get("probe"):  # the target's embedding and head, as the engine shares them with a DFlash draft
        head = _target_head(job["target"], job["target_head"])
        with torch.no_grad():  # rows past the vocabulary are vLLM's padding: zero
            for key, param in (("embed_tokens", model.model.embed_tokens.weight),
                               ("lm_head", model.lm_head.weight)):
                param.data.zero_()
                param.data[: head[key].shape[0]].copy_(head[key].to(param.dtype))


def _kernels_and_probe(job: dict, model, draft, result: dict, at: list[str]) -> None:
    """vLLM's process_weights_after_loading (the kernel each quantized module gets, or why none), then with a
    probe one draft block through the modules (`_draft_block`), written to `job["probe_out"]`."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    at[0] = "kernels"
    try:
        process_weights_after_loading(model, draft, torch.device("cpu"))
    except Exception as exc:  # noqa: BLE001 - no kernel for a scheme on this platform: reported
        result["kernels_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    kernels = {name: getattr(getattr(m, "scheme", None), "kernel", None) for name, m in model.named_modules()}
    result["kernels"] = {_runtime_name(name, result["num_target_layers"]): type(k).__name__
                         for name, k in kernels.items() if k is not None}
    if job.get("probe") and "kernels_error" not in result:
        at[0] = "forward"
        out = _draft_block(model, load_file(job["probe"]))
        save_file({k: v.contiguous() for k, v in out.items()}, job["probe_out"])
        result["probe_out"] = job["probe_out"]


def run_load_probe(job: dict) -> dict:
    """Build vLLM's own DFlash2 model class for `job["drafter"]` beside `job["target"]` (a real VllmConfig, a
    world of one on gloo, CPU), run its `load_weights` over every tensor of the checkpoint, and report: tensors
    it refused, parameters it never wrote, each module's quant scheme, then (`job["probe"]`, a safetensors file
    of inputs) one draft block through its modules, written to `job["probe_out"]`. No engine is started."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    settle_logging()
    lines = LogLines()
    logging.getLogger("vllm").addHandler(lines)
    # the job as given, less the head's lookup (the project's own family facts, not a setting of the load)
    result: dict = {"ok": False, "kind": LOAD_PROBE, "name": job["name"],
                    "job": {k: v for k, v in job.items() if k != "target_head"}}
    t0 = time.perf_counter()
    at = ["config"]  # the step running: config, build, load, kernels or forward
    try:
        from vllm.config import set_current_vllm_config

        result["platform"] = platform_name()
        if result["platform"] == "cpu":
            register_cpu_emulation(result, job)
        config, draft = _vllm_config(job)
        with set_current_vllm_config(config):
            model, loader, cls = _build(job, config, draft, result, at)
            _load(job, model, loader, draft, result, at, t0)
            _kernels_and_probe(job, model, draft, result, at)
        result["no_engine"] = DFLASH2_NO_ENGINE.format(vllm=vllm.__version__, cls=cls.__name__)
        result["ok"] = True
    except _Built:  # a meta-device build: the module list is the result
        result["no_engine"] = f"built by vLLM {vllm.__version__}'s DFlash2 model class on the meta device, no weights"
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is reported in the result file
        record_error(result, exc)
        result["failed_at"] = at[0]
    finally:
        logging.getLogger("vllm").removeHandler(lines)
    return finish(result, lines, t0)
