"""The DFlash drafter: config, layers and its two forward paths (serving and calibration).

One model, two entry points sharing every layer:
- `draft_block(...)`: z-lab inference semantics - new context rows (target aux hidden states)
  are fused by `fc` + `hidden_norm` and injected as extra keys/values into every layer; the
  block `[bonus, <mask> x (block_size-1)]` attends to the cached context and to itself
  (non-causal); RoPE at absolute positions; the draft KV cache keeps only context rows.
- `forward(**batch)`: many anchored blocks of a cached sequence at once with a block mask, so
  calibration activations match serving (batches come from `pipeline.models.calibration`).

`embed_tokens` and `lm_head` belong to the target: they are attached at load time and never
saved (see `_keys_to_ignore_on_save`). Every projection is a plain `nn.Linear`, because
compressed-tensors compresses only exact `nn.Linear` modules.

The layers are transformers' Qwen3 pieces where the computation is the same (RMSNorm, MLP, the
attention's projections and norms, the rotary embedding, `rotate_half`, weight init); only the
KV-injection attention forward and the decoder layer around it are DFlash's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)
from transformers.utils import ModelOutput

from pipeline.models.layout import MODEL_TYPE


class DFlashConfig(PretrainedConfig):
    """Qwen3-style layer fields plus the DFlash fields.

    `aux_layer_ids` are in HF `output_hidden_states` index convention: index m is the output of
    target decoder layer m-1 (= speculators `aux_hidden_state_layer_ids` = z-lab
    `target_layer_ids` + 1).
    """

    model_type = MODEL_TYPE

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 1
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # DFlash fields
    block_size: int = 16
    mask_token_id: int | None = None
    aux_layer_ids: list[int] | None = None  # HF output_hidden_states indices
    target_hidden_size: int | None = None  # None = hidden_size
    num_target_layers: int | None = None
    verifier_name_or_path: str | None = None
    verifier_architectures: list[str] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]
        super().__post_init__(**kwargs)
        if not self.rope_parameters:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1e6}

    @property
    def aux_hidden_size(self) -> int:
        """Width of one target hidden state fed to `fc` (per aux layer)."""
        return self.target_hidden_size or self.hidden_size

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids or [])


AutoConfig.register(MODEL_TYPE, DFlashConfig)


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling of `config`, as `Qwen3RotaryEmbedding` computes them."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, D]."""
    # not apply_rotary_pos_emb: it rotates q and k with one cos/sin, but the queries here are the block rows only
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DraftKVCache:
    """Per-layer draft keys (after k_norm and RoPE) and values; holds context rows only."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]


class DFlashAttention(Qwen3Attention):
    """Qwen3's attention modules (q/k/v/o_proj, per-head q_norm/k_norm); DFlash's forward: queries from the
    block only, keys/values from [context rows | block rows] (KV injection), no causal mask."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def forward(self, x, ctx, rope_q, rope_kv, mask=None, cache=None):
        b, q_len, _ = x.shape
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, hd)).transpose(1, 2)
        q = apply_rope(q, *rope_q)
        # one projection over [context | block] rows, so calibration observers see what serving feeds
        kv_in = torch.cat([ctx, x], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, hd)).transpose(1, 2)
        k = apply_rope(k, *rope_kv)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        # SDPA itself, not transformers' sdpa_attention_forward: that one repeats K/V whenever a mask is given
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=self.num_key_value_groups > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """Qwen3DecoderLayer's modules, but its attention is DFlashAttention (which also takes the fused context)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, mask=None, cache=None):
        # the fused context is shared by all layers and is not normed again (z-lab semantics)
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DFlashOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    loss: torch.Tensor | None = None


class DFlashDrafter(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = ["DFlashDecoderLayer"]
    # the target's embedding and head are borrowed, never part of a drafter checkpoint
    _keys_to_ignore_on_save = ["embed_tokens.weight", "lm_head.weight"]
    _keys_to_ignore_on_load_missing = [r"embed_tokens\.weight", r"lm_head\.weight"]
    _supports_sdpa = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(config.num_aux_layers * config.aux_hidden_size, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # weights are initialised by PreTrainedModel._init_weights (normal Linear/Embedding, ones for norms, RoPE)
        self.post_init()

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary_emb.inv_freq

    def __setattr__(self, name, value):
        # `model.inv_freq = ...` (after a meta-device build or a dtype cast) sets the rotary embedding's
        # frequencies, `original_inv_freq` too (a property setter is bypassed when the value is a buffer)
        if name == "inv_freq" and "rotary_emb" in self.__dict__.get("_modules", {}):
            self.rotary_emb.inv_freq = value
            self.rotary_emb.original_inv_freq = value.clone()
        else:
            super().__setattr__(name, value)

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Borrow the target's embedding and lm_head (frozen; never saved)."""
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach().to(dev, dt), requires_grad=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach().to(dev, dt), requires_grad=False)

    def fuse_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, n_aux*H] or [B, S, n_aux, H] target hidden states -> fused context [B, S, H]."""
        if aux_hidden.dim() == 4:
            aux_hidden = aux_hidden.flatten(2)
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def _run_layers(self, x, ctx, rope_q, rope_kv, mask=None, cache=None):
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_kv, mask, cache)
        return self.norm(x)

    def draft_block(self, aux_hidden: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor,
                    cache: DraftKVCache | None = None) -> torch.Tensor:
        """Logits [B, block_size, V] for one block (z-lab inference semantics).

        aux_hidden: target aux hidden states of the NEW context rows (not yet in `cache`);
        block_ids: [B, block_size] = [bonus, mask, ...]; position_ids: [B, new_ctx + block_size],
        i.e. `len(cache) .. start + block_size - 1`. Afterwards `cache` holds the context rows only
        (the block's K/V are cropped away, as z-lab does with `crop(start)`).
        """
        ctx = self.fuse_context(aux_hidden)
        x = self.embed_tokens(block_ids)
        n_ctx = ctx.shape[1]
        cos, sin = self.rotary_emb(x, position_ids)
        rope_q = (cos[:, n_ctx:], sin[:, n_ctx:])
        start = (len(cache) if cache is not None else 0) + n_ctx
        hidden = self._run_layers(x, ctx, rope_q, (cos, sin), None, cache)
        if cache is not None:
            cache.crop(start)
        return self.lm_head(hidden)

    def new_cache(self) -> DraftKVCache:
        return DraftKVCache(self.config.num_hidden_layers)

    def forward(self, input_ids, hidden_states, position_ids, document_ids, anchor_positions, anchor_valid,
                loss_mask=None, **unused) -> DFlashOutput:
        """Calibration/training path: every anchored block of a packed sequence at once.

        Shapes (batch 1): input_ids/position_ids/document_ids/loss_mask [1, T]; hidden_states
        [1, T, n_aux, H] or [1, T, n_aux*H]; anchor_positions/anchor_valid [1, A] (or [A]).
        Returns logits [1, A*block_size, V]; block j occupies rows j*block_size ...
        """
        from pipeline.models.calibration import block_attention_mask, block_layout

        anchors = anchor_positions.reshape(-1)
        bs = self.config.block_size
        block_ids, block_pos = block_layout(input_ids[0], position_ids[0], anchors, bs, self.config.mask_token_id)
        ctx = self.fuse_context(hidden_states)
        x = self.embed_tokens(block_ids[None])
        cos_c, sin_c = self.rotary_emb(x, position_ids)
        cos_q, sin_q = self.rotary_emb(x, block_pos[None])
        rope_kv = (torch.cat([cos_c, cos_q], 1), torch.cat([sin_c, sin_q], 1))
        mask = block_attention_mask(document_ids[0], anchors, bs)
        hidden = self._run_layers(x, ctx, (cos_q, sin_q), rope_kv, mask[None, None].to(x.device))
        return DFlashOutput(logits=self.lm_head(hidden), hidden_states=hidden)
