"""What vLLM reads from a DFlash drafter checkpoint, per supported vLLM range, as rules we can check on CPU.

The ranges are `pipeline.serving.profiles`' (`Profile`, `PROFILES`, `DEFAULT`, `profile`, re-exported here: a new
vLLM version is one edit there); each rule below reads a profile's flags and cites the wheel file:line its
`cites` hold (`vllm/` omitted; read from the wheels themselves, `pip download --no-deps vllm==X`). What a drafter
family adds (its Linears, those kept dense, its Parameters) is asked of its `pipeline.models.families` entry.

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

DFlash2 (`model_executor/models/qwen3_dflash2.py`, from 0.28; its family's `RANGES`, per profile): the DFlash layers
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
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.core.hub import hub_id
from pipeline.models import families
from pipeline.models.checkpoint_info import weight_format, weight_only
from pipeline.serving.profiles import DEFAULT, PROFILES, Profile, profile  # noqa: F401 - re-exported (contract.PROFILES)

# vLLM fuses these shards into one layer (packed_modules_mapping of its Qwen3 / DFlash models)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def family(config: dict[str, Any]) -> families.DrafterFamily:
    """The drafter family whose vLLM class reads `config`; a config no family detects is read as DFlash (the base
    family: vLLM's `dflash` class and no layer of its own)."""
    return families.find(config) or families.get("dflash")


def outer_linears() -> set[str]:
    """The Linears any registered family builds outside the draft layers, by HF name (`fc`, ...)."""
    return {name for fam in families.families() for name in fam.outer_linears}


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
    if vllm_name.startswith("model.") and vllm_name.removeprefix("model.") in outer_linears():
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
        if e in outer_linears():
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
    the verifier named in the checkpoint is the target vLLM loads. What the drafter's family adds (its Linears,
    those it keeps dense, a range without its class) is asked of the family (`family(config)`).
    """
    prof, fam = profile(prof), family(config)
    problems = _causality_problems(config, fam, prof) + _verifier_problems(config, prof, standalone)
    problems += _quant_config_problems(config, prof) + fam.profile_problems(prof)
    return problems + _layer_problems(config, fam, set(tensor_names), num_target_layers, prof, scales)


def _draft_quant_config(config: dict[str, Any]) -> dict | None:
    """The quantization_config vLLM reads: the one inside transformer_layer_config (the draft's HF config)."""
    return (config.get("transformer_layer_config") or {}).get("quantization_config")


def _causality_problems(config: dict[str, Any], fam: families.DrafterFamily, prof: Profile) -> list[str]:
    """Sliding-window layers, `is_causal` and `sliding_window_non_causal` as the range reads them."""
    problems, where = [], f"vLLM {prof.versions}"
    tlc = config.get("transformer_layer_config") or {}
    sliding = [i for i, t in enumerate(tlc.get("layer_types") or []) if t != "full_attention"]
    flag, is_causal = config.get("sliding_window_non_causal"), tlc.get("is_causal")
    # a family whose class keeps each layer's own window (`own_windows`: DFlash2), read by a range where
    # `is_causal: false` decides, serves its sliding layers as written
    windowed_ok = fam.own_windows and prof.reads_is_causal and is_causal is False
    if sliding and not windowed_ok:
        problems.append(f"layers {sliding} are sliding-window layers, which {where} serves with one causality "
                        "flag for every layer")
    if prof.reads_is_causal and is_causal is not None and is_causal is not False:
        problems.append(f"transformer_layer_config.is_causal is {is_causal!r}: {where} serves every draft layer "
                        f"causally ({prof.cites['is_causal']}); DFlash layers are non-causal")
    if flag is not True and not (prof.reads_is_causal and is_causal is False):
        problems.append(f"sliding_window_non_causal is {flag!r}: {where} serves every draft layer causally unless "
                        "it is true")
    return problems


def _verifier_problems(config: dict[str, Any], prof: Profile, standalone: bool) -> list[str]:
    """The verifier path vLLM resolves against its working directory (and, standalone, needs as a Hub id)."""
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not verifier or str(verifier).startswith(("./", "../")) or str(verifier) in {".", ".."}:
        return [f"verifier.name_or_path is {verifier!r}: vLLM resolves it against its working directory, "
                "so it must be a Hub id or a path from where the serving command runs"]
    if standalone and prof.hub_id_verifier and hub_id(str(verifier)) is None:
        return [f"verifier.name_or_path is {verifier!r}: `vllm serve <drafter dir>` in vLLM {prof.versions} needs a "
                f"Hub id that is no local path ({prof.cites['verifier']}); serve it with the target named explicitly"]
    return []


def _quant_config_problems(config: dict[str, Any], prof: Profile) -> list[str]:
    """The quantization_config vLLM reads (inside transformer_layer_config) and its activation ordering."""
    problems = []
    top, inner = config.get("quantization_config"), _draft_quant_config(config)
    if top != inner:
        problems.append("quantization_config differs between the top level and transformer_layer_config "
                        "(vLLM reads the one inside transformer_layer_config)")
    for group, spec in sorted(((inner or {}).get("config_groups") or {}).items()):
        actorder = ((spec or {}).get("weights") or {}).get("actorder")
        if actorder is not None and str(actorder) in prof.refused_actorder:
            problems.append(f"config_groups.{group}.weights.actorder is {actorder!r}: vLLM {prof.versions} refuses "
                            f"{'/'.join(prof.refused_actorder)} activation ordering ({prof.cites['actorder']})")
    return problems


def _layer_problems(config: dict[str, Any], fam: families.DrafterFamily, names: set[str], num_target_layers: int,
                    prof: Profile, scales: Mapping[str, Iterable[float]] | None) -> list[str]:
    """Each Linear the family's vLLM class builds (`vllm_linears`) against how the checkpoint stores it."""
    inner = _draft_quant_config(config)
    ignore = list((inner or {}).get("ignore") or [])
    kept_dense = set(fam.dense_linears(config))
    built_quantized = set(fam.vllm_quantized_linears(config, num_target_layers, prof))
    problems: list[str] = []
    for layer in fam.vllm_linears(config, num_target_layers):
        shards = hf_shards(layer, num_target_layers)
        if shards[0] in kept_dense:
            problems += _kept_dense_problems(layer, shards[0], names, ignore, prof, fam.range_cites(prof),
                                             inner is not None and layer in built_quantized)
        else:
            problems += _stored_problems(layer, shards, names, ignore, prof, inner is not None, scales)
    return problems


def _stored_problems(layer: str, shards: list[str], names: set[str], ignore: list[str], prof: Profile,
                     quantized: bool, scales: Mapping[str, Iterable[float]] | None) -> list[str]:
    """One Linear the range builds dense or quantized as `ignore` says: stored so, q/k/v as the range needs, the
    NVFP4 global scales of its shards equal where the range keeps one for the fused layer."""
    where = f"vLLM {prof.versions}"
    stored = {("quantized" if stored_quantized(s, names) else
               "dense" if f"{s}.weight" in names else "missing") for s in shards}
    if "missing" in stored:
        return [f"{layer}: the checkpoint has no weights for {shards}"]
    if len(stored) > 1:
        return [f"{layer}: its shards {shards} are stored partly dense and partly quantized"]
    try:
        want = "dense" if not quantized or vllm_ignores(layer, ignore, prof.split_shards) else "quantized"
    except ValueError as exc:
        return [str(exc)]
    got, problems = stored.pop(), []
    if got != want:
        problems.append(f"{layer}: the checkpoint stores it {got} but {where} builds it {want} (ignore = {ignore})")
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


def _kept_dense_problems(layer: str, shard: str, names: set[str], ignore: list[str], prof: Profile,
                         cites: dict[str, str], built_quantized: bool) -> list[str]:
    """A Linear the family keeps dense (`dense_linears`: DFlash2's kernel and hidden projections): stored dense,
    and, where some release of the range builds it with the draft's quant config (`built_quantized`: DFlash2's
    kernel_projection from 0.31), named in `ignore` so that vLLM builds it dense."""
    where = f"vLLM {prof.versions}"
    rule = cites.get(layer.rsplit(".", 1)[-1], "")
    if stored_quantized(shard, names):
        return [f"{layer}: the checkpoint stores it quantized but {where} builds it dense ({rule}); keep it dense"]
    if f"{shard}.weight" not in names:
        return [f"{layer}: the checkpoint has no weights for {[shard]}"]
    if built_quantized and not vllm_ignores(layer, ignore, prof.split_shards):
        return [f"{layer}: the checkpoint stores it dense but {where} builds it quantized unless `ignore` names it "
                f"({rule}; ignore = {ignore})"]
    return []


def stored_quantized(shard: str, names: set[str]) -> bool:
    """Whether a checkpoint stores `shard` quantized: packed 4-bit weights (`weight_packed`, pack-quantized and
    nvfp4-pack-quantized) or FP8 weights with their scale (`weight` in float8_e4m3fn beside `weight_scale`,
    float-quantized); a dense layer has `weight` alone."""
    return f"{shard}.weight_packed" in names or f"{shard}.weight_scale" in names


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


# vLLM 0.32's compressed-tensors scheme class for each weight format we write, with quantized activations or
# without (compressed_tensors.py:797-868; FP8 W8A8, tensor/channel/block weights with static or dynamic
# activations: :582-616, CompressedTensorsW8A8Fp8)
VLLM_SCHEMES = {("int4", False): "CompressedTensorsWNA16", ("fp4", True): "CompressedTensorsW4A4Fp4",
                ("fp4", False): "CompressedTensorsW4A4Fp4", ("fp8", True): "CompressedTensorsW8A8Fp8"}


def vllm_scheme(quant_config: dict | None) -> tuple[str, bool | None] | None:
    """(vLLM scheme class, weight-only) of a checkpoint's quantization (`checkpoint_info.weight_format`, and
    `weight_only`); None when dense. Weight-only is a flag of vLLM's FP4 scheme (`use_a16`); its int4 scheme is
    weight-only by name (None), FP8 W8A8 never (False)."""
    fmt = weight_format(quant_config)
    if fmt is None:
        return None
    w_only = weight_only(quant_config)
    return VLLM_SCHEMES[(fmt, not w_only)], {"fp4": w_only, "int4": None}.get(fmt, False)


def load_probe_modules(config: dict[str, Any], tensor_names: Iterable[str], num_target_layers: int) -> dict[str, dict]:
    """What vLLM's model class of a load-and-probe family (DFlash2) should build for a speculators checkpoint, by
    runtime name: every Linear (the family's `vllm_linears`) with the scheme its stored weights call for
    (`{"scheme": None}` = dense; a quantized one `{"scheme": <vLLM class>, "weight_only": bool}`), and the bare
    Parameters (the family's `vllm_parameters`: base kernels, codebooks)."""
    fam, names = family(config), set(tensor_names)
    scheme = vllm_scheme(_draft_quant_config(config))
    out: dict[str, dict] = {}
    for layer in fam.vllm_linears(config, num_target_layers):
        stored = {("quantized" if stored_quantized(s, names) else "dense")
                  for s in hf_shards(layer, num_target_layers)}
        if stored == {"quantized"} and scheme is not None:
            out[layer] = {"kind": "linear", "scheme": scheme[0], "weight_only": scheme[1]}
        else:
            out[layer] = {"kind": "linear", "scheme": None}
    for name in fam.vllm_parameters(config, num_target_layers):
        out[name] = {"kind": "parameter"}
    return out


def compare_load_probe_modules(expected: dict[str, dict], built: dict[str, dict], dtype: str | None = None, *,
                               card_name: str) -> list[str]:
    """Where vLLM built a load-and-probe drafter otherwise than its checkpoint calls for, one sentence each (empty:
    every module as intended). `built` is the serve-check worker's `modules` (runtime name -> scheme or Parameter),
    `card_name` the drafter's family in words (`DrafterFamily.card_name`: "vLLM's DFlash2 class")."""
    problems = []
    for name in sorted(set(expected) - set(built)):
        problems.append(f"{name}: the checkpoint calls for it but vLLM's {card_name} class builds no such module")
    for name in sorted(set(built) - set(expected)):
        problems.append(f"{name}: vLLM's {card_name} class builds it but the contract does not list it")
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
