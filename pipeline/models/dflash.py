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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
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


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm, computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        dim = config.head_dim
        base = float(params.get("rope_theta", 1e6))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, D]."""
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


class DFlashAttention(nn.Module):
    """Queries from the block only; keys/values from [context rows | block rows] (KV injection)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, mask=None, cache=None, layer_idx=0):
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
            k, v = cache.update(layer_idx, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd**-0.5,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, mask=None, cache=None):
        # the fused context is shared by all layers and is not normed again (z-lab semantics)
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask, cache, self.layer_idx)
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
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.post_init()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        if module is self and hasattr(self, "inv_freq"):
            self.inv_freq.copy_(rope_inv_freq(self.config)[0])

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def attach_target_weights(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Borrow the target's embedding and lm_head (frozen; never saved)."""
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach().to(dev, dt), requires_grad=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach().to(dev, dt), requires_grad=False)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype):
        angle = position_ids[..., None].float() * self.inv_freq.float().to(position_ids.device)
        emb = torch.cat([angle, angle], dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

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
        cos, sin = self.rope(position_ids, x.dtype)
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
        cos_c, sin_c = self.rope(position_ids, x.dtype)
        cos_q, sin_q = self.rope(block_pos[None], x.dtype)
        rope_kv = (torch.cat([cos_c, cos_q], 1), torch.cat([sin_c, sin_q], 1))
        mask = block_attention_mask(document_ids[0], anchors, bs)
        hidden = self._run_layers(x, ctx, (cos_q, sin_q), rope_kv, mask[None, None].to(x.device))
        return DFlashOutput(logits=self.lm_head(hidden), hidden_states=hidden)
