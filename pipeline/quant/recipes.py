"""Quantization recipes: validate a `quant` / `target_quant` config, then build the llm-compressor modifier.

Validation runs on a meta-device copy of the model (shapes from config.json, no weights), so a
wrong scheme, observer, group size or algorithm fails in about a second with one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.core.errors import bad_value
from pipeline.models import families
from pipeline.quant import act_scale


@dataclass(frozen=True)
class Scheme:
    """One quantization format: a compressed-tensors preset (what vLLM reads) and what may change in it."""

    name: str
    # compressed_tensors.quantization.quant_scheme.PRESET_SCHEMES: NVFP4, NVFP4A16, W4A16, FP8, FP8_DYNAMIC, FP8_BLOCK
    preset: str
    fixed_group_size: bool  # NVFP4 kernels only read 16-element blocks

    def base(self):
        """A fresh copy of the preset's QuantizationScheme (targets Linear)."""
        from compressed_tensors.quantization import preset_name_to_scheme

        return preset_name_to_scheme(self.preset, ["Linear"])

    @property
    def grouped(self) -> bool:
        """Whether the weights carry one scale per group of input channels (NVFP4, W4A16); FP8 weights carry
        one per tensor, per output channel or per 128x128 block (`block`) and take no group size."""
        return self.base().weights.group_size is not None

    @property
    def default_group_size(self) -> int | None:
        g = self.base().weights.group_size
        return int(g) if g is not None else None

    @property
    def block(self) -> tuple[int, int] | None:
        """FP8_BLOCK's weight block (rows, columns); None for every other scheme."""
        b = self.base().weights.block_structure
        return (int(b[0]), int(b[1])) if b else None

    @property
    def quantize_activations(self) -> bool:
        return self.base().input_activations is not None

    @property
    def static_activations(self) -> bool:
        """Activations quantized with one static per-tensor scale stored in the checkpoint (FP8 `input_scale`),
        as opposed to NVFP4's calibrated global scale beside dynamic block scales, or dynamic per token/group."""
        a = self.base().input_activations
        return a is not None and not a.dynamic and str(getattr(a.strategy, "value", a.strategy)) == "tensor"

    @property
    def number_format(self) -> str:
        """`fp4` (NVFP4, NVFP4A16: float 4-bit weights), `int4` (W4A16) or `fp8` (FP8 presets), from the preset's
        weight args."""
        w = self.base().weights
        return f"{'fp' if str(getattr(w.type, 'value', w.type)) == 'float' else 'int'}{int(w.num_bits)}"


SCHEMES: dict[str, Scheme] = {
    "nvfp4": Scheme("nvfp4", "NVFP4", True),  # fp4 weights and local-dynamic fp4 activations, FP8 block scales
    "nvfp4a16": Scheme("nvfp4a16", "NVFP4A16", True),
    "w4a16": Scheme("w4a16", "W4A16", False),  # int4 symmetric, group 128
    # FP8 E4M3 (W8A8), what Hopper and Ada run natively (vLLM CompressedTensorsW8A8Fp8):
    "fp8": Scheme("fp8", "FP8", False),  # per-tensor weights, static per-tensor activation scales (calibrated)
    "fp8-dynamic": Scheme("fp8-dynamic", "FP8_DYNAMIC", False),  # per-channel weights, dynamic per-token activations
    "fp8-block": Scheme("fp8-block", "FP8_BLOCK", False),  # 128x128 block weights, dynamic per-group-128 activations
}
ALGORITHMS = ("rtn", "gptq", "awq")
CALIBRATIONS = ("cache", "none")
PIPELINES = ("basic", "sequential", "independent", "datafree")

# vLLM's DFlash context-KV precompute slices qkv_proj.weight and runs a plain linear (vLLM #51581):
# a drafter with quantized q/k/v crashes or silently corrupts, so they stay dense unless asked.
# The pattern matches HF names (q_proj, what llm-compressor sees) and vLLM's fused qkv_proj, for any layer
# numbering (vLLM numbers draft layers after the target's): pipeline.serving.contract.
QKV_IGNORE = r"re:.*self_attn\.(q|k|v|qkv)_proj$"
# never quantized: the embedding (vLLM shares the target's) and the output head
ALWAYS_IGNORE = (r"re:(.*\.)?lm_head$", r"re:(.*\.)?embed_tokens$")


# observers tuned to one 4-bit number format, with their twin for the other (registry keys, as _observer_key
# gives them): llm-compressor's nvfp4_expanded_* search 1.8x-0.8x of each group's range, the expansion FP4's
# non-uniform grid gains from (observers/mse.py NVFP4ExpandedMSEObserver, imatrix.py; fouroversix is an alias);
# imatrix_mse's defaults (no expansion, llama.cpp's int grid search) are the int4 twin of nvfp4_expanded_imatrix.
# minmax, mse and the rest read either format.
FORMAT_OBSERVERS: dict[str, tuple[str, dict[str, str]]] = {
    "nvfp4-expanded-mse": ("fp4", {"int4": "mse"}),
    "nvfp4-expanded-imatrix": ("fp4", {"int4": "imatrix_mse"}),
    "fouroversix": ("fp4", {"int4": "mse"}),
    "imatrix-mse": ("int4", {"fp4": "nvfp4_expanded_imatrix"}),
}


def check_observer_format(q, field: str) -> None:
    """An observer tuned to FP4 on an int4 scheme, or one tuned to int4 on an FP4 scheme, is one sentence naming
    the observer made for the scheme's format (both are registered, so llm-compressor would run either)."""
    key = _observer_key(str(q.observer))
    if key not in FORMAT_OBSERVERS:
        return
    made_for, twins = FORMAT_OBSERVERS[key]
    fmt = SCHEMES[q.scheme].number_format
    if made_for == fmt:
        return
    if fmt not in twins:  # FP8: the 4-bit observers' grids are not its grid
        raise bad_value(f"{field}.observer", q.observer, f"it is tuned to {made_for.upper()} weights but "
                        f"{field}.scheme {q.scheme} stores {fmt.upper()} weights",
                        f"use {field}.observer=minmax or mse for {q.scheme}")
    others = " or ".join(s.name for s in SCHEMES.values() if s.number_format == made_for)
    raise bad_value(f"{field}.observer", q.observer, f"it is tuned to {made_for.upper()} weights but "
                    f"{field}.scheme {q.scheme} stores {fmt.upper()} weights",
                    f"use {field}.observer={twins[fmt]} for {q.scheme}, or an {made_for.upper()} scheme "
                    f"({field}.scheme={others})")


def _registered_observers() -> list[str]:
    from llmcompressor.observers import Observer

    return sorted(Observer.registered_names())


def _observer_key(name: str) -> str:
    # the registry standardizes names: lower case, "_" -> "-"
    return name.strip().lower().replace("_", "-")


def resolve_ignore(q, dconf=None) -> list[str]:
    """The ignore list written into the recipe: the user's entries plus what must stay dense (for a drafter config
    `dconf`, the Linears its family keeps dense: `DrafterFamily.dense_linears`, e.g. DFlash2's kernel and hidden
    projections)."""
    family = [] if dconf is None else families.family_of(dconf).dense_linears(dconf)
    ignore = list(q.ignore) + family + ([] if q.quantize_qkv else [QKV_IGNORE]) + list(ALWAYS_IGNORE)
    return list(dict.fromkeys(ignore))  # de-duplicated, order kept


def group_size(q) -> int | None:
    """The weight group size: the config's, else the scheme's default; None for an FP8 scheme (no groups)."""
    if not SCHEMES[q.scheme].grouped:
        return None
    return int(q.group_size) if q.group_size is not None else SCHEMES[q.scheme].default_group_size


def validate_settings(q, field: str) -> None:
    """Checks that need no model: scheme, observer, algorithm, calibration, pipeline, group size value."""
    if q.scheme not in SCHEMES:
        raise bad_value(f"{field}.scheme", q.scheme, "it is not a known quantization scheme",
                        f"use one of {', '.join(SCHEMES)}")
    scheme = SCHEMES[q.scheme]
    known = _registered_observers()
    if _observer_key(str(q.observer)) not in known:
        raise bad_value(f"{field}.observer", q.observer, "llm-compressor registers no observer of that name",
                        f"use one of {', '.join(k.replace('-', '_') for k in known)}")
    check_observer_format(q, field)
    if q.algorithm not in ALGORITHMS:
        raise bad_value(f"{field}.algorithm", q.algorithm, "it is not a known algorithm",
                        f"use one of {', '.join(ALGORITHMS)}")
    if q.calibration not in CALIBRATIONS:
        raise bad_value(f"{field}.calibration", q.calibration, "it is not a known calibration source",
                        f"use one of {', '.join(CALIBRATIONS)}")
    if q.pipeline not in PIPELINES:
        raise bad_value(f"{field}.pipeline", q.pipeline, "it is not an llm-compressor calibration pipeline",
                        f"use one of {', '.join(PIPELINES)}")
    if scheme.static_activations and q.calibration == "none":
        raise bad_value(f"{field}.calibration", q.calibration, f"{q.scheme} stores one static activation scale per "
                        "layer, which only calibration data can set", f"set {field}.calibration=cache, or use "
                        f"{field}.scheme=fp8-dynamic (per-token scales at run time, data-free)")
    if q.algorithm in ("gptq", "awq") and q.calibration == "none":
        raise bad_value(f"{field}.algorithm", q.algorithm, "GPTQ needs calibration data but calibration is 'none'",
                        f"set {field}.calibration=cache or {field}.algorithm=rtn")
    if not scheme.grouped and q.group_size is not None:
        raise bad_value(f"{field}.group_size", q.group_size, f"{q.scheme} weights have no groups (one scale per "
                        f"{'128x128 block' if scheme.block else 'tensor' if q.scheme == 'fp8' else 'output channel'})",
                        "leave it unset (null)")
    gs = group_size(q)
    if gs is not None and gs <= 0:
        raise bad_value(f"{field}.group_size", q.group_size, "a group size must be positive",
                        f"leave it unset for the scheme default {scheme.default_group_size}")
    if scheme.fixed_group_size and gs != scheme.default_group_size:
        raise bad_value(f"{field}.group_size", q.group_size,
                        f"{q.scheme} stores one FP8 scale per {scheme.default_group_size} weights and kernels read "
                        "no other block size", f"set it to {scheme.default_group_size} or leave it unset")
    if q.device != "auto" and not str(q.device).startswith(("cpu", "cuda")):
        raise bad_value(f"{field}.device", q.device, "it is not a torch device", "use auto, cpu, cuda or cuda:N")
    if str(q.device).startswith("cuda") and not torch.cuda.is_available():
        raise bad_value(f"{field}.device", q.device, "no CUDA device is visible", "use auto or cpu")
    if q.algorithm == "awq" and resolve_device(str(q.device)).type != "cuda":
        # llm-compressor 0.14's AWQ pins its cached activations (pipelines/cache.py:155, `pin_memory`),
        # which torch refuses without an accelerator
        raise bad_value(f"{field}.algorithm", q.algorithm, "llm-compressor 0.14's AWQ needs a CUDA device "
                        "(it pins host memory for its activation cache)",
                        f"run it on a GPU machine, or use {field}.algorithm=gptq")
    if int(q.max_seq_len) < 2:
        raise bad_value(f"{field}.max_seq_len", q.max_seq_len, "a calibration or check sequence needs at least "
                        "two tokens (a context row and an anchor)", "use e.g. 2048, or leave the preset's value")
    # every count the stage draws with (checked here, not inside the DataLoader after the drafter load)
    for key, problem, fix in (
            ("anchors_per_sequence", "each calibration and check sequence needs at least one anchor block",
             "use a positive number, e.g. 32"),
            ("heldout_samples", "the checks need held-apart samples", "use 1 or more")):
        n = q[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad_value(f"{field}.{key}", n, problem, fix)
    if q.num_samples < 0:
        raise bad_value(f"{field}.num_samples", q.num_samples, "a sample count cannot be negative",
                        "use a positive number (or 0 with calibration=none)")
    if q.num_samples <= 0 and q.calibration == "cache":
        raise bad_value(f"{field}.num_samples", q.num_samples, "calibration needs at least one sample",
                        "use a positive number")
    check_observer_kwargs(q, field)
    act_scale.validate_settings(q, field)


class Linears(list):
    """`quantized_linears`' answer: (name, in_features) pairs, plus what the ignore entries matched."""

    all_names: tuple[str, ...] = ()  # every nn.Linear of the model, in module order
    out_features: dict[str, int] = {}  # noqa: RUF012 - set per instance by quantized_linears
    unmatched_ignore: tuple[str, ...] = ()  # ignore entries that match no nn.Linear (they would do nothing)


def quantized_linears(model: torch.nn.Module, ignore: list[str]) -> Linears:
    """(name, in_features) of every nn.Linear the recipe will quantize, in module order."""
    from compressed_tensors.utils import is_match, match_named_modules

    matched = list(match_named_modules(model, ["Linear"], ignore))
    out = Linears((name, int(mod.in_features)) for name, mod in matched)
    out.out_features = {name: int(mod.out_features) for name, mod in matched}
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    out.all_names = tuple(name for name, _ in linears)
    out.unmatched_ignore = tuple(e for e in ignore if not any(is_match(name, mod, e) for name, mod in linears))
    return out


def check_ignore(q, field: str, linears: list[tuple[str, int]]) -> None:
    """Every `ignore` entry the user gave must match at least one Linear layer (llm-compressor's rule:
    an exact module name, or `re:` + a regex matched from the start of the name)."""
    user = [str(e) for e in q.ignore]
    unmatched = [e for e in getattr(linears, "unmatched_ignore", ()) if e in user]
    if not unmatched:
        return
    names = list(getattr(linears, "all_names", ()))
    shown = ", ".join(names[:3]) + (f", ... ({len(names)} Linear layers)" if len(names) > 3 else "")
    raise bad_value(f"{field}.ignore", unmatched[0], "it matches no Linear layer of the model, so it would "
                    "keep nothing dense", f"remove it, or give an exact layer name or `re:<regex>` over the names "
                    f"llm-compressor sees ({shown})")


def check_observer_kwargs(q, field: str) -> None:
    """`observer_kwargs` must be settings the observer reads: it is built once (no model) with a mapping
    that records which keys it looks up; an unread key, or a value it refuses, is one sentence."""
    given = {str(k): v for k, v in dict(q.observer_kwargs or {}).items()}
    if not given:
        return
    from llmcompressor.observers import Observer

    class _Reads(dict):
        def __init__(self, *args):
            super().__init__(*args)
            self.read: set[str] = set()

        def get(self, key, default=None):
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            self.read.add(key)
            return super().__contains__(key)

    args = _weight_args(q)
    reads = _Reads(given)
    object.__setattr__(args, "observer_kwargs", reads)  # as-is: the observer's own reads are recorded
    try:
        Observer.load_from_registry(_observer_key(str(q.observer)), base_name="weight", args=args)
    except (ValueError, TypeError) as exc:
        raise bad_value(f"{field}.observer_kwargs", given, f"the {q.observer} observer refuses them "
                        f"({str(exc).splitlines()[0]})", "fix the value (see llm-compressor's observers)") from None
    unknown = [k for k in given if k not in reads.read]
    if unknown:
        known = sorted(reads.read)
        raise bad_value(f"{field}.observer_kwargs.{unknown[0]}", given[unknown[0]],
                        f"the {q.observer} observer has no `{unknown[0]}` setting",
                        f"remove it (it reads {', '.join(known)})" if known else "remove it (it takes no settings)")


def validate_group_size(q, field: str, linears: list[tuple[str, int]]) -> None:
    """Every quantized layer's in-features must be a multiple of the group size (one scale per group);
    every user ignore entry must match a layer (`check_ignore`)."""
    check_ignore(q, field, linears)
    if not linears:
        raise bad_value(f"{field}.ignore", list(q.ignore), "it leaves no Linear layer to quantize",
                        "remove entries from the ignore list")
    block = SCHEMES[q.scheme].block
    if block is not None:
        validate_block(q, field, linears, block)
    gs = group_size(q)
    if gs is None:
        return
    bad = [(name, width) for name, width in linears if width % gs != 0]
    if bad:
        name, width = bad[0]
        more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
        divisors = [d for d in (128, 64, 32, 16) if all(w % d == 0 for _, w in linears)]
        hint = f"e.g. {divisors[0]}" if divisors else "or add those layers to the ignore list"
        raise bad_value(f"{field}.group_size", gs,
                        f"it does not divide the in-features {width} of {name}{more}",
                        f"use a group size that divides every quantized layer's width, {hint}")


def validate_block(q, field: str, linears, block: tuple[int, int]) -> None:
    """FP8_BLOCK: every quantized layer's in- and out-features must be multiples of the 128x128 weight block
    (vLLM reads one scale per block; its activations are quantized per 128 input channels at run time)."""
    bad = [(name, i, o) for name, i, o in _widths(linears) if i % block[1] or (o is not None and o % block[0])]
    if bad:
        name, i, o = bad[0]
        more = f" (and {len(bad) - 1} more layers)" if len(bad) > 1 else ""
        raise bad_value(f"{field}.scheme", q.scheme, f"its {block[0]}x{block[1]} weight blocks do not tile "
                        f"{name} ({o} x {i}){more}", f"use {field}.scheme=fp8-dynamic or fp8 (no blocks), or add "
                        f"those layers to {field}.ignore")


def _widths(linears):
    """(name, in_features, out_features or None) of `quantized_linears`' answer."""
    outs = getattr(linears, "out_features", {})
    return [(name, int(width), outs.get(name)) for name, width in linears]


def _weight_args(q):
    """The preset's weight args with what the config sets: observer, its settings and the group size."""
    from compressed_tensors.quantization import QuantizationArgs

    preset = SCHEMES[q.scheme].base().weights
    return QuantizationArgs(**{**dict(preset), "group_size": group_size(q) if SCHEMES[q.scheme].grouped else None,
                               "observer": str(q.observer).strip().lower(),
                               "observer_kwargs": dict(q.observer_kwargs or {})})


def build_modifier(q, ignore: list[str]):
    """A QuantizationModifier (RTN) or GPTQModifier with explicit config_groups for `q.scheme`: the
    compressed-tensors preset with the config's weight observer and group size (`_weight_args`).

    NVFP4's activations are the preset's: dynamic "local", so FP8 block scales are computed per token at
    run time and only the per-tensor input_global_scale is calibrated (static_minmax keeps the running
    absmax over all batches), in groups of the weights' size (16: `validate_settings`). FP8's are the
    preset's as they are: static per-tensor `input_scale` (fp8: static_minmax, then `act_scale`), dynamic per
    token (fp8-dynamic) or per group of 128 (fp8-block), computed by the kernel at run time.
    """
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    preset = SCHEMES[q.scheme].base()
    acts = preset.input_activations
    grouped = SCHEMES[q.scheme].grouped  # FP8 activations keep the preset's (tensor, token or group 128)
    group = QuantizationScheme(**{**dict(preset), "weights": _weight_args(q), "input_activations": (
        QuantizationArgs(**{**dict(acts), "group_size": group_size(q)}) if acts is not None and grouped else acts)})
    kwargs = {"config_groups": {"group_0": group}, "ignore": list(ignore)}
    if q.algorithm == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier

        # the drafter's MLPs only: their smoothing scale folds into post_attention_layernorm (gate/up) and
        # up_proj (down). q/k/v stay dense, and fc reads the target's cached hidden states, with no layer
        # of the drafter in front of it to fold a scale into, so neither is smoothed.
        mappings = [AWQMapping("re:.*post_attention_layernorm$", ["re:.*mlp\\.gate_proj$", "re:.*mlp\\.up_proj$"]),
                    AWQMapping("re:.*mlp\\.up_proj$", ["re:.*mlp\\.down_proj$"])]
        return [AWQModifier(mappings=mappings), QuantizationModifier(**kwargs)]
    if q.algorithm == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(**kwargs)
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return QuantizationModifier(**kwargs)


# observers that weight the weight error by the layer's input activations, gathered in a calibration forward
DATA_OBSERVERS = ("imatrix-mse", "nvfp4-expanded-imatrix")


def needs_data(q) -> bool:
    """Whether the recipe runs a calibration forward (activation scales, GPTQ Hessians, imatrix statistics)."""
    s = SCHEMES[q.scheme]
    # dynamic FP8 activations (per token, per group) have nothing to calibrate
    acts = s.quantize_activations and (s.grouped or s.static_activations)
    return q.calibration == "cache" and (acts or q.algorithm in ("gptq", "awq")
                                         or _observer_key(str(q.observer)) in DATA_OBSERVERS)


def resolve_device(device: str) -> torch.device:
    """`auto` = the first CUDA device when there is one (calibration and checks), else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
