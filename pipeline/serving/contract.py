"""What vLLM reads from a DFlash drafter checkpoint, per supported vLLM range, as rules we can check on CPU.

One `Profile` per supported range (`PROFILES`, newest last; `DEFAULT` = the newest): what every vLLM of the
range reads, each rule pinned to file:line inside the wheel of the version it cites (`vllm/` omitted; read
from the wheels themselves, `pip download --no-deps vllm==X`). A range is judged by its strictest member:
a checkpoint written for 0.28-0.31 must load in 0.28 (dense q/k/v) and in 0.30 (no actorder group). A new
vLLM version is one edit here: widen a profile's `last`, or add a `Profile` with its own citations.

Read the same way in every supported version (0.26.0 lines; 0.34.0 in brackets):
- `model_executor/models/qwen3_dflash.py:392, :669-670` [`:513, :880`]: draft layer i is built as
  `model.layers.{i + T}` where T is the target's layer count; `:185, :192` [`:237`] q/k/v are one fused
  `self_attn.qkv_proj` beside `self_attn.o_proj`; the MLP is `mlp.gate_up_proj` + `mlp.down_proj`;
  `:413` [`:519-527`] the context projection is `model.fc`.
- `:354` [`:464`] (`get_draft_quant_config`): the draft's quantization config is the `quantization_config`
  inside `transformer_layer_config` (`transformers_utils/configs/speculators/base.py:59`: that dict is
  the draft's HF config).
- Ignore matching: 0.26 `layers/quantization/compressed_tensors/utils.py:50-103, :175-192` (a fused layer
  is split into its shards, ignored when every shard matches; an entry matches by exact string or, prefixed
  `re:`, by `re.match`); from 0.32 [`layers/quantization/utils/config_utils.py:453-489`, called at
  `compressed_tensors/compressed_tensors.py:1012`] an entry naming the fused layer itself wins, shards are
  split only through a `packed_modules_mapping`, which the draft's quant config does not get (vLLM #53116).
- `transformers_utils/configs/speculators/algos.py:124-125` [`:92-93`]: `dflash_config.causal = not
  sliding_window_non_causal` (absent = true), applied to EVERY draft layer (`qwen3_dflash.py:55-59`).

DFlash2 (`model_executor/models/qwen3_dflash2.py`, from 0.28; each profile's `dflash2_cites`): the DFlash layers
above plus, per draft layer, `model.layers.{i + T}.{attention,mlp}_conv.kernel_projection` and one
`model.candidate_selector.hidden_projection` (ReplicatedLinear each; `base_kernel` and the codebooks are bare
Parameters). `hidden_projection` is built without a quant config in every release (always dense);
`kernel_projection` without one in 0.28-0.30 and with the draft's quant config from 0.31, so a checkpoint for
a range reaching 0.31 stores it dense and names it in `ignore`. q/k/v follow the DFlash rules (the DFlash2
layer is the DFlash one). A speculators `dflash2` config is read from 0.29 (0.28 reads DFlash2 only as
z-lab's `DFlash2DraftModel`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.hub import hub_id

# vLLM fuses these shards into one layer (packed_modules_mapping of its Qwen3 / DFlash models)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


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
    # DFlash2: the first release of the range that builds vLLM's DFlash2 model from a speculators `dflash2`
    # checkpoint (None: no release of the range has a DFlash2 model class)
    dflash2_first: str | None = None
    # DFlash2's `kernel_projection`: some release of the range builds it with the draft's quant config (so it is
    # dense only where `ignore` names it); the releases before build it dense whatever the checkpoint says
    conv_draft_quant: bool = False
    dflash2_cites: dict[str, str] = field(default_factory=dict)

    @property
    def versions(self) -> str:
        """The range in words, e.g. `0.32.0 and newer (read in 0.32.0-0.34.0)`."""
        if self.open_ended:
            return f"{self.first} and newer (read in {self.first}-{self.last})"
        return self.first if self.first == self.last else f"{self.first}-{self.last}"

    @property
    def dflash2_versions(self) -> str:
        """The releases of the range that serve a speculators DFlash2 checkpoint, in words."""
        if self.dflash2_first is None:
            return "none"
        if self.open_ended:
            return f"{self.dflash2_first} and newer (read in {self.dflash2_first}-{self.last})"
        return f"{self.dflash2_first}-{self.last}"

    def record(self, dflash2: bool = False) -> dict[str, Any]:
        """What a stage record, the manifest and the card say about the range a checkpoint is written for
        (`dflash2`: a DFlash2 drafter's, with the DFlash2 releases and rules)."""
        out = {"profile": self.name, "versions": self.versions, "first": self.first, "last": self.last,
               "open_ended": self.open_ended, "quantized_qkv": self.quantized_qkv,
               "is_causal_written": self.reads_is_causal, "rules": dict(self.cites)}
        if dflash2:
            out.update(dflash2_versions=self.dflash2_versions, rules={**self.cites, **self.dflash2_cites})
        return out


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
                           "#51581)"},
            dflash2_cites={"dflash2": "no model_executor/models/qwen3_dflash2.py in 0.26.0; 0.28.0 adds it"}),
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
                "verifier": "0.28.0 transformers_utils/config.py:681-682, 0.31.0 :843-844 (taken verbatim)"},
            dflash2_first="0.29.0", conv_draft_quant=True,
            dflash2_cites={
                "dflash2": "0.29.0 transformers_utils/configs/speculators/algos.py:133-154, base.py:137-138 "
                           "(speculators `dflash2` read; 0.28.0 has no such reader)",
                "kernel_projection": "0.28.0-0.30.0 model_executor/models/qwen3_dflash2.py:69-77 (quant_config=None: "
                                     "always dense); 0.31.0 :194-202, :258 (the draft's quant config, "
                                     "qwen3_dflash.py:428, :470: dense only where ignored)",
                "hidden_projection": "0.28.0 model_executor/models/qwen3_dflash2.py:206-214, 0.31.0 :332-340 "
                                     "(quant_config=None: always dense)"}),
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
                           "FP8 included, runs through its own quant method for the context K/V: #51581 fixed)"},
            dflash2_first="0.32.0", conv_draft_quant=True,
            dflash2_cites={
                "dflash2": "0.32.0 transformers_utils/configs/speculators/algos.py:129-130, base.py:135; 0.34.0 "
                           "algos.py:97-98, base.py:135 (speculators `dflash2` read)",
                "kernel_projection": "0.32.0 model_executor/models/qwen3_dflash2.py:194-202, :258; 0.34.0 :195-203, "
                                     ":259 (the draft's quant config, qwen3_dflash.py:464, :512: dense only where "
                                     "ignored)",
                "hidden_projection": "0.32.0 model_executor/models/qwen3_dflash2.py:332-340, 0.34.0 :481-489 "
                                     "(quant_config=None: always dense)"}),
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


def written_config(config: dict[str, Any], prof: str | Profile | None = None) -> dict[str, Any]:
    """config.json as written for `prof`: where some release of the range lets `is_causal` decide, it is
    written false inside transformer_layer_config (the draft's HF config), so both readings say non-causal."""
    prof = profile(prof)
    if prof.reads_is_causal:
        config = {**config, "transformer_layer_config": {**(config.get("transformer_layer_config") or {}),
                                                         "is_causal": False}}
    return config


# schemes whose activations are quantized to FP4 with a static global scale (pipeline.quant.recipes.SCHEMES)
ACTIVATION_FP4_SCHEMES = ("nvfp4",)


def refuse_settings(q, field_name: str = "quant") -> Profile:
    """Settings the chosen range cannot serve, refused before any work; returns the profile."""
    prof = profile(q.vllm, f"{field_name}.vllm")
    if bool(q.quantize_qkv) and not prof.quantized_qkv and str(q.scheme).startswith("fp8"):
        raise bad_value(f"{field_name}.quantize_qkv", True, f"vLLM {prof.versions} (quant.vllm={prof.name}) runs the "
                        "DFlash context-KV precompute as a plain linear over qkv_proj.weight, which fails on an "
                        f"FP8 weight with a dtype mismatch (vLLM #51581; "
                        f"{prof.cites.get('fp8_qkv', prof.cites['dense_qkv'])})",
                        "leave it false, or write for vLLM 0.32 and newer with quant.vllm=0.32+")
    if bool(q.quantize_qkv) and not prof.quantized_qkv:
        raise bad_value(f"{field_name}.quantize_qkv", True, f"vLLM {prof.versions} (quant.vllm={prof.name}) needs a "
                        f"dense qkv_proj for the DFlash context-KV precompute ({prof.cites['dense_qkv']})",
                        "leave it false, or write for vLLM 0.32 and newer with quant.vllm=0.32+")
    if (bool(q.quantize_qkv) and prof.shared_qkv_scale and str(getattr(q, "activation_scale", "")) == "minmax"
            and str(q.scheme) in ACTIVATION_FP4_SCHEMES):
        # q reads the block only, k/v also the context: their static minmax input scales differ
        raise bad_value(f"{field_name}.activation_scale", "minmax", f"with quantized q/k/v it calibrates different "
                        f"input scales for q and for k/v, and vLLM {prof.versions} serves the fused qkv_proj at one "
                        f"({prof.cites.get('shared_qkv_scale', 'a shared q/k/v scale')})",
                        f"use {field_name}.activation_scale=mse (its search writes one shared q/k/v scale) or "
                        f"{field_name}.quantize_qkv=false")
    actorder = getattr(q, "actorder", None)
    if actorder is not None and str(actorder) in prof.refused_actorder:
        raise bad_value(f"{field_name}.actorder", actorder, f"vLLM {prof.versions} (quant.vllm={prof.name}) refuses "
                        f"compressed-tensors actorder {'/'.join(prof.refused_actorder)} ({prof.cites['actorder']})",
                        "use static or leave it unset, or write for vLLM 0.26 with quant.vllm=0.26")
    return prof


def refuse_dflash2(prof: Profile, field_name: str = "quant") -> None:
    """A DFlash2 drafter written for a range with no DFlash2 model class, refused before any work."""
    if prof.dflash2_first is None:
        raise bad_value(f"{field_name}.vllm", prof.name, f"vLLM {prof.versions} has no DFlash2 model class "
                        f"({prof.dflash2_cites['dflash2']}), so it cannot serve this DFlash2 drafter",
                        f"write it for vLLM 0.29 and newer with {field_name}.vllm=0.28-0.31 or 0.32+")


def vllm_linears(num_layers: int, num_target_layers: int, conv: bool = False, selector: bool = False) -> list[str]:
    """Every linear layer vLLM builds for a Qwen3 DFlash drafter, under vLLM's names (`conv`, `selector`: a
    DFlash2 drafter's convolutions' kernel projections and its candidate selector's hidden projection)."""
    names = ["model.fc"]
    for i in range(num_layers):
        p = f"model.layers.{i + num_target_layers}"
        names += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"]
        if conv:
            names += [f"{p}.attention_conv.kernel_projection", f"{p}.mlp_conv.kernel_projection"]
    if selector:
        names.append(SELECTOR_PROJECTION)
    return names


SELECTOR_PROJECTION = "model.candidate_selector.hidden_projection"  # vLLM's name; ours has no `model.`


def matches(name: str, ignore: Iterable[str]) -> bool:
    """vLLM's rule: an entry matches by exact string, or by `re.match` when it starts with `re:`."""
    return any(re.match(e[3:], name) is not None if e.startswith("re:") else e == name for e in ignore)


def vllm_ignores(name: str, ignore: Iterable[str], split_shards: bool = True) -> bool:
    """Whether vLLM keeps layer `name` dense; raises ValueError where vLLM would (shards that disagree).

    `split_shards` (0.26-0.31): a fused layer not named itself is judged by its shards. From 0.32 an entry
    matching the fused name wins and nothing is split for the draft (no packed_modules_mapping)."""
    ignore = list(ignore)
    proj = name.rsplit(".", 1)[-1]
    if proj in FUSED and not split_shards:
        return matches(name, ignore)
    if proj in FUSED and name not in ignore:
        votes = {matches(name[: -len(proj)] + shard, ignore) for shard in FUSED[proj]}
        if len(votes) > 1:
            raise ValueError(f"{name}: its shards {FUSED[proj]} are not all dense or all quantized")
        return votes.pop()
    return matches(name, ignore)


def hf_shards(vllm_name: str, num_target_layers: int) -> list[str]:
    """The checkpoint (HF / llm-compressor) module names behind one vLLM layer."""
    if vllm_name in ("model.fc", SELECTOR_PROJECTION):
        return [vllm_name.removeprefix("model.")]
    m = _LAYER.match(vllm_name)
    if m is None:
        raise ValueError(f"not a draft layer name: {vllm_name}")
    i, rest = int(m.group(1)) - num_target_layers, m.group(2)
    mod, proj = rest.rsplit(".", 1)
    return [f"layers.{i}.{mod}.{s}" for s in FUSED.get(proj, (proj,))]


def serving_ignore(quantized_ignore: list[str], user_ignore: Iterable[str], num_target_layers: int) -> list[str]:
    """The `ignore` list to write: vLLM must keep dense exactly what llm-compressor kept dense.

    `quantized_ignore` is what oneshot was given (patterns, ours and the user's). Regex entries are
    written as they are (ours hold for any number of target layers); an exact HF layer name
    (`layers.0.mlp.down_proj`, `fc`) is written under both names, HF and vLLM's (`model.layers.{0+T}...`,
    `model.fc`). A fused pair named only in part (gate_proj without up_proj) is refused: vLLM cannot
    build one layer half dense.
    """
    user = list(user_ignore)
    out: list[str] = []
    for e in quantized_ignore:
        out.append(e)
        if e.startswith("re:"):
            continue
        if e in ("fc", SELECTOR_PROJECTION.removeprefix("model.")):
            out.append(f"model.{e}")
            continue
        m = _LAYER.match(e)
        if m is None:
            continue
        i, rest = int(m.group(1)), m.group(2)
        mod, _, proj = rest.rpartition(".")
        for fused, shards in FUSED.items():
            if proj in shards:
                siblings = [f"layers.{i}.{mod}.{s}" for s in shards]
                if not all(s in quantized_ignore or matches(s, quantized_ignore) for s in siblings):
                    field = "quant.ignore" if e in user else "quant"
                    raise bad_value(field, e, f"vLLM fuses {', '.join(shards)} into one {fused} layer, which is "
                                    "either dense or quantized as a whole", f"list all of {', '.join(siblings)}")
                out.append(f"model.layers.{i + num_target_layers}.{mod}.{fused}")
                break
        else:
            out.append(f"model.layers.{i + num_target_layers}.{rest}")
    return list(dict.fromkeys(out))


def checkpoint_problems(config: dict[str, Any], tensor_names: Iterable[str], num_target_layers: int,
                        prof: str | Profile | None = None, scales: Mapping[str, Iterable[float]] | None = None,
                        standalone: bool = False) -> list[str]:
    """Everything the vLLM range `prof` (default: the newest) would read differently from what a speculators
    DFlash checkpoint holds; empty list = every release of the range builds every layer as stored.

    `tensor_names` are the keys of its safetensors: a quantized layer has `<name>.weight_packed`, a dense
    one `<name>.weight`. `scales` maps `<layer>.weight_global_scale` / `<layer>.input_global_scale` to their
    values (NVFP4; `check_dir` reads them). `standalone`: also served as `vllm serve <drafter dir>`, where
    the verifier named in the checkpoint is the target vLLM loads.
    """
    prof = profile(prof)
    problems: list[str] = []
    where = f"vLLM {prof.versions}"
    tlc = config.get("transformer_layer_config") or {}
    layer_types = tlc.get("layer_types") or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    flag, is_causal = config.get("sliding_window_non_causal"), tlc.get("is_causal")
    # a DFlash2 drafter read by a range where `is_causal: false` decides: every layer keeps its own window and is
    # served non-causally as written (0.32.0 model_executor/models/qwen3_dflash.py:86-97, :120-180; a mix of
    # sliding and full layers needs the V2 runner, :153-161, which DFlash2 forces); z-lab's Qwen3.8-27B-DFlash2
    windowed_ok = config.get("speculators_model_type") == "dflash2" and prof.reads_is_causal and is_causal is False
    if sliding and not windowed_ok:
        problems.append(f"layers {sliding} are sliding-window layers, which {where} serves with one causality "
                        "flag for every layer")
    if prof.reads_is_causal and is_causal is not None and is_causal is not False:
        problems.append(f"transformer_layer_config.is_causal is {is_causal!r}: {where} serves every draft layer "
                        f"causally ({prof.cites['is_causal']}); DFlash layers are non-causal")
    if flag is not True and not (prof.reads_is_causal and is_causal is False):
        problems.append(f"sliding_window_non_causal is {flag!r}: {where} serves every draft layer causally unless "
                        "it is true")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not verifier or str(verifier).startswith(("./", "../")) or str(verifier) in {".", ".."}:
        problems.append(f"verifier.name_or_path is {verifier!r}: vLLM resolves it against its working directory, "
                        "so it must be a Hub id or a path from where the serving command runs")
    elif standalone and prof.hub_id_verifier and hub_id(str(verifier)) is None:
        problems.append(f"verifier.name_or_path is {verifier!r}: `vllm serve <drafter dir>` in {where} needs a Hub "
                        f"id that is no local path ({prof.cites['verifier']}); serve it with the target named "
                        "explicitly")
    top, inner = config.get("quantization_config"), tlc.get("quantization_config")
    if top != inner:
        problems.append("quantization_config differs between the top level and transformer_layer_config "
                        "(vLLM reads the one inside transformer_layer_config)")
    for group, spec in sorted(((inner or {}).get("config_groups") or {}).items()):
        actorder = ((spec or {}).get("weights") or {}).get("actorder")
        if actorder is not None and str(actorder) in prof.refused_actorder:
            problems.append(f"config_groups.{group}.weights.actorder is {actorder!r}: {where} refuses "
                            f"{'/'.join(prof.refused_actorder)} activation ordering ({prof.cites['actorder']})")
    names = set(tensor_names)
    ignore = list((inner or {}).get("ignore") or [])
    num_layers = int(tlc.get("num_hidden_layers") or 0)
    dflash2 = config.get("speculators_model_type") == "dflash2"
    if dflash2 and prof.dflash2_first is None:
        problems.append(f"it is a DFlash2 drafter and {where} has no DFlash2 model class "
                        f"({prof.dflash2_cites['dflash2']})")
    conv, selector = dflash2 and config.get("conv_kernel_size") is not None, dflash2 and config.get("selector_rank") is not None
    for layer in vllm_linears(num_layers, num_target_layers, conv, selector):
        if layer.endswith(DFLASH2_DENSE):
            problems += _dflash2_dense_problems(layer, hf_shards(layer, num_target_layers)[0], names, ignore, prof,
                                                inner is not None)
            continue
        shards = hf_shards(layer, num_target_layers)
        stored = {("quantized" if stored_quantized(s, names) else
                   "dense" if f"{s}.weight" in names else "missing") for s in shards}
        if "missing" in stored:
            problems.append(f"{layer}: the checkpoint has no weights for {shards}")
            continue
        if len(stored) > 1:
            problems.append(f"{layer}: its shards {shards} are stored partly dense and partly quantized")
            continue
        if inner is None:
            want = "dense"
        else:
            try:
                want = "dense" if vllm_ignores(layer, ignore, prof.split_shards) else "quantized"
            except ValueError as exc:
                problems.append(str(exc))
                continue
        got = stored.pop()
        if got != want:
            problems.append(f"{layer}: the checkpoint stores it {got} but {where} builds it {want} "
                            f"(ignore = {ignore})")
        if layer.endswith("qkv_proj") and "quantized" in (want, got) and not prof.quantized_qkv:
            problems.append(f"{layer}: {where} needs a dense qkv_proj for the DFlash context-KV precompute "
                            f"({prof.cites['dense_qkv']}); keep q/k/v dense")
        if got == "quantized" and prof.shared_qkv_scale and scales is not None and len(shards) > 1:
            for kind in ("weight_global_scale", "input_global_scale"):
                values = [scales.get(f"{s}.{kind}") for s in shards]
                if all(v is not None for v in values) and len({tuple(v) for v in values}) > 1:
                    problems.append(f"{layer}: its shards' NVFP4 {kind} differ ({[list(v) for v in values]}); "
                                    f"{where} keeps their max for the fused layer "
                                    f"({prof.cites.get('shared_qkv_scale', 'compressed_tensors_w4a4_nvfp4.py')}), "
                                    "so every shard but one is served off its calibrated scale")
    return problems


def stored_quantized(shard: str, names: set[str]) -> bool:
    """Whether a checkpoint stores `shard` quantized: packed 4-bit weights (`weight_packed`, pack-quantized and
    nvfp4-pack-quantized) or FP8 weights with their scale (`weight` in float8_e4m3fn beside `weight_scale`,
    float-quantized); a dense layer has `weight` alone."""
    return f"{shard}.weight_packed" in names or f"{shard}.weight_scale" in names


DFLASH2_DENSE = (".kernel_projection", ".hidden_projection")  # DFlash2 Linears every checkpoint keeps dense


def _dflash2_dense_problems(layer: str, shard: str, names: set[str], ignore: list[str], prof: Profile,
                            quantized: bool) -> list[str]:
    """A DFlash2 kernel or hidden projection: stored dense, and, where some release of the range builds it with
    the draft's quant config (kernel_projection from 0.31), named in `ignore` so that vLLM builds it dense."""
    where = f"vLLM {prof.versions}"
    rule = prof.dflash2_cites.get(layer.rsplit(".", 1)[-1], "")
    if stored_quantized(shard, names):
        return [f"{layer}: the checkpoint stores it quantized but {where} builds it dense ({rule}); keep it dense"]
    if f"{shard}.weight" not in names:
        return [f"{layer}: the checkpoint has no weights for {[shard]}"]
    if (quantized and layer.endswith(".kernel_projection") and prof.conv_draft_quant
            and not vllm_ignores(layer, ignore, prof.split_shards)):
        return [f"{layer}: the checkpoint stores it dense but {where} builds it quantized unless `ignore` names it "
                f"({rule}; ignore = {ignore})"]
    return []


GLOBAL_SCALES = ("weight_global_scale", "input_global_scale")


def read_dir(path: str | Path) -> tuple[dict[str, Any], list[str], dict[str, tuple[float, ...]]]:
    """(config.json, tensor names, NVFP4 global scales by tensor name) of a drafter folder on disk."""
    import json

    from safetensors import safe_open

    p = Path(path)
    config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    names: list[str] = []
    scales: dict[str, tuple[float, ...]] = {}
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                names.append(k)
                if k.endswith(GLOBAL_SCALES):
                    scales[k] = tuple(float(x) for x in fh.get_tensor(k).float().reshape(-1).tolist())
    return config, names, scales


def check_dir(path: str | Path, num_target_layers: int, prof: str | Profile | None = None,
              standalone: bool = False) -> list[str]:
    """`checkpoint_problems` for a drafter folder on disk, under the vLLM range `prof` (default: the newest)."""
    config, names, scales = read_dir(path)
    return checkpoint_problems(config, names, num_target_layers, prof, scales, standalone)


# vLLM 0.32's compressed-tensors scheme class for each weight format we write (compressed_tensors.py:797-868;
# FP8 W8A8, tensor/channel/block weights with static or dynamic activations: :582-616, CompressedTensorsW8A8Fp8)
VLLM_SCHEMES = {("int", False): "CompressedTensorsWNA16", ("float", True): "CompressedTensorsW4A4Fp4",
                ("float", False): "CompressedTensorsW4A4Fp4", ("float8", True): "CompressedTensorsW8A8Fp8"}


def _scheme_of(quant_config: dict | None) -> tuple[str, bool] | None:
    """(vLLM scheme class, weight-only) of a checkpoint's single 4-bit config group; None when dense."""
    groups = list(((quant_config or {}).get("config_groups") or {}).values())
    if not groups:
        return None
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    kind = str(w.get("type", "int"))
    if kind == "float" and int(w.get("num_bits") or 4) == 8:  # FP8 W8A8: not weight-only
        return VLLM_SCHEMES[("float8", a is not None)], False
    # weight-only is a flag of vLLM's FP4 scheme (`use_a16`); its int4 scheme is weight-only by name
    return VLLM_SCHEMES[(kind, a is not None)], (a is None) if kind == "float" else None


def dflash2_modules(config: dict[str, Any], tensor_names: Iterable[str], num_target_layers: int) -> dict[str, dict]:
    """What vLLM's DFlash2 model class should build for a speculators `dflash2` checkpoint, by runtime name: every
    Linear (`vllm_linears`) with the scheme its stored weights call for (`{"scheme": None}` = dense; a quantized
    one `{"scheme": <vLLM class>, "weight_only": bool}`), and the bare Parameters (base kernels, codebooks)."""
    tlc = config.get("transformer_layer_config") or {}
    n = int(tlc.get("num_hidden_layers") or 0)
    names = set(tensor_names)
    scheme = _scheme_of(tlc.get("quantization_config"))
    out: dict[str, dict] = {}
    for layer in vllm_linears(n, num_target_layers, conv=config.get("conv_kernel_size") is not None,
                              selector=config.get("selector_rank") is not None):
        stored = {("quantized" if stored_quantized(s, names) else "dense")
                  for s in hf_shards(layer, num_target_layers)}
        if stored == {"quantized"} and scheme is not None:
            out[layer] = {"kind": "linear", "scheme": scheme[0], "weight_only": scheme[1]}
        else:
            out[layer] = {"kind": "linear", "scheme": None}
    for i in range(n) if config.get("conv_kernel_size") is not None else ():
        for side in ("attention_conv", "mlp_conv"):
            out[f"model.layers.{i + num_target_layers}.{side}.base_kernel"] = {"kind": "parameter"}
    if config.get("selector_rank") is not None:
        for book in ("predecessor", "successor"):
            out[f"model.candidate_selector.{book}_codebook"] = {"kind": "parameter"}
    return out


def compare_dflash2_modules(expected: dict[str, dict], built: dict[str, dict], dtype: str | None = None) -> list[str]:
    """Where vLLM built a DFlash2 drafter otherwise than its checkpoint calls for, one sentence each (empty: every
    module as intended). `built` is the serve-check worker's `modules` (runtime name -> scheme or Parameter)."""
    problems = []
    for name in sorted(set(expected) - set(built)):
        problems.append(f"{name}: the checkpoint calls for it but vLLM's DFlash2 class builds no such module")
    for name in sorted(set(built) - set(expected)):
        problems.append(f"{name}: vLLM's DFlash2 class builds it but the contract does not list it")
    for name in sorted(set(expected) & set(built)):
        want, got = expected[name], built[name]
        if want["kind"] == "parameter":
            if got.get("kind") != "parameter" or (dtype and got.get("dtype") != dtype):
                problems.append(f"{name}: vLLM holds it as {got} (want a bare {dtype or ''} Parameter, untouched)")
            continue
        if want["scheme"] != got.get("scheme") or (want["scheme"] and want["weight_only"] is not None
                                                   and bool(want["weight_only"]) != bool(got.get("weight_only"))):
            words = lambda d: "dense" if not d.get("scheme") else d["scheme"] + (" weight-only" if d.get("weight_only") else "")  # noqa: E731
            problems.append(f"{name}: vLLM built it {words(got)} but the checkpoint stores it {words(want)}")
    return problems
