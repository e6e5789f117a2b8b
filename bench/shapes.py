"""Random-weight models of real shapes (Qwen3-8B target, DFlash-b16 drafter; the hybrid Qwen3.8-27B
target, `Qwen3_5ForCausalLM`, with a DFlash drafter at its width), a word-level tokenizer of the
target's vocabulary size, and a synthetic token blend in the data stage's format.

Weights are drawn on the device from one seeded generator (seconds, even at 8B), so two
machines of the same kind build bit-identical checkpoints from the same seed.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QWEN3_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|MASK|>": 151669}
# Qwen3.8-27B (248,320 ids): the mask id is the one tests/test_serve_dflash2.py assumes (ASSUMED["mask_token_id"]);
# endoftext / im_start / im_end are ASSUMED ids below it (not read from the real tokenizer). Only their being
# inside the vocabulary and distinct matters to the random-weight bench.
QWEN38_SPECIALS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|MASK|>": 248077}


def qwen38_27b_target_config(hidden: int = 5120, vocab: int = 248320, layers: int = 64) -> dict:
    """Qwen3.8-27B's text tower as a config.json dict (the single source: tests/test_serve_dflash2.py's
    `_qwen38_27b` writes the same dict): Gated DeltaNet + full attention 3:1, 24 / 4 heads of 256."""
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": hidden,
            "vocab_size": vocab, "num_hidden_layers": layers,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 48, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
            "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 1e7, "rope_type": "default"}}


QWEN38_27B_TARGET = qwen38_27b_target_config()


@dataclass(frozen=True)
class Shapes:
    """Everything that differs between the real-scale run and the CPU smoke test."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_target_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    drafter_layers: int
    block_size: int
    zlab_layer_ids: tuple[int, ...]  # z-lab target_layer_ids (HF output_hidden_states index - 1)
    specials: tuple[tuple[str, int], ...]
    name: str = "qwen3-8b"
    # a hybrid (qwen3_5_text) target: its whole config.json dict (hidden/vocab/layers/heads above agree with it);
    # None: a dense Qwen3 target built from the fields above
    hybrid_target: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # the drafter's attention / MLP shape where it differs from the target's (None: the target's)
    drafter_heads: int | None = None
    drafter_kv_heads: int | None = None
    drafter_head_dim: int | None = None
    drafter_intermediate: int | None = None

    @property
    def mask_token_id(self) -> int:
        return dict(self.specials)["<|MASK|>"]

    @property
    def hybrid(self) -> bool:
        return self.hybrid_target is not None

    @property
    def target_architecture(self) -> str:
        return "Qwen3_5ForCausalLM" if self.hybrid else "Qwen3ForCausalLM"


def hybrid_shapes(name: str, target: dict, drafter_layers: int, block_size: int, zlab_layer_ids: tuple[int, ...],
                  specials: dict[str, int], drafter_heads: int, drafter_kv_heads: int, drafter_head_dim: int,
                  drafter_intermediate: int) -> Shapes:
    """Shapes of a hybrid target given as its config.json dict (the scalar fields are read from it)."""
    return Shapes(vocab_size=target["vocab_size"], hidden_size=target["hidden_size"],
                  intermediate_size=target["intermediate_size"], num_target_layers=target["num_hidden_layers"],
                  num_heads=target["num_attention_heads"], num_kv_heads=target["num_key_value_heads"],
                  head_dim=target["head_dim"], drafter_layers=drafter_layers, block_size=block_size,
                  zlab_layer_ids=zlab_layer_ids, specials=tuple(specials.items()), name=name, hybrid_target=target,
                  drafter_heads=drafter_heads, drafter_kv_heads=drafter_kv_heads, drafter_head_dim=drafter_head_dim,
                  drafter_intermediate=drafter_intermediate)


QWEN3_8B = Shapes(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_target_layers=36,
                  num_heads=32, num_kv_heads=8, head_dim=128, drafter_layers=5, block_size=16,
                  zlab_layer_ids=(1, 9, 17, 25, 33), specials=tuple(QWEN3_SPECIALS.items()))
TINY = Shapes(vocab_size=512, hidden_size=128, intermediate_size=256, num_target_layers=8,
              num_heads=4, num_kv_heads=2, head_dim=32, drafter_layers=2, block_size=16,
              zlab_layer_ids=(1, 2, 3, 4, 5),
              specials=(("<|endoftext|>", 500), ("<|im_start|>", 501), ("<|im_end|>", 502), ("<|MASK|>", 503)),
              name="tiny")
# Qwen3.8-27B's text tower with a DFlash b16 drafter of 5 layers at its width. The aux layers are z-lab's
# DFlash2 drafter's target_layer_ids for Qwen3.8-27B (tests/test_serve_dflash2.py QWEN38); the DFlash drafter of
# Qwen3.8-27B is ASSUMED to use the same ids. Drafter heads / intermediate: the ASSUMED ones of that test.
QWEN38_27B = hybrid_shapes("qwen3.8-27b", QWEN38_27B_TARGET, drafter_layers=5, block_size=16,
                           zlab_layer_ids=(5, 19, 33, 47, 61), specials=QWEN38_SPECIALS, drafter_heads=32,
                           drafter_kv_heads=8, drafter_head_dim=128, drafter_intermediate=17408)
# the CPU smoke test of the hybrid path: 3 Gated DeltaNet + 1 attention layer, small linear-attention heads
TINY_HYBRID_TARGET = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 128, "vocab_size": 512,
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_value_head_dim": 32, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "dtype": "bfloat16",
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 1e7, "rope_type": "default"}}
TINY_HYBRID = hybrid_shapes("tiny-hybrid", TINY_HYBRID_TARGET, drafter_layers=2, block_size=16,
                            zlab_layer_ids=(0, 1, 2), specials=dict(TINY.specials), drafter_heads=4,
                            drafter_kv_heads=2, drafter_head_dim=32, drafter_intermediate=256)
SHAPES = {"qwen3-8b": QWEN3_8B, "tiny": TINY, "qwen3.8-27b": QWEN38_27B, "tiny-hybrid": TINY_HYBRID}


def target_config(s: Shapes):
    """The target's HF config: Qwen3Config, or Qwen3_5TextConfig from a hybrid shape's config dict."""
    sp = dict(s.specials)
    if s.hybrid:
        from transformers import Qwen3_5TextConfig

        kw = {k: v for k, v in s.hybrid_target.items() if k not in ("architectures", "model_type")}
        cfg = Qwen3_5TextConfig(**kw, bos_token_id=sp["<|endoftext|>"], eos_token_id=sp["<|im_end|>"],
                                pad_token_id=sp["<|endoftext|>"])
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        return cfg
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_target_layers, num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=sp["<|endoftext|>"], eos_token_id=sp["<|im_end|>"], pad_token_id=sp["<|endoftext|>"],
        dtype="bfloat16",
    )


# norms computing x * (1 + weight): their identity weight is 0, not 1
ZERO_CENTERED_NORMS = ("Qwen3_5RMSNorm", "Qwen3NextRMSNorm")


def seeded_init_(model, seed: int, std: float = 0.02) -> None:
    """Norm weights at identity (1, or 0 for a zero-centered norm), every other parameter N(0, std), from
    one generator on the weights' device. A Gated DeltaNet layer's 1-D `A_log` is drawn as transformers
    initialises it (log U(0.01, 16), from the same generator) and its `dt_bias` is 1. A dense model draws
    exactly what it drew before the hybrid family was added (same checkpoints from the same seed)."""
    import torch

    zero = {id(m.weight) for m in model.modules() if type(m).__name__ in ZERO_CENTERED_NORMS}
    params = list(model.named_parameters())
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            if p.dim() == 1 and name.endswith("A_log"):
                p.uniform_(0.01, 16.0, generator=gen).log_()
            elif p.dim() == 1:
                p.fill_(0.0 if id(p) in zero else 1.0)
            else:
                p.normal_(0.0, std, generator=gen)


def build_tokenizer(s: Shapes, out_dir: Path) -> None:
    """A word-level tokenizer with exactly `vocab_size` ids and the Qwen3 special tokens at their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = dict(s.specials)
    by_id = {i: t for t, i in special.items()}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(s.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=by_id[min(by_id)]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|MASK|>"])
    # a ChatML-like template, so the evaluate stage's rendering (and serve-check's) works on it
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    fast.save_pretrained(str(out_dir))


def target_class(s: Shapes):
    import transformers

    return getattr(transformers, s.target_architecture)


def build_target(s: Shapes, out_dir: Path, device: str, seed: int) -> dict:
    """Qwen3ForCausalLM (or, for a hybrid shape, Qwen3_5ForCausalLM) of shape `s`, random bf16 weights,
    saved with its tokenizer.

    The model is built on `device` in bf16 directly (default dtype bf16 under `torch.device`: no fp32
    copy, no host copy: Qwen3.8-27B's 54 GB live on the GPU only); save_pretrained writes 5 GB
    safetensors shards, moving one shard at a time through host memory."""
    import torch

    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = target_class(s)(target_config(s))
    finally:
        torch.set_default_dtype(torch.float32)
    model.to(torch.bfloat16)  # anything a constructor made in fp32 explicitly (a no-op otherwise)
    seeded_init_(model, seed)
    _sync(device)
    t_init = time.perf_counter() - t0
    model.config.architectures = [s.target_architecture]
    model.save_pretrained(str(out_dir), max_shard_size="5GB")
    build_tokenizer(s, out_dir)
    t_save = time.perf_counter() - t0 - t_init
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    _empty(device)
    return {"shape": s.name, "architecture": s.target_architecture, "params": n, "param_bytes": nbytes,
            "init_s": round(t_init, 2), "save_s": round(t_save, 2), "bytes": dir_bytes(out_dir)}


def build_drafter(s: Shapes, out_dir: Path, target_dir: Path, device: str, seed: int) -> dict:
    """DFlash drafter of shape `s` (helper B's model code), random weights, speculators format."""
    import torch

    from pipeline.models.dflash import DFlashConfig, DFlashDrafter
    from pipeline.models.formats import save_speculators

    t0 = time.perf_counter()
    cfg = drafter_config(DFlashConfig, s)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            drafter = DFlashDrafter(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    drafter.to(torch.bfloat16)
    seeded_init_(drafter, seed + 1)
    _sync(device)
    t_init = time.perf_counter() - t0
    save_speculators(drafter, str(out_dir), verifier=str(target_dir), verifier_architectures=[s.target_architecture])
    n = sum(p.numel() for p in drafter.parameters())
    del drafter
    _empty(device)
    return {"shape": s.name, "params": n, "init_s": round(t_init, 2), "save_s": round(time.perf_counter() - t0 - t_init, 2),
            "bytes": dir_bytes(out_dir)}


def drafter_config(config_cls, s: Shapes):
    """DFlashConfig of shape `s`; aux layers in HF output_hidden_states convention (z-lab ids + 1)."""
    sp = dict(s.specials)
    return config_cls(
        vocab_size=s.vocab_size, hidden_size=s.hidden_size,
        intermediate_size=s.drafter_intermediate or s.intermediate_size, num_hidden_layers=s.drafter_layers, num_attention_heads=s.drafter_heads or s.num_heads,
        num_key_value_heads=s.drafter_kv_heads or s.num_kv_heads, head_dim=s.drafter_head_dim or s.head_dim,
        max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        block_size=s.block_size, aux_layer_ids=[i + 1 for i in s.zlab_layer_ids],
        num_target_layers=s.num_target_layers, mask_token_id=s.mask_token_id,
        target_hidden_size=s.hidden_size, eos_token_id=sp["<|im_end|>"], pad_token_id=sp["<|endoftext|>"],
    )


def write_blend(s: Shapes, data_dir: Path, tokenizer_dir: Path, num_samples: int, seq_len: int,
                seed: int) -> dict:
    """A synthetic 3-source blend (chat/math/code token distributions), every sample `seq_len` long.

    Each sample is a prompt (loss 0) followed by an assistant answer (loss 1), the way chat-templated
    calibration data looks; fixed lengths make tokens/s comparable with the stock extraction.
    """
    import numpy as np

    from pipeline.artifacts import samples as samples_file

    rng = np.random.default_rng(seed)
    sources = ("chat", "math", "code")
    words = s.vocab_size - 512 if s.vocab_size > 4096 else min(s.specials, key=lambda x: x[1])[1]

    def rows():
        for i in range(num_samples):
            src = sources[i % 3]
            lo = {"chat": 0, "math": words // 3, "code": 2 * words // 3}[src]
            ids = rng.integers(lo, lo + words // 3, size=seq_len).tolist()
            prompt = int(rng.integers(seq_len // 8, seq_len // 2))
            yield {"id": f"{src}/{i // 3}", "source": src, "input_ids": ids,
                   "loss_mask": [0] * prompt + [1] * (seq_len - prompt)}

    from transformers import AutoTokenizer

    from pipeline.stages.data import tokenizer_hashes

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kept = {x: sum(1 for i in range(num_samples) if sources[i % 3] == x) for x in sources}
    counts = {x: samples_file.SourceCounts(requested=kept[x], available=kept[x], examined=kept[x], kept=kept[x],
                                           dropped={}, dropped_examples={}, location="synthetic", revision=None,
                                           format="synthetic", weight=1.0) for x in sources}
    meta = samples_file.write(
        data_dir, rows(), counts, seed=seed, max_seq_len=seq_len,
        tokenizer=samples_file.TokenizerRecord(name_or_path=str(tokenizer_dir), revision=None,
                                               **tokenizer_hashes(tokenizer_dir), vocab_size=len(tok)),
        sources=[samples_file.SourceRecord(name=x, path=None, hub_id=None, revision=None, split="train",
                                           format="synthetic", weight=1.0) for x in sources],
        blend_name="synthetic-blend")
    n_tok, n_loss = meta.num_tokens, meta.num_loss_tokens
    return {"num_samples": num_samples, "num_tokens": n_tok, "num_loss_tokens": n_loss}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _empty(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
