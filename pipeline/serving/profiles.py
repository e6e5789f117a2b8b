"""The vLLM ranges specquant writes drafter checkpoints for: one `Profile` per supported range (`PROFILES`, newest
last; `DEFAULT` = the newest), its flags and the wheel file:line each is pinned to (`cites`). A drafter family's own
facts per range (the first release with its vLLM class, its rules and their citations) live in its module, keyed
by the profile's `name` (`pipeline.models.families`: DFlash2's `RANGES`), not here.

A range is judged by its strictest member: a checkpoint written for 0.28-0.31 must load in 0.28 (dense q/k/v) and in
0.30 (no actorder group). A new vLLM version is one edit here: widen a profile's `last`, or add a `Profile` with its
own citations. What the flags mean for a checkpoint, and the rules that read them, are
`pipeline.serving.contract`'s (which re-exports these names: callers use `contract.PROFILES`, `contract.profile`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.core.errors import bad_value


@dataclass(frozen=True)
class Profile:
    """What every vLLM release from `first` to `last` reads from a DFlash drafter checkpoint; `cites` holds,
    per rule, the wheel file:line it is pinned to."""

    name: str  # the value of quant.vllm
    first: str  # oldest release of the range
    last: str  # newest release the range was read in (the range stays open when `open_ended`)
    open_ended: bool  # newer releases are expected to read the same (the newest range)
    quantized_qkv: bool  # every release of the range serves a quantized qkv_proj
    shared_qkv_scale: bool  # NVFP4 q/k/v must carry one weight and one input global scale (vLLM keeps the max)
    split_shards: bool  # ignore matching splits a fused layer into its shards (0.26); else the fused name only
    reads_is_causal: bool  # every release of the range lets transformer_layer_config.is_causal decide causality
    refused_actorder: tuple[str, ...]  # compressed-tensors weight actorder values some release refuses
    hub_id_verifier: bool  # some release needs a Hub-id verifier for `vllm serve <drafter dir>`
    nvfp4_hopper_kernel: str  # what runs NVFP4 weights on Hopper (weight-only)
    cites: dict[str, str] = field(default_factory=dict)

    @property
    def versions(self) -> str:
        """The range in words, e.g. `0.32.0 and newer (read in 0.32.0-0.34.0)`."""
        if self.open_ended:
            return f"{self.first} and newer (read in {self.first}-{self.last})"
        return self.first if self.first == self.last else f"{self.first}-{self.last}"

    def record(self) -> dict[str, Any]:
        """What a stage record, the manifest and the card say about the range a checkpoint is written for (a drafter
        family adds its own releases and rules: `DrafterFamily.vllm_record`)."""
        return {"profile": self.name, "versions": self.versions, "first": self.first, "last": self.last,
                "open_ended": self.open_ended, "quantized_qkv": self.quantized_qkv,
                "is_causal_written": self.reads_is_causal, "rules": dict(self.cites)}


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("0.26", "0.26.0", "0.26.0", False, quantized_qkv=False, shared_qkv_scale=True, split_shards=True,
            reads_is_causal=False, refused_actorder=(), hub_id_verifier=False, nvfp4_hopper_kernel="Marlin",
            cites={
                "dense_qkv": "0.26.0 model_executor/models/qwen3_dflash.py:441 (context-KV precompute slices "
                             "qkv_proj.weight; vLLM #51581)",
                "ignore_matching": "0.26.0 layers/quantization/compressed_tensors/utils.py:50-103, :175-192",
                "causality": "0.26.0 transformers_utils/configs/speculators/algos.py:124-125, "
                             "model_executor/models/qwen3_dflash.py:55-59",
                "verifier": "0.26.0 transformers_utils/config.py:682-683 (taken verbatim, relative to the cwd)",
                "nvfp4_hopper": "0.26.0 model_executor/kernels/linear/__init__.py:446-460 (Marlin, weight-only)",
                "fp8": "0.26.0 layers/quantization/compressed_tensors/compressed_tensors.py:526-560, :826-832 "
                       "(CompressedTensorsW8A8Fp8: tensor/channel/block weights, static tensor or dynamic "
                       "activations; sm89+, else W8A16 :834-838), schemes/compressed_tensors_w8a8_fp8.py:194 "
                       "(a fused layer serves at the max() of its shards' input_scale)",
                "fp8_qkv": "0.26.0 model_executor/models/qwen3_dflash.py:441 (the context-KV precompute slices "
                           "qkv_proj.weight into a plain F.linear: an FP8 weight fails on a dtype mismatch, vLLM "
                           "#51581)"}),
    Profile("0.28-0.31", "0.28.0", "0.31.0", False, quantized_qkv=False, shared_qkv_scale=True, split_shards=True,
            reads_is_causal=True, refused_actorder=("group", "dynamic"), hub_id_verifier=False,
            nvfp4_hopper_kernel="Marlin",
            cites={
                "dense_qkv": "0.28.0 model_executor/models/qwen3_dflash.py:490, 0.30.0 :473 (slice a dense "
                             "qkv_proj.weight); 0.31.0 :515-519, :607 runs a quantized one through its kernel",
                "is_causal": "0.28.0 model_executor/models/qwen3_dflash.py:58-67 (is_causal first, then "
                             "dflash_config.causal)",
                "actorder": "0.30.0 layers/quantization/compressed_tensors/compressed_tensors.py:332-341 "
                            "(group/dynamic refused; 0.28-0.29 read them)",
                "ignore_matching": "0.28.0 layers/quantization/compressed_tensors/utils.py:50-103, :175-192 (shards "
                                   "split; 0.31.0 :53 reads the fused name first)",
                "verifier": "0.28.0 transformers_utils/config.py:681-682, 0.31.0 :843-844 (taken verbatim)"}),
    Profile("0.32+", "0.32.0", "0.34.0", True, quantized_qkv=True, shared_qkv_scale=True, split_shards=False,
            reads_is_causal=True, refused_actorder=("group", "dynamic"), hub_id_verifier=True,
            nvfp4_hopper_kernel="Humming",
            cites={
                "quantized_qkv": "0.32.0 model_executor/models/qwen3_dflash.py:532-537, :625; 0.34.0 :118-121, "
                                 ":565-573, :678-708 (each layer's own quantized kernel for the context K/V)",
                "shared_qkv_scale": "0.34.0 layers/quantization/compressed_tensors/schemes/"
                                    "compressed_tensors_w4a4_nvfp4.py:100-110, :114-123 (different q/k/v global "
                                    "scales: a warning, then their max); 0.32.0 :101-111, :117-126",
                "is_causal": "0.34.0 model_executor/models/qwen3_dflash.py:86-97",
                "actorder": "0.34.0 layers/quantization/compressed_tensors/compressed_tensors.py:336-345",
                "ignore_matching": "0.34.0 layers/quantization/utils/config_utils.py:453-489 (the fused name "
                                   "itself; no packed_modules_mapping for the draft, vLLM #53116)",
                "verifier": "0.33.0 transformers_utils/config.py:860-873, 0.34.0 :905-918 (`vllm serve <drafter "
                            "dir>`: a Hub id that is no local path)",
                "nvfp4_hopper": "0.34.0 model_executor/layers/quantization/utils/humming/priority.py:11 (Humming "
                                "ahead of Marlin on sm90, weight-only)",
                "fp8": "0.32.0 layers/quantization/compressed_tensors/compressed_tensors.py:582-616, :900 "
                       "(CompressedTensorsW8A8Fp8: tensor/channel/block weights), schemes/"
                       "compressed_tensors_w8a8_fp8.py:187 (a fused layer serves at the max() of its shards' "
                       "input_scale)",
                "fp8_qkv": "0.32.0 model_executor/models/qwen3_dflash.py:532-546, :625-633 (a quantized qkv_proj, "
                           "FP8 included, runs through its own quant method for the context K/V: #51581 fixed)"}),
)}
DEFAULT = "0.32+"  # the newest supported range (QuantConfig.vllm's default)


def profile(name: str | Profile | None = None, field_name: str = "quant.vllm") -> Profile:
    """The profile called `name` (None = DEFAULT); an unknown name is one sentence naming the choices."""
    if isinstance(name, Profile):
        return name
    key = DEFAULT if name is None else str(name)
    if key not in PROFILES:
        raise bad_value(field_name, name, "it is not a vLLM range specquant knows the checkpoint rules of",
                        f"use one of {', '.join(PROFILES)} (pipeline/serving/contract.py PROFILES)")
    return PROFILES[key]
