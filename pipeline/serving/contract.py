"""What vLLM 0.26.0 reads from a DFlash drafter checkpoint, as rules we can check on CPU.

Pinned vLLM 0.26.0 source (file:line inside the wheel, `vllm/` omitted):
- `model_executor/models/qwen3_dflash.py:392, :669-670`: draft layer i is built as
  `model.layers.{i + T}` where T is the target's layer count; `:185, :192` q/k/v are one fused
  `self_attn.qkv_proj` beside `self_attn.o_proj`; `:302` the MLP is `mlp.gate_up_proj` + `mlp.down_proj`
  (Qwen3 MLP); `:413` the context projection is `model.fc`.
- `:354` (`get_draft_quant_config`): the draft's quantization config is the `quantization_config`
  inside `transformer_layer_config`.
- `layers/quantization/compressed_tensors/utils.py:50-103`: `should_ignore_layer` splits a fused
  layer into its shards (`qkv_proj` -> `q_proj`, `k_proj`, `v_proj`) and ignores it when every shard
  matches an `ignore` entry (shards that disagree are an error); `:175-192`: an entry matches by exact
  string or, prefixed `re:`, by `re.match`.
- `:441` (`_build_context_kv_buffers`): the context-KV precompute slices `qkv_proj.weight`, so q/k/v
  must stay dense (upstream issue #51581).
- `transformers_utils/configs/speculators/algos.py:124-125` + `qwen3_dflash.py:55-59`:
  `causal = not sliding_window_non_causal` (default True) is applied to EVERY draft layer.
- `transformers_utils/config.py:682-683`: `speculators_config.verifier.name_or_path` is taken verbatim
  as the target, relative to the serving process's working directory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value

# vLLM fuses these shards into one layer (packed_modules_mapping of its Qwen3 / DFlash models)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")


def vllm_linears(num_layers: int, num_target_layers: int) -> list[str]:
    """Every linear layer vLLM builds for a Qwen3 DFlash drafter, under vLLM's names."""
    names = ["model.fc"]
    for i in range(num_layers):
        p = f"model.layers.{i + num_target_layers}"
        names += [f"{p}.self_attn.qkv_proj", f"{p}.self_attn.o_proj", f"{p}.mlp.gate_up_proj", f"{p}.mlp.down_proj"]
    return names


def matches(name: str, ignore: Iterable[str]) -> bool:
    """vLLM's rule: an entry matches by exact string, or by `re.match` when it starts with `re:`."""
    return any(re.match(e[3:], name) is not None if e.startswith("re:") else e == name for e in ignore)


def vllm_ignores(name: str, ignore: Iterable[str]) -> bool:
    """Whether vLLM keeps layer `name` dense; raises ValueError where vLLM would (shards that disagree)."""
    ignore = list(ignore)
    proj = name.rsplit(".", 1)[-1]
    if proj in FUSED and name not in ignore:
        votes = {matches(name[: -len(proj)] + shard, ignore) for shard in FUSED[proj]}
        if len(votes) > 1:
            raise ValueError(f"{name}: its shards {FUSED[proj]} are not all dense or all quantized")
        return votes.pop()
    return matches(name, ignore)


def hf_shards(vllm_name: str, num_target_layers: int) -> list[str]:
    """The checkpoint (HF / llm-compressor) module names behind one vLLM layer."""
    if vllm_name == "model.fc":
        return ["fc"]
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
        if e == "fc":
            out.append("model.fc")
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
                        allow_quantized_qkv: bool = False) -> list[str]:
    """Everything vLLM 0.26.0 would read differently from what a speculators DFlash checkpoint holds.

    `tensor_names` are the keys of its safetensors: a quantized layer has `<name>.weight_packed`, a
    dense one `<name>.weight`. Empty list = vLLM builds every layer as the checkpoint stores it.
    `allow_quantized_qkv` skips the q/k/v rules (a drafter written with quant.quantize_qkv=true).
    """
    problems: list[str] = []
    tlc = config.get("transformer_layer_config") or {}
    layer_types = tlc.get("layer_types") or []
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding:
        problems.append(f"layers {sliding} are sliding-window layers, which vLLM 0.26 serves with one causality "
                        "flag for every layer")
    if config.get("sliding_window_non_causal") is not True:
        problems.append(f"sliding_window_non_causal is {config.get('sliding_window_non_causal')!r}: vLLM serves "
                        "every draft layer causally unless it is true")
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not verifier or str(verifier).startswith(("./", "../")) or str(verifier) in {".", ".."}:
        problems.append(f"verifier.name_or_path is {verifier!r}: vLLM resolves it against its working directory, "
                        "so it must be a Hub id or a path from where the serving command runs")
    top, inner = config.get("quantization_config"), tlc.get("quantization_config")
    if top != inner:
        problems.append("quantization_config differs between the top level and transformer_layer_config "
                        "(vLLM reads the one inside transformer_layer_config)")
    names = set(tensor_names)
    ignore = list((inner or {}).get("ignore") or [])
    num_layers = int(tlc.get("num_hidden_layers") or 0)
    for layer in vllm_linears(num_layers, num_target_layers):
        shards = hf_shards(layer, num_target_layers)
        stored = {("quantized" if f"{s}.weight_packed" in names else
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
                want = "dense" if vllm_ignores(layer, ignore) else "quantized"
            except ValueError as exc:
                problems.append(str(exc))
                continue
        got = stored.pop()
        if allow_quantized_qkv and layer.endswith("qkv_proj"):  # asked for: quant.quantize_qkv=true
            continue
        if got != want:
            problems.append(f"{layer}: the checkpoint stores it {got} but vLLM builds it {want} "
                            f"(ignore = {ignore})")
        if layer.endswith("qkv_proj") and want == "quantized":
            problems.append(f"{layer}: vLLM's DFlash context-KV precompute slices a dense qkv_proj.weight "
                            "(vLLM #51581); keep q/k/v dense")
    return problems


def check_dir(path: str | Path, num_target_layers: int) -> list[str]:
    """`checkpoint_problems` for a drafter folder on disk."""
    import json

    from safetensors import safe_open

    p = Path(path)
    config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    names: list[str] = []
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names += list(fh.keys())
    return checkpoint_problems(config, names, num_target_layers)
