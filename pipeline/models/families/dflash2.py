"""DFlash2 (z-lab's DFlash2, speculators `dflash2`): DFlash plus grouped dynamic convolutions and a candidate selector.

The same config and model classes as DFlash (`pipeline.models.dflash`: the four `layout.DFLASH2_FIELDS` set), read
and written in the same three layouts (`layout.py`, `formats.py`: z-lab `DFlash2DraftModel`, speculators `dflash2`).
What differs, and is answered here: detection, the validator (DFlash's, then the convolution's and the selector's
fields), the Linears kept dense (every `kernel_projection`, the selector's `hidden_projection`), AWQ refused, the
vLLM ranges with a DFlash2 model class, the Linears vLLM builds for it, and serve-check's load-and-probe (no engine
here runs a DFlash2 drafter: docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.models import layout
from pipeline.models.families.base import Shapes, field, num_draft_layers, register
from pipeline.models.families.dflash import DFlash, validate_dflash_config
from pipeline.models.fields import get as _get
from pipeline.models.fields import is_int as _is_int
from pipeline.models.fields import rows as _rows
from pipeline.models.targets import text_config

CONVS = ("attention_conv", "mlp_conv")
SELECTOR_PROJECTION = "candidate_selector.hidden_projection"  # vLLM's name adds `model.`


@dataclass(frozen=True)
class Range:
    """DFlash2's facts in one vLLM range (a `pipeline.serving.profiles.Profile`, keyed by its name in `RANGES`)."""

    # the first release of the range that builds vLLM's DFlash2 model from a speculators `dflash2` checkpoint (None:
    # no release of the range has a DFlash2 model class)
    first: str | None
    # `kernel_projection`: some release of the range builds it with the draft's quant config (so it is dense only
    # where `ignore` names it); the releases before build it dense whatever the checkpoint says
    conv_draft_quant: bool
    # the wheel file:line of each DFlash2 rule of the range (the class, `kernel_projection`, `hidden_projection`)
    cites: dict[str, str]


RANGES: dict[str, Range] = {
    "0.26": Range(None, False, {"dflash2": "no model_executor/models/qwen3_dflash2.py in 0.26.0; 0.28.0 adds it"}),
    "0.28-0.31": Range("0.29.0", True, {
        "dflash2": "0.29.0 transformers_utils/configs/speculators/algos.py:133-154, base.py:137-138 "
                   "(speculators `dflash2` read; 0.28.0 has no such reader)",
        "kernel_projection": "0.28.0-0.30.0 model_executor/models/qwen3_dflash2.py:69-77 (quant_config=None: "
                             "always dense); 0.31.0 :194-202, :258 (the draft's quant config, "
                             "qwen3_dflash.py:428, :470: dense only where ignored)",
        "hidden_projection": "0.28.0 model_executor/models/qwen3_dflash2.py:206-214, 0.31.0 :332-340 "
                             "(quant_config=None: always dense)"}),
    "0.32+": Range("0.32.0", True, {
        "dflash2": "0.32.0 transformers_utils/configs/speculators/algos.py:129-130, base.py:135; 0.34.0 "
                   "algos.py:97-98, base.py:135 (speculators `dflash2` read)",
        "kernel_projection": "0.32.0 model_executor/models/qwen3_dflash2.py:194-202, :258; 0.34.0 :195-203, "
                             ":259 (the draft's quant config, qwen3_dflash.py:464, :512: dense only where "
                             "ignored)",
        "hidden_projection": "0.32.0 model_executor/models/qwen3_dflash2.py:332-340, 0.34.0 :481-489 "
                             "(quant_config=None: always dense)"}),
}


def validate_dflash2_config(cfg, tensors: Shapes | None = None) -> None:
    """A DFlash2 drafter: DFlash's checks, then its convolution (group size vs the hidden size, taps vs the block
    size) and candidate selector (rank, top-K vs the vocabulary), against each other and the tensors."""
    validate_dflash_config(cfg, tensors)
    err = bad_value
    h, bs, vocab = _get(cfg, "hidden_size"), _get(cfg, "block_size"), _get(cfg, "vocab_size")
    taps, group = _get(cfg, "conv_kernel_size"), _get(cfg, "conv_group_size")
    rank, top_k = _get(cfg, "selector_rank"), _get(cfg, "selector_top_k")
    if not _is_int(group) or group < 1 or h % group:
        raise err("drafter.conv_group_size", group, f"it does not divide the drafter's hidden size {h} (the "
                  "convolution shares one dynamic coefficient per group of channels)",
                  f"use a conv_group_size that divides {h}")
    if not _is_int(taps) or not 1 <= taps <= bs:
        raise err("drafter.conv_kernel_size", taps, f"the convolution runs inside one {bs}-token block, so "
                  f"it needs between 1 and block_size={bs} taps", "use a drafter exported with a valid "
                  "conv_kernel_size (DFlash2 uses 2)")
    if not _is_int(rank) or rank < 1:
        raise err("drafter.selector_rank", rank, "the candidate selector needs a positive rank",
                  "use a drafter exported with its selector_rank (DFlash2 uses 256)")
    if not _is_int(top_k) or not 1 <= top_k <= vocab:
        raise err("drafter.selector_top_k", top_k, f"the selector keeps the top-K candidates of the "
                  f"{vocab}-token vocabulary, so K must be between 1 and {vocab}",
                  f"set selector_top_k to at most {vocab} (the value the drafter was trained with)")
    if tensors is None:
        return
    base = tensors.get("layers.0.attention_conv.base_kernel")
    if base and len(base) == 3 and base[1] != taps:
        raise err("drafter.conv_kernel_size", taps, f"the checkpoint's convolution kernels have {base[1]} taps "
                  f"(layers.0.attention_conv.base_kernel is {list(base)})", f"set conv_kernel_size to {base[1]}")
    rows = _rows(tensors, "layers.0.attention_conv.kernel_projection.weight")
    if rows is not None and rows != 2 * taps * (h // group):
        groups = rows // (2 * taps) if rows % (2 * taps) == 0 else None
        right = f"set conv_group_size to {h // groups}" if groups and h % groups == 0 else \
            "use the config the drafter was exported with"
        raise err("drafter.conv_group_size", group, f"the checkpoint's convolutions make {groups or '?'} dynamic "
                  f"coefficients per tap, not hidden_size / conv_group_size = {h // group}", right)
    rows = _rows(tensors, "candidate_selector.hidden_projection.weight")
    if rows is not None and rows != rank:
        raise err("drafter.selector_rank", rank, f"the checkpoint's selector projects to rank {rows}",
                  f"set selector_rank to {rows}")
    for book in ("predecessor_codebook", "successor_codebook"):
        shape = tensors.get(f"candidate_selector.{book}") or tensors.get(f"candidate_selector.{book}.weight")
        if shape and shape[0] != vocab:
            raise err("drafter.vocab_size", vocab, f"the checkpoint's selector codebooks have {shape[0]} rows "
                      "(one per token)", "use the config the drafter was exported with")


class DFlash2(DFlash):
    """DFlash2: DFlash's layers with a `GroupedDynamicConv` around every sublayer and a `CandidateSelector`."""

    name = "dflash2"
    card_name = "DFlash2"
    vllm_method = "dflash"  # vLLM picks its DFlash2 class from the checkpoint's config
    serve_mode = "load-and-probe"
    head_trim_refusal = "whose candidate selector reads the target's whole head"
    outer_linears = ("fc", SELECTOR_PROJECTION)
    # a range where `is_causal: false` decides keeps every layer's own window, served non-causally as written
    # (0.32.0 model_executor/models/qwen3_dflash.py:86-97, :120-180; a mix of sliding and full layers needs the V2
    # runner, :153-161, which DFlash2 forces); z-lab's Qwen3.8-27B-DFlash2
    own_windows = True

    def detects(self, config: Any) -> bool:
        """speculators `dflash2`, z-lab `DFlash2DraftModel`, or any DFlash2 field set (top level or z-lab's
        `dflash_config`)."""
        if field(config, "speculators_model_type") == "dflash2" or \
                "DFlash2DraftModel" in (field(config, "architectures") or []):
            return True
        inner = field(config, "dflash_config") or {}
        return any(field(config, k) is not None or inner.get(k) is not None for k in layout.DFLASH2_FIELDS)

    def validate(self, config: Any, tensors: Shapes | None = None) -> None:
        validate_dflash2_config(config, tensors)

    def check_target(self, config: Any, target_config: Any) -> None:
        """The selector's top-K within the target's vocabulary (its own fields: `validate_dflash2_config`)."""
        top_k = field(config, "selector_top_k")
        if top_k is None:
            return
        v_t = field(target_config, "vocab_size")
        if v_t is None:  # a multimodal target keeps it in its text config
            v_t = field(text_config(target_config), "vocab_size")
        if not 1 <= top_k <= v_t:
            raise bad_value("drafter.selector_top_k", top_k, f"the selector keeps the top-K candidates of the target's "
                            f"{v_t}-token vocabulary, so K must be between 1 and {v_t}",
                            "use a drafter whose selector_top_k fits this target's vocabulary")

    def dense_linears(self, config) -> list[str]:
        """Every convolution's `kernel_projection` (its per-row kernel coefficients; vLLM 0.31+ builds it with the
        draft's quant config unless ignored) and the candidate selector's `hidden_projection` (vLLM builds it
        dense), by exact HF name (`contract.serving_ignore` writes each under vLLM's name as well). The base
        kernels and codebooks are Parameters, never touched by a recipe (it targets Linear)."""
        names = []
        if field(config, "conv_kernel_size") is not None:
            names += [f"layers.{i}.{conv}.kernel_projection" for i in range(num_draft_layers(config))
                      for conv in CONVS]
        if field(config, "selector_rank") is not None:
            names.append(SELECTOR_PROJECTION)
        return names

    def check_settings(self, q, config, field_name: str) -> None:
        """AWQ's smoothing of gate/up folds a scale into `post_attention_layernorm`, whose output also feeds the MLP
        convolution's `kernel_projection` (its per-row coefficients), which nothing would compensate."""
        if field(config, "conv_kernel_size") is not None and q.algorithm == "awq":
            raise bad_value(f"{field_name}.algorithm", q.algorithm, "AWQ's smoothing scale folded into "
                            "post_attention_layernorm would also scale the input of a DFlash2 drafter's "
                            "mlp_conv.kernel_projection, changing its convolution coefficients",
                            f"use {field_name}.algorithm=gptq (e.g. quant=w4a16-gptq)")

    def check_notes(self, config) -> dict[str, Any]:
        """With a candidate selector the drafter drafts the selector's path: the check's top-1 compares it."""
        return {"top1_of": "candidate_selector path"} if field(config, "selector_rank") is not None else {}

    def range_facts(self, prof) -> Range:
        """DFlash2's facts in the vLLM range `prof` (`RANGES[prof.name]`); a range without them is a programming
        error named here (a new `Profile` adds its DFlash2 facts to `RANGES`)."""
        if prof.name not in RANGES:
            raise KeyError(f"vLLM range {prof.name!r} has no DFlash2 facts: add them to RANGES in "
                           "pipeline/models/families/dflash2.py")
        return RANGES[prof.name]

    def served_versions(self, prof) -> str:
        """The releases of the range `prof` that serve a speculators DFlash2 checkpoint, in words."""
        first = self.range_facts(prof).first
        if first is None:
            return "none"
        if prof.open_ended:
            return f"{first} and newer (read in {first}-{prof.last})"
        return f"{first}-{prof.last}"

    def refuse_profile(self, prof, field_name: str) -> None:
        """A range without a DFlash2 model class (`RANGES[...].first` None: 0.26)."""
        if self.range_facts(prof).first is None:
            raise bad_value(f"{field_name}.vllm", prof.name, f"vLLM {prof.versions} has no DFlash2 model class "
                            f"({self.range_cites(prof)['dflash2']}), so it cannot serve this DFlash2 drafter",
                            f"write it for vLLM 0.29 and newer with {field_name}.vllm=0.28-0.31 or 0.32+")

    def profile_problems(self, prof) -> list[str]:
        """A range without a DFlash2 model class, in `contract.checkpoint_problems`' words."""
        if self.range_facts(prof).first is None:
            return [f"it is a DFlash2 drafter and vLLM {prof.versions} has no DFlash2 model class "
                    f"({self.range_cites(prof)['dflash2']})"]
        return []

    def range_cites(self, prof) -> dict[str, str]:
        """The range's DFlash2 citations (`RANGES[...].cites`: the class, `kernel_projection`,
        `hidden_projection`)."""
        return self.range_facts(prof).cites

    def vllm_record(self, prof) -> dict[str, Any]:
        """The range's record with the releases that build vLLM's DFlash2 class (`<name>_versions`) and the DFlash2
        rules beside the range's own."""
        out = prof.record()
        out.update({f"{self.name}_versions": self.served_versions(prof),
                    "rules": {**prof.cites, **self.range_cites(prof)}})
        return out

    def recorded_versions(self, record: dict[str, Any]) -> str | None:
        """The releases of the range that build vLLM's DFlash2 class (`served_versions`, as `vllm_record` wrote
        them)."""
        return record.get(f"{self.name}_versions")

    def vllm_layer_linears(self, config: Any, prefix: str) -> list[str]:
        """DFlash's, then the layer's two convolution kernel projections (vLLM's `qwen3_dflash2.py` names)."""
        conv = [f"{prefix}.{c}.kernel_projection" for c in CONVS] if field(config, "conv_kernel_size") is not None \
            else []
        return super().vllm_layer_linears(config, prefix) + conv

    def vllm_extra_linears(self, config: Any) -> list[str]:
        """The candidate selector's hidden projection."""
        return [f"model.{SELECTOR_PROJECTION}"] if field(config, "selector_rank") is not None else []

    def vllm_quantized_linears(self, config: Any, num_target_layers: int, prof) -> list[str]:
        """`hidden_projection` is built without a quant config in every release; `kernel_projection` with the
        draft's from 0.31 (`RANGES[...].conv_draft_quant`: some release of the range does)."""
        conv_quant = self.range_facts(prof).conv_draft_quant
        return [n for n in self.vllm_linears(config, num_target_layers)
                if not n.endswith(".hidden_projection")
                and (conv_quant or not n.endswith(".kernel_projection"))]

    def vllm_parameters(self, config: Any, num_target_layers: int) -> list[str]:
        """Each convolution's `base_kernel`, then the selector's two codebooks."""
        names = [f"model.layers.{i + num_target_layers}.{side}.base_kernel" for i in range(num_draft_layers(config))
                 for side in CONVS] if field(config, "conv_kernel_size") is not None else []
        if field(config, "selector_rank") is not None:
            names += [f"model.candidate_selector.{book}_codebook" for book in ("predecessor", "successor")]
        return names

    def card_lines(self) -> list[str]:
        return ["- DFlash2: every convolution's `kernel_projection` and the candidate selector's `hidden_projection` "
                "stay dense (`config.json`'s `ignore` names each under specquant's and vLLM's module names); the "
                "convolutions' `base_kernel` and the selector's codebooks are not Linear layers and are stored "
                "unquantized"]


DFLASH2 = register(DFlash2())
