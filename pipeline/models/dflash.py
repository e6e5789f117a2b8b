"""The DFlash drafter: config, layers and its two forward paths (serving and calibration).

One model, two entry points sharing every layer:
- `draft_block(...)`: z-lab inference semantics - new context rows (target aux hidden states)
  are fused by `fc` + `hidden_norm` and injected as extra keys/values into every layer; the
  block `[bonus, <mask> x (block_size-1)]` attends to the cached context and to itself
  (non-causal); RoPE at absolute positions; the draft KV cache keeps only context rows.
- `forward(**batch)`: many anchored blocks of a cached sequence at once with a block mask, so
  calibration activations match serving (batches come from `pipeline.models.calibration`).

A `sliding_attention` layer (config `layer_types`, `sliding_window`) narrows both paths' masks to vLLM's window for
a non-causal draft layer (`DFlashDrafter.layer_masks`); full-attention layers keep exactly the mask they had.

`embed_tokens` and `lm_head` belong to the target: they are attached at load time and never
saved (see `_keys_to_ignore_on_save`). Every projection is a plain `nn.Linear`, because
compressed-tensors compresses only exact `nn.Linear` modules.

The layers are transformers' Qwen3 pieces where the computation is the same (RMSNorm, MLP, the
attention's projections and norms, the rotary embedding, `rotate_half`, weight init); only the
KV-injection attention forward and the decoder layer around it are DFlash's own.

DFlash2 is the same model family with two additions, built only where the config sets their fields
(`DFLASH2_FIELDS`): a grouped dynamic depthwise convolution (`GroupedDynamicConv`) before and after
every attention and MLP sublayer, causal within each block, and a `CandidateSelector` that keeps the
top-K target-head candidates per draft slot and walks the best path with a low-rank pairwise score
(`draft_path`). With the fields unset the model, its state dict and its config are DFlash's. Those two layers
are in `pipeline.models.dflash2_layers` (imported here, so importable from this module as before).
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

from pipeline.core.errors import bad_value
from pipeline.models.dflash2_layers import CandidateSelector, GroupedDynamicConv, SelectorPath
from pipeline.models.layout import DFLASH2_FIELDS, MODEL_TYPE


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
    # a vocabulary-trimmed head (None: the target's head is borrowed): the drafter's own `lm_head` has this many
    # rows and `d2t` maps them to target ids (pipeline.models.draft_vocab)
    draft_vocab_size: int | None = None
    # DFlash2 fields (None: a DFlash drafter; see DFLASH2_FIELDS)
    conv_kernel_size: int | None = None  # taps of the grouped dynamic convolution
    conv_group_size: int | None = None  # hidden channels sharing one dynamic coefficient
    selector_rank: int | None = None
    selector_top_k: int | None = None

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
    def rotary_dim(self) -> int:
        """Dimensions of a head that RoPE rotates: `rope_parameters.rope_dim`, else `partial_rotary_factor` x
        head_dim (1 = the whole head), as vLLM builds the draft's rotary embedding (0.26
        `layers/rotary_embedding/__init__.py:66-72`, from `qwen3_dflash.py:195-199`); transformers' Qwen3 ignores both."""
        rp = self.rope_parameters or {}
        if rp.get("rope_dim"):
            return int(rp["rope_dim"])
        return int(self.head_dim * float(rp.get("partial_rotary_factor", 1.0)))

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids or [])

    @property
    def has_conv(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def has_selector(self) -> bool:
        return self.selector_rank is not None

    @property
    def is_dflash2(self) -> bool:
        return self.has_conv or self.has_selector

    @property
    def has_draft_vocab(self) -> bool:
        """The drafter ships its own trimmed head (`draft_vocab_size` rows) and `d2t`, not the target's head."""
        return self.draft_vocab_size is not None and int(self.draft_vocab_size) != int(self.vocab_size)

    def to_dict(self) -> dict:
        # a DFlash config serialises as before: the DFlash2 fields appear only when set
        d = super().to_dict()
        for key in (*DFLASH2_FIELDS, "draft_vocab_size"):
            if d.get(key) is None:
                d.pop(key, None)
        return d


AutoConfig.register(MODEL_TYPE, DFlashConfig)

SLIDING = "sliding_attention"  # the `layer_types` entry of a sliding-window layer (transformers, vLLM)


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling of `config`, as `Qwen3RotaryEmbedding` computes them."""
    rope_type = config.rope_parameters["rope_type"]
    rd = config.rotary_dim
    if rd != config.head_dim:  # partial rotary: frequencies over the rotated dimensions only (vLLM's cos/sin cache)
        if rope_type != "default" or not 0 < rd <= config.head_dim or rd % 2:
            raise bad_value("drafter rope_parameters", dict(config.rope_parameters),
                            f"a partial rotary embedding of {rd} of {config.head_dim} dimensions is supported for "
                            "rope_type 'default' only", "use the default RoPE or rotate the whole head")
        base = float(config.rope_parameters["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)), 1.0
    if rope_type == "default":
        return Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]; cos/sin [B, S, R] with R <= D: the first R dimensions rotate (neox style, as vLLM's
    partial rotary embedding), the rest pass through."""
    # not apply_rotary_pos_emb: it rotates q and k with one cos/sin, but the queries here are the block rows only
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos.unsqueeze(1) + rotate_half(rot) * sin.unsqueeze(1), rest), dim=-1)


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
    """Qwen3DecoderLayer's modules, but its attention is DFlashAttention (which also takes the fused context);
    a DFlash2 layer adds `attention_conv` and `mlp_conv` around its two sublayers."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.has_conv:
            taps, group = int(config.conv_kernel_size), int(config.conv_group_size)
            self.attention_conv = GroupedDynamicConv(config.hidden_size, taps, group)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, taps, group)

    def forward(self, x, ctx, rope_q, rope_kv, mask=None, cache=None, block=None):
        # the fused context is shared by all layers and is not normed again (z-lab semantics)
        if "attention_conv" not in self._modules:
            x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask, cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        # DFlash2: the block rows are convolved before each sublayer (the context rows are not) and after it,
        # the output side with coefficients computed from the sublayer's normed input
        h, dynamic = self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_q, rope_kv, mask, cache), dynamic, block)
        h, dynamic = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(h), dynamic, block)


@dataclass
class DFlashOutput(ModelOutput):
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    # DFlash2 with a candidate selector, forward(select=True): per block row the token the selector's greedy path
    # drafts there (row 0 of each block: its bonus token), [1, A*block_size]; None otherwise
    selected: torch.Tensor | None = None


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
        if config.has_draft_vocab:  # its own head of the kept ids; target id = draft id + d2t[draft id]
            self.lm_head = nn.Linear(h, int(config.draft_vocab_size), bias=False)
            self.register_buffer("d2t", torch.zeros(int(config.draft_vocab_size), dtype=torch.long))
        else:
            self.lm_head = nn.Linear(h, config.vocab_size, bias=False)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if config.has_selector:
            self.candidate_selector = CandidateSelector(config)
        # weights are initialised by PreTrainedModel._init_weights (normal Linear/Embedding, ones for norms, RoPE)
        self.post_init()
        if config.rotary_dim != config.head_dim:  # transformers' Qwen3 RoPE rotates the whole head
            self.inv_freq = rope_inv_freq(config)[0]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        # DFlash2's own Parameters (children are initialised first, so these win over the Linear's normal init):
        # a convolution starts as the identity (DFlash's layer), the codebooks as normal(initializer_range)
        if isinstance(module, GroupedDynamicConv):
            module.base_kernel.zero_()
            module.base_kernel[:, 0].fill_(1.0)
            module.kernel_projection.weight.zero_()
        elif isinstance(module, CandidateSelector):
            module.predecessor_codebook.normal_(0.0, self.config.initializer_range)
            module.successor_codebook.normal_(0.0, self.config.initializer_range)

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
        """Borrow the target's embedding and lm_head (frozen; never saved). A drafter with its own trimmed
        head (`config.has_draft_vocab`) borrows the embedding only."""
        dev, dt = self.fc.weight.device, self.fc.weight.dtype
        self.embed_tokens.weight = nn.Parameter(embed_weight.detach().to(dev, dt), requires_grad=False)
        if not self.config.has_draft_vocab:
            self.lm_head.weight = nn.Parameter(lm_head_weight.detach().to(dev, dt), requires_grad=False)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., vocab_size]. A trimmed head's `draft_vocab_size` logits are
        placed at their target ids (draft id + d2t) and every other id is -inf, as vLLM's `compute_logits` does."""
        logits = self.lm_head(hidden)
        if not self.config.has_draft_vocab:
            return logits
        ids = torch.arange(logits.shape[-1], device=logits.device) + self.d2t.to(logits.device)
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., ids] = logits
        return full

    def fuse_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, S, n_aux*H] or [B, S, n_aux, H] target hidden states -> fused context [B, S, H]."""
        if aux_hidden.dim() == 4:
            aux_hidden = aux_hidden.flatten(2)
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def _run_layers(self, x, ctx, rope_q, rope_kv, mask=None, cache=None, block=None, positions=None):
        """`positions` (query positions [B, Q], key positions [B, K]) lets sliding-window layers narrow `mask`
        (`layer_masks`); full-attention layers get `mask` itself."""
        masks = self.layer_masks(mask, *positions) if positions is not None else [mask] * len(self.layers)
        for layer, layer_mask in zip(self.layers, masks, strict=True):
            x = layer(x, ctx, rope_q, rope_kv, layer_mask, cache) if block is None else \
                layer(x, ctx, rope_q, rope_kv, layer_mask, cache, block)
        return self.norm(x)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention), from `layer_types` and `sliding_window`."""
        kinds = self.config.layer_types or ["full_attention"] * len(self.layers)
        return [int(self.config.sliding_window) if kind == SLIDING else None for kind in kinds]

    def layer_masks(self, mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor) -> list:
        """The attention mask of every layer: `mask` (None or bool [B|1, 1, Q, K], True = may attend) for a
        full-attention layer, unchanged, so full layers compute exactly what they did before windows existed;
        for a sliding-window layer of window w, `mask` and |q_pos - k_pos| < w (positions [B, Q] and [B, K]).

        The window is vLLM's for a non-causal DFlash draft layer: FlashAttention keeps `(sliding_window - 1, 0)`
        (vllm 0.32 v1/attention/backends/flash_attn.py:1079-1082) and makes it symmetric, `(w - 1, w - 1)`, when
        the attention is non-causal (`_maybe_symmetrize_window`, flash_attn.py:581-592, used at :661 and :1315);
        the draft layers get their window and `causal=False` from `_resolve_layer_attention`
        (models/qwen3_dflash.py:86-97, :120-180; a DFlash2 drafter is written `is_causal: false`). So a query at
        position p sees keys at positions p - w < k < p + w: the last w positions including its own, and the
        block rows after it within w. A window that hides nothing leaves `mask` as it is (bit-identical output).
        """
        out, cache = [], {}
        for window in self.layer_windows():
            if window is None:
                out.append(mask)
                continue
            if window not in cache:
                near = (q_pos[:, :, None] - k_pos[:, None, :]).abs() < window  # [B, Q, K]
                if bool(near.all()):
                    cache[window] = mask
                else:
                    near = near[:, None].to(q_pos.device)
                    cache[window] = near if mask is None else mask.to(near.device) & near
            out.append(cache[window])
        return out

    def draft_block(self, aux_hidden: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor,
                    cache: DraftKVCache | None = None) -> torch.Tensor:
        """Logits [B, block_size, V] for one block (z-lab inference semantics).

        aux_hidden: target aux hidden states of the NEW context rows (not yet in `cache`);
        block_ids: [B, block_size] = [bonus, mask, ...]; position_ids: [B, new_ctx + block_size],
        i.e. `len(cache) .. start + block_size - 1`. Afterwards `cache` holds the context rows only
        (the block's K/V are cropped away, as z-lab does with `crop(start)`).
        """
        return self.head_logits(self.draft_hidden(aux_hidden, block_ids, position_ids, cache))

    def draft_path(self, aux_hidden: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor,
                   cache: DraftKVCache | None = None) -> SelectorPath:
        """DFlash2: the candidate selector's greedy path over the block's draft slots (rows 1..), from its
        bonus token; arguments and cache as `draft_block`."""
        hidden = self.draft_hidden(aux_hidden, block_ids, position_ids, cache)[:, 1:]
        return self.candidate_selector.select(hidden, self.head_logits(hidden), block_ids[:, 0])

    def draft_hidden(self, aux_hidden: torch.Tensor, block_ids: torch.Tensor, position_ids: torch.Tensor,
                     cache: DraftKVCache | None = None) -> torch.Tensor:
        """The block's final-normed hidden states [B, block_size, H] (`draft_block` without the head)."""
        ctx = self.fuse_context(aux_hidden)
        x = self.embed_tokens(block_ids)
        n_ctx = ctx.shape[1]
        cos, sin = self.rotary_emb(x, position_ids)
        rope_q = (cos[:, n_ctx:], sin[:, n_ctx:])
        cached = len(cache) if cache is not None else 0
        start = cached + n_ctx
        positions = None
        if any(w is not None for w in self.layer_windows()):  # the cache holds positions 0 .. cached - 1
            before = torch.arange(cached, device=position_ids.device).expand(position_ids.shape[0], -1)
            positions = (position_ids[:, n_ctx:], torch.cat([before, position_ids], 1))
        hidden = self._run_layers(x, ctx, rope_q, (cos, sin), None, cache,
                                  x.shape[1] if self.config.has_conv else None, positions)
        if cache is not None:
            cache.crop(start)
        return hidden

    def new_cache(self) -> DraftKVCache:
        return DraftKVCache(self.config.num_hidden_layers)

    def forward(self, input_ids, hidden_states, position_ids, document_ids, anchor_positions, anchor_valid,
                loss_mask=None, select: bool = False, **unused) -> DFlashOutput:
        """Calibration/training path: every anchored block of a packed sequence at once.

        `select` (DFlash2 with a candidate selector; ignored otherwise): also the selector's greedy path through
        every block (`select_blocks`, in `selected`). Calibration leaves it off: the selector reads the head's
        logits and the final hidden states, after every quantized layer, so it changes no calibration statistic.

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
        positions = None
        if any(w is not None for w in self.layer_windows()):  # keys: the context rows, then the block rows
            positions = (block_pos[None], torch.cat([position_ids.reshape(1, -1), block_pos[None]], 1))
        hidden = self._run_layers(x, ctx, (cos_q, sin_q), rope_kv, mask[None, None].to(x.device),
                                  block=bs if self.config.has_conv else None, positions=positions)
        logits = self.head_logits(hidden)
        if not (select and self.config.has_selector):
            return DFlashOutput(logits=logits, hidden_states=hidden)
        return DFlashOutput(logits=logits, hidden_states=hidden, selected=self.select_blocks(hidden, logits, block_ids))

    def select_blocks(self, hidden: torch.Tensor, logits: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """DFlash2: the candidate selector's greedy path through every anchored block of `forward` (hidden
        [1, A*bs, H], logits [1, A*bs, V], block_ids [A*bs]) -> [1, A*bs] token ids, each block's row 0 its
        bonus token and rows 1.. the path, as `draft_path` drafts one block when serving."""
        bs = self.config.block_size
        rows = hidden.reshape(-1, bs, hidden.shape[-1])
        anchors = block_ids.reshape(-1, bs)[:, 0]
        path = self.candidate_selector.select(rows[:, 1:], logits.reshape(-1, bs, logits.shape[-1])[:, 1:], anchors)
        return torch.cat([anchors[:, None], path.tokens], 1).reshape(1, -1)
