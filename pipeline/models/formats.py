"""DFlash checkpoint formats: z-lab, speculators and native (ours), and the layer-id convention.

Layer ids (the one-off between formats, made explicit here):
- our `DFlashConfig.aux_layer_ids` and speculators `aux_hidden_state_layer_ids` are HF
  `output_hidden_states` indices: m = output of target decoder layer m-1;
- z-lab `dflash_config.target_layer_ids` are decoder-layer indices: l = output of layer l
  (z-lab reads `hidden_states[l + 1]`), so m = l + 1.
vLLM (after vllm#40727) maps speculators ids back with `target_layer_ids = [m - 1]`, which
agrees with this convention. We always write speculators ids as HF indices.

Weights: both formats store the same body keys (`fc`, `hidden_norm`, `layers.*`, `norm`);
neither stores the target's `embed_tokens` / `lm_head`, which `load_drafter` attaches. A drafter with a
vocabulary-trimmed head (config `draft_vocab_size` < `vocab_size`, `pipeline.models.draft_vocab`) stores its own
`lm_head.weight` [draft_vocab_size, hidden] and `d2t` and borrows only `embed_tokens` (`borrowed_keys`).

DFlash2 adds `layers.*.{attention,mlp}_conv.{base_kernel,kernel_projection.weight}` and
`candidate_selector.{hidden_projection.weight,predecessor_codebook,successor_codebook}`. The codebooks are
written bare (what vLLM and speculators read); a z-lab `save_pretrained` writes them with `.weight`
(its codebooks are nn.Embedding), which `read_tensors` accepts and renames (`bare_codebook_keys`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from pipeline.core.errors import bad_value
from pipeline.core.io import atomic_write_bytes, atomic_write_json, read_json
from pipeline.models import layout
from pipeline.models.dflash import DFlashConfig, DFlashDrafter, rope_inv_freq

FORMATS = layout.FORMATS
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout we write (fixture B)
TARGET_KEYS = ("embed_tokens.weight", "lm_head.weight")
CODEBOOK_KEYS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
LAYER_FIELDS = layout.LAYER_FIELDS
zlab_to_hf_ids, hf_to_zlab_ids, detect_format = layout.zlab_to_hf_ids, layout.hf_to_zlab_ids, layout.detect_format


def borrowed_keys(cfg: DFlashConfig) -> tuple[str, ...]:
    """The target's tensors a drafter borrows (never stored): both, or only the embedding for a trimmed head."""
    return ("embed_tokens.weight",) if cfg.has_draft_vocab else TARGET_KEYS


def _dtype_name(cfg: DFlashConfig) -> str:
    dt = cfg.dtype
    return str(dt).removeprefix("torch.") if dt is not None else "float32"


def _layer_dict(cfg: DFlashConfig) -> dict:
    d = {k: getattr(cfg, k) for k in LAYER_FIELDS}
    if d["max_window_layers"] is None:
        d["max_window_layers"] = cfg.num_hidden_layers
    d.update(model_type="qwen3", use_cache=True, dtype=_dtype_name(cfg))
    return d


def zlab_config_dict(cfg: DFlashConfig) -> dict:
    """config.json in z-lab layout (transformers 4.57 rope keys, which z-lab's code reads).

    DFlash2 is written as z-lab's DFlash2 code writes it (transformers 5 `rope_parameters`, every draft field
    inside `dflash_config`, a top-level `is_causal: false`: the block attends to itself both ways)."""
    d = _layer_dict(cfg)
    if cfg.is_dflash2:
        d["rope_parameters"] = dict(cfg.rope_parameters)
        d.update(architectures=["DFlash2DraftModel"], is_causal=False, num_target_layers=cfg.num_target_layers,
                 dflash_config={"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                                **{k: getattr(cfg, k) for k in layout.DFLASH2_FIELDS},
                                "target_layer_ids": hf_to_zlab_ids(cfg.aux_layer_ids or [])})
        return d
    if cfg.has_draft_vocab:  # vLLM reads it from the draft's HF config (qwen3_dflash.py DFlashQwen3ForCausalLM)
        d["draft_vocab_size"] = int(cfg.draft_vocab_size)
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta", 1e6)
    d.update(rope_theta=theta, rope_scaling=None if rope.get("rope_type", "default") == "default" else rope)
    d.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
             block_size=cfg.block_size, num_target_layers=cfg.num_target_layers,
             dflash_config={"mask_token_id": cfg.mask_token_id,
                            "target_layer_ids": hf_to_zlab_ids(cfg.aux_layer_ids or [])})
    return d


def speculators_config_dict(cfg: DFlashConfig, quantization_config: dict | None = None) -> dict:
    """config.json in speculators 0.9.0 layout with every field vLLM's speculators parser reads.

    vLLM builds the draft's HF config from `transformer_layer_config` plus the dflash updater
    (`aux_hidden_state_layer_ids`, `mask_token_id`, `draft_vocab_size`, `target_hidden_size`,
    `sliding_window_non_causal`) and reads `speculators_config.proposal_methods[0].speculative_tokens`
    and `speculators_config.verifier.name_or_path`. Top-level keys outside that list are dropped, so a
    `quantization_config` is written both at top level and inside `transformer_layer_config`.
    """
    if not cfg.verifier_name_or_path:
        raise bad_value("verifier", cfg.verifier_name_or_path, "a speculators checkpoint must name its verifier "
                        "(target)", "pass the target's path or Hub id as the verifier")
    sliding = [i for i, t in enumerate(cfg.layer_types or []) if t != "full_attention"]
    if sliding and not cfg.is_dflash2:  # vLLM 0.26 applies one causality flag to every draft layer
        # (pipeline.serving.contract); DFlash2 is served from vLLM 0.28 on, where `is_causal` decides
        raise bad_value("drafter.layer_types", list(cfg.layer_types), f"layers {sliding} are sliding-window "
                        "layers and vLLM 0.26 would serve every layer with one causality flag, not as trained",
                        "use a drafter whose layers are all full_attention")
    tlc = _layer_dict(cfg)
    tlc["rope_parameters"] = dict(cfg.rope_parameters)
    tlc["num_target_layers"] = cfg.num_target_layers  # not read by vLLM; keeps z-lab round trips lossless
    d = {
        "architectures": ["DFlashDraftModel"],  # what speculators 0.9.0 writes; vLLM sets it itself anyway
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids or []),
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "draft_vocab_size": int(cfg.draft_vocab_size) if cfg.has_draft_vocab else cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "sample_from_anchor": False,
        # vLLM 0.26 sets causal = not this flag for EVERY layer; DFlash layers are non-causal
        "sliding_window_non_causal": True,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(cfg),
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": cfg.verifier_name_or_path,
                         "architectures": list(cfg.verifier_architectures or ["Qwen3ForCausalLM"])},
        },
        "transformer_layer_config": tlc,
    }
    if cfg.is_dflash2:
        # speculators >= 0.8 `dflash2`: the conv/selector fields flat at top level (vLLM reads them from 0.29)
        d.update(architectures=["DFlash2DraftModel"], speculators_model_type="dflash2",
                 **{k: getattr(cfg, k) for k in layout.DFLASH2_FIELDS})
        d["speculators_config"]["algorithm"] = "dflash2"
    if quantization_config is not None:
        d["quantization_config"] = quantization_config
        tlc["quantization_config"] = quantization_config
    return d


def load_drafter_config(path: str | Path, fmt: str = "auto") -> DFlashConfig:
    """Read a z-lab, speculators or native drafter config.json as a `DFlashConfig`."""
    found, kw = layout.drafter_kwargs(path, fmt)
    cfg = DFlashConfig.from_dict(kw) if found == "native" else DFlashConfig(**kw)
    cfg.name_or_path = str(path)
    return cfg


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise bad_value("drafter.path", str(path), "it holds no *.safetensors weights",
                        "point it at a complete drafter checkpoint")
    return files


def read_tensors(path: Path, keys: set[str] | None = None, field: str = "drafter.path", *,
                 skip: tuple[str, ...] = (), device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors of every *.safetensors file in `path` (only `keys` if given, never a key ending in `skip`).

    With `device` (not CPU) each tensor goes straight to that device, a bounded slice at a time, so the
    host never holds more than one slice (an 8B target's embedding is 1.2 GB); with `dtype`, floating
    tensors are cast there, one tensor at a time (what `Module.to(dtype=...)` does to the whole model)."""
    out: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if (keys is None or k in keys) and not (skip and k.endswith(skip)):
                        t = _read_one(fh, k, device)
                        out[bare_codebook_key(k)] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on truncated files
            raise bad_value(field, str(f), f"the safetensors file is unreadable ({str(exc).splitlines()[0]})",
                            "re-download or re-save the checkpoint") from None
    return out


def bare_codebook_key(key: str) -> str:
    """`candidate_selector.*_codebook.weight` (a z-lab save_pretrained) -> the bare name every format stores."""
    stem = key.removesuffix(".weight")
    return stem if stem in CODEBOOK_KEYS else key


READ_SLICE_BYTES = 64 << 20  # host bytes in flight per tensor when reading to an accelerator


def _read_one(fh, key: str, device: str | torch.device | None) -> torch.Tensor:
    if device is None or torch.device(device).type == "cpu":
        return fh.get_tensor(key)  # mapped from the file, not copied
    return read_sliced(fh, key, device)


def read_sliced(fh, key: str, device: str | torch.device) -> torch.Tensor:
    """Tensor `key` of an open safetensors file on `device`, copied over READ_SLICE_BYTES of rows at a time."""
    sl = fh.get_slice(key)
    shape = list(sl.get_shape())
    first = sl[0:1] if shape and shape[0] > 1 else None
    if first is None or first.numel() == 0:
        return fh.get_tensor(key).to(device)
    rows = max(1, READ_SLICE_BYTES // (first.numel() * first.element_size()))
    if rows >= shape[0]:
        return fh.get_tensor(key).to(device)
    out = torch.empty(shape, dtype=first.dtype, device=device)
    for i in range(0, shape[0], rows):
        out[i:i + rows].copy_(sl[i:i + rows])  # the same bytes, one slice of rows at a time
    return out


def target_head_weights(target: Any, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens, lm_head) weights from a loaded HF causal LM or a local checkpoint directory
    (read from a directory straight to `device` and cast there to `dtype`, see `read_tensors`)."""
    if isinstance(target, torch.nn.Module):
        return target.get_input_embeddings().weight, target.get_output_embeddings().weight
    p = Path(target)
    cfg = read_json(p / "config.json", "target.path") if (p / "config.json").is_file() else {}
    from pipeline.models.targets import tensor_names, text_config

    want = tensor_names(cfg)
    names = {want["embed"], want["lm_head"]}
    if not p.is_dir():
        raise bad_value("target.path", str(target), "it is not a local directory",
                        "download the target first or pass a loaded model")
    from pipeline.core.loading import check_shard_index

    check_shard_index(p, "target.path")  # a missing shard is named, not mistaken for a missing tensor
    t = read_tensors(p, names, field="target.path", device=device)
    if want["embed"] not in t:
        raise bad_value("target.path", str(target), f"its weights have no `{want['embed']}`",
                        "point it at a Qwen3-style causal LM checkpoint (or a Qwen3.5 multimodal one)")
    embed = t[want["embed"]]
    head = t.get(want["lm_head"])
    if head is None:
        if not (cfg.get("tie_word_embeddings") or text_config(cfg).get("tie_word_embeddings", False)):
            raise bad_value("target.path", str(target), f"its weights have no `{want['lm_head']}`",
                            "point it at a complete causal LM checkpoint")
        head = embed
    if dtype is not None:  # each cast on its own, as Module.to casts each parameter (a tied pair stays
        embed, head = embed.to(dtype), head.to(dtype)  # one tensor where the cast is a no-op)
    return embed, head


def resolve_verifier(cfg: DFlashConfig, drafter_path: str | Path) -> Path | None:
    """The verifier as a local dir: relative to the drafter directory first, then to the CWD."""
    name = cfg.verifier_name_or_path
    if not name:
        return None
    for cand in (Path(drafter_path) / name, Path(name)):
        if (cand / "config.json").is_file():
            return cand
    return None


def check_tensors(cfg: DFlashConfig, state: dict[str, torch.Tensor], path: str) -> None:
    """Refuse weights whose names or shapes do not match the config (before anything is built)."""
    borrowed = borrowed_keys(cfg)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in DFlashDrafter(cfg).state_dict().items() if k not in borrowed}
    got = {k for k in state if k not in borrowed}
    missing, extra = sorted(expected.keys() - got), sorted(got - expected.keys())
    if missing or extra:
        raise bad_value("drafter.path", path, f"its weights do not match its config (missing {missing[:3]}, "
                        f"unexpected {extra[:3]})", "re-export the checkpoint or fix its config.json")
    for k in sorted(got):
        if state[k].shape != expected[k]:
            raise bad_value("drafter.path", path, f"tensor {k} has shape {tuple(state[k].shape)} but the config "
                            f"implies {tuple(expected[k])}", "fix config.json or the weights")
    if cfg.has_draft_vocab:
        check_d2t(cfg, state["d2t"], path)


def check_d2t(cfg: DFlashConfig, d2t: torch.Tensor, path: str) -> None:
    """`d2t` must map the trimmed head's rows to distinct target ids in increasing order, inside the vocabulary."""
    if d2t.dtype != torch.int64:
        raise bad_value("drafter.path", path, f"its d2t is {str(d2t.dtype).removeprefix('torch.')}, not int64",
                        "re-export it with `python -m pipeline convert --draft-vocab N`")
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or bool((ids.diff() <= 0).any())):
        raise bad_value("drafter.path", path, f"its d2t does not map the {d2t.numel()} head rows to distinct, "
                        f"increasing target ids below {cfg.vocab_size}",
                        "re-export it with `python -m pipeline convert --draft-vocab N`")


def load_drafter(path: str | Path, target: Any = None, fmt: str = "auto",
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load a drafter in any format and attach the target's embed_tokens/lm_head.

    target: a loaded HF causal LM, a local target directory, or None to use the verifier named
    in a speculators config (resolved relative to the drafter directory, then the CWD).
    """
    cfg = load_drafter_config(path, fmt)
    if target is None:
        target = resolve_verifier(cfg, path)
        if target is None:
            raise bad_value("target", None, f"the drafter at {path} needs its target's embed_tokens and lm_head "
                            "and no verifier directory could be found", "pass target=<target dir or model>")
    if not isinstance(target, torch.nn.Module) and Path(target).is_dir():
        from pipeline.core.loading import check_shard_index

        check_shard_index(Path(target), "target.path")  # before any weight is read
    dtype = dtype or (cfg.dtype if isinstance(cfg.dtype, torch.dtype) else torch.float32)
    # every tensor read straight to `device` and cast there, one at a time: the host never holds the
    # drafter or the target's embedding/head whole (nor a float32 copy of them); a bf16 -> fp32 cast
    # is exact, and `model.to` below finds everything in place (the same values as casting the model)
    borrowed = borrowed_keys(cfg)  # a trimmed head is the drafter's own (read, cast like every other weight)
    state = read_tensors(Path(path), skip=borrowed, device=device, dtype=dtype)
    state = {k: v for k, v in state.items() if k not in borrowed}
    check_tensors(cfg, state, str(path))
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    embed, head = target_head_weights(target, device=device, dtype=dtype) if not isinstance(target, torch.nn.Module) \
        else (w.detach() for w in target_head_weights(target))  # new tensors, the same storage: the cast
    # below (`model.to(dtype)`) then replaces the drafter's parameters, never the loaded target's own
    want = (cfg.vocab_size, cfg.hidden_size)
    if tuple(embed.shape) != want or tuple(head.shape) != want:
        raise bad_value("target", str(getattr(target, "name_or_path", target)), f"its embed_tokens/lm_head are "
                        f"{tuple(embed.shape)}/{tuple(head.shape)} but the drafter needs {want}",
                        "use the target the drafter was trained for (see pipeline.models.compat)")
    state["embed_tokens.weight"] = embed
    if not cfg.has_draft_vocab:
        state["lm_head.weight"] = head
    model.load_state_dict(state, assign=True, strict=True)
    model.inv_freq = rope_inv_freq(cfg)[0]  # the meta-device buffer, recomputed for real
    for p in (model.embed_tokens.weight, model.lm_head.weight):  # a trimmed head is frozen too (the target's rows)
        p.requires_grad_(False)
    model = model.to(device=device, dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    return model.eval()


def drafter_state(model: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's own tensors (no embed_tokens / lm_head), contiguous, on CPU."""
    borrowed = borrowed_keys(model.config)
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()
            if k not in borrowed and k != "inv_freq"}


def write_checkpoint(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path,
                     borrowed: tuple[str, ...] = TARGET_KEYS) -> Path:
    """Atomically write model.safetensors (drafter tensors only: never the `borrowed` target tensors) and
    config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in sorted(state.items()) if k not in borrowed}
    atomic_write_bytes(out / "model.safetensors", st_save(state, metadata={"format": "pt"}))
    atomic_write_json(out / "config.json", config)
    return out


def _write(model: DFlashDrafter, out_dir: str | Path, config: dict) -> Path:
    return write_checkpoint(drafter_state(model), config, out_dir, borrowed_keys(model.config))


def save_zlab(model: DFlashDrafter, out_dir: str | Path) -> Path:
    return _write(model, out_dir, zlab_config_dict(model.config))


def save_speculators(model: DFlashDrafter, out_dir: str | Path, verifier: str | None = None,
                     verifier_architectures: list[str] | None = None) -> Path:
    """speculators layout; `verifier` (name_or_path) overrides the one in the config."""
    cfg = model.config
    if verifier is not None:
        cfg.verifier_name_or_path = str(verifier)
    if verifier_architectures is not None:
        cfg.verifier_architectures = list(verifier_architectures)
    return _write(model, out_dir, speculators_config_dict(cfg))


def native_config_dict(cfg: DFlashConfig) -> dict:
    """Our own layout (model_type specquant_dflash): what AutoConfig / llm-compressor re-read."""
    d = cfg.to_dict()
    d["architectures"] = ["DFlashDrafter"]
    d.pop("_name_or_path", None)
    return json.loads(json.dumps(d, default=str))


def save_native(model: DFlashDrafter, out_dir: str | Path) -> Path:
    return _write(model, out_dir, native_config_dict(model.config))


def config_dict_for(cfg: DFlashConfig, fmt: str) -> dict:
    if fmt == "zlab":
        return zlab_config_dict(cfg)
    if fmt == "speculators":
        return speculators_config_dict(cfg)
    if fmt == "native":
        return native_config_dict(cfg)
    raise bad_value("format", fmt, "unknown drafter format", f"use one of {', '.join(FORMATS)}")
