"""Typed Hydra configuration: one dataclass per `conf/` group, registered in a ConfigStore.

The YAML files in `conf/` are merged onto these schemas, so a wrong type or an
unknown key fails at composition time, before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class TargetConfig:
    name: str = MISSING
    path: str = MISSING  # local directory or Hub repo id
    revision: str | None = None  # pinned commit for Hub repo ids
    tokenizer: str | None = None  # defaults to `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    license: str | None = None


@dataclass
class DrafterConfig:
    name: str = MISSING
    path: str = MISSING  # local directory or Hub repo id
    revision: str | None = None
    format: str = "auto"  # auto | zlab | speculators
    mask_token: str = "<|MASK|>"
    license: str | None = None
    trust_remote_code: bool = False


@dataclass
class DataSource:
    name: str = MISSING  # subset label recorded in counts and manifests
    path: str | None = None  # local .json / .jsonl file
    hub_id: str | None = None  # Hub dataset id, loaded with datasets.load_dataset
    revision: str | None = None
    split: str = "train"
    format: str = "auto"  # auto | sharegpt | openai
    weight: float = 1.0


@dataclass
class DataConfig:
    name: str = MISSING
    sources: list[DataSource] = field(default_factory=list)
    num_samples: int = 256
    max_seq_len: int = 2048
    min_assistant_tokens: int = 1
    max_turn_chars: int = 200_000
    system_prompt: str | None = None


@dataclass
class CacheConfig:
    storage_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | fp8
    samples_per_shard: int = 64
    max_shard_bytes: int = 2 * 1024**3
    batch_tokens: int = 8192
    distributed_backend: str = "auto"  # auto | gloo | nccl
    # HF output_hidden_states indices to cache; None = the drafter config's aux layers
    aux_layer_ids: list[int] | None = None
    compile_layers: bool = False  # torch.compile each decoder layer's forward (GPU throughput; compile time)
    shards_in_flight: int = 1  # shards written at once (one sha256 stream each); a kill redoes up to this many
    # whose hidden states: bf16 (target.path) or a quantized target variant of the run (target/<variant>/,
    # loaded dequantized); each gets its own cache directory (RunDir.cache_for)
    target: str = "bf16"


@dataclass
class QuantConfig:
    name: str = MISSING  # output variant directory name, e.g. nvfp4
    scheme: str = MISSING  # nvfp4 | nvfp4a16 | w4a16
    observer: str = "minmax"
    observer_kwargs: dict[str, Any] = field(default_factory=dict)
    group_size: int | None = None  # None = the scheme's default (16 for NVFP4, 128 for W4A16)
    algorithm: str = "rtn"  # rtn | gptq
    calibration: str = "cache"  # cache | none (calibration-free baseline)
    num_samples: int = 64
    anchors_per_sequence: int = 32
    max_seq_len: int = 2048
    ignore: list[str] = field(default_factory=list)
    quantize_qkv: bool = False
    pipeline: str = "basic"
    heldout_samples: int = 8
    # calibration=none with activation quantization: the fixed activation absmax behind the constant
    # NVFP4 input_global_scale (448*6 = 2688 gives 1.0, compressed-tensors' uncalibrated fallback)
    fixed_activation_amax: float = 2688.0
    # calibration=cache with activation quantization: how input_global_scale is chosen. minmax =
    # llm-compressor's static_minmax (448*6 / calibration absmax); mse = per layer, the candidate with
    # the least layer-output error of activation QDQ on the calibration batches, among the fixed scale,
    # the minmax scale and minmax * each multiplier (pipeline/quant/act_scale.py)
    activation_scale: str = "minmax"  # minmax | mse
    activation_scale_multipliers: list[float] = field(default_factory=lambda: [
        0.25, 0.315, 0.397, 0.5, 0.63, 0.794, 1.26, 1.587, 2.0, 2.52, 3.175, 4.0])
    # the search reads the first N calibration samples of the seeded order (0 = all of them): 64 x
    # 2,048 tokens already pin each layer's error sums, and at 8B shape each sample costs ~0.5 s
    activation_scale_samples: int = 64
    # the drafter check re-measures served top-1 with every activation global scale times each factor:
    # non-powers of two only move FP8 block-scale rounding, so the spread is the noise floor that a
    # calibrated vs calibration-free difference is judged against ([] = skip)
    rounding_band_factors: list[float] = field(default_factory=lambda: [0.794, 0.891, 1.122, 1.26])
    device: str = "auto"  # auto (CUDA when visible, else CPU) | cpu | cuda | cuda:N - where calibration runs
    # the target whose cached hidden states calibrate the drafter: bf16 or a quantized target variant
    # (its cache: `cache.target=<variant>`); a variant calibrated on another target is named
    # `<name>-on-<target>` (pipeline.config.derive_names)
    calibration_target: str = "bf16"


@dataclass
class EvalPromptSet:
    name: str = MISSING
    path: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    split: str = "test"
    field: str = "prompt"  # column holding the prompt text (or messages)


@dataclass
class EvalConfig:
    name: str = MISSING
    prompt_sets: list[EvalPromptSet] = field(default_factory=list)
    max_new_tokens: int = 64
    limit: int | None = None  # prompts per subset, for quick runs
    variants: list[str] = field(default_factory=list)  # drafter variants; empty = every one in the run
    target_variant: str = "bf16"  # the target of the main table (and of the calibration comparison)
    # the pair matrix: every listed target x every drafter variant; empty = bf16 + every target variant of the run
    targets: list[str] = field(default_factory=list)
    include_source: bool = False  # also evaluate drafter.path as variant "source" (e.g. fp32, before bf16 rounding)


@dataclass
class PublishConfig:
    dry_run: bool = True
    endpoint: str = "https://huggingface.co"
    namespace: str | None = None
    repo_id: str | None = None  # overrides <namespace>/<drafter>-<variant>
    token_env: str = "HF_TOKEN"
    private: bool = False
    variants: list[str] = field(default_factory=list)
    tag: str | None = None
    token: str | None = None  # prefer token_env; a token given here is scrubbed like one from env
    base_model: str | None = None  # Hub id of the source drafter (default: drafter.path when it is a repo id)
    target_model: str | None = None  # Hub id of the target shown in the card (default: target.path)
    library_name: str = "speculators"


@dataclass
class ServeConfig:
    """serve-check: vLLM runs in its own interpreter (it pins other torch / compressed-tensors versions)."""

    python: str | None = None  # an interpreter with vLLM 0.26 (and a CUDA GPU); null = not configured
    targets: list[str] = field(default_factory=list)  # bf16 and/or target variants; empty = every one of the run
    variants: list[str] = field(default_factory=list)  # drafter variants; empty = every one of the run
    parallel: int = 4  # engines (worker processes) at once on the GPU
    kv_cache_memory_bytes: int = 1 << 30  # fixed KV budget per engine (skips profiling; engines share the GPU)
    # vLLM still checks at start-up that this fraction of the GPU is free: None = 0.9 / parallel
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # None = longest prompt + eval.max_new_tokens + 64
    dtype: str = "bfloat16"  # what vLLM computes in (FLASH_ATTN needs 16-bit)
    attention_backend: str = "FLASH_ATTN"  # must support non-causal attention (DFlash drafts a block at once)
    enforce_eager: bool = True
    emulate_w4a4: bool = True  # NVFP4 W4A4 drafters run again with linear_backend=emulation below sm100
    min_tau_ratio: float = 0.9  # fail a variant whose vLLM tau is below this x the bf16 drafter's
    min_tau: float = 1.05  # fail any variant below this (zero acceptance)
    # fail a pair whose outputs differ from the target alone; false = report only (random-weight models,
    # whose near-tie logits flip between vLLM's batch shapes)
    require_lossless: bool = True


@dataclass
class SpecquantConfig:
    run_name: str = MISSING
    seed: int = 0
    runs_root: str = "runs"
    run_dir: str = "${runs_root}/${run_name}"
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    target_quant: QuantConfig = field(default_factory=QuantConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="specquant_schema", node=SpecquantConfig)


def compose(overrides: list[str] | None = None, config_dir: str | Path | None = None):
    """Compose the real config tree with overrides (the entry point and tests both use this)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(config_dir or CONF_DIR).resolve()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=list(overrides or []))
    from omegaconf.errors import MissingMandatoryValue

    try:
        derive_names(cfg)
    except MissingMandatoryValue:  # quant.name unset: reported by the caller's checks
        pass
    return cfg


NAME_FIELDS = ("run_name", "quant.name", "target_quant.name", "quant.calibration_target", "cache.target")
PAIR_SUFFIX = "-on-"


def derive_names(cfg) -> None:
    """A drafter calibrated on a quantized target's states gets its own variant directory,
    `<quant.name>-on-<target>`, so it never takes the place of the one calibrated on bf16."""
    target = str(cfg.quant.get("calibration_target") or "bf16")
    name = str(cfg.quant.name)
    if target != "bf16" and not name.endswith(f"{PAIR_SUFFIX}{target}"):
        cfg.quant.name = f"{name}{PAIR_SUFFIX}{target}"
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


def bad_names(cfg) -> list[tuple[str, str]]:
    """Names that become directories must stay one plain path segment (no `/`, no `..`)."""
    import re

    from omegaconf import OmegaConf

    out = []
    for key in NAME_FIELDS:
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, str) or not re.match(_NAME_RE, value):
            out.append((key, value))
    return out


def unknown_keys(node: Any, schema: type = None, prefix: str = "") -> list[str]:
    """Keys present in a composed config but absent from its dataclass schema (catches `+key=...`)."""
    import dataclasses
    import typing

    from omegaconf import DictConfig, ListConfig

    schema = schema or SpecquantConfig
    hints = typing.get_type_hints(schema)
    names = {f.name for f in dataclasses.fields(schema)}
    bad: list[str] = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        full = f"{prefix}{key}"
        if key not in names:
            bad.append(full)
            continue
        hint = hints[key]
        args = typing.get_args(hint)
        sub = node._get_node(key)
        if dataclasses.is_dataclass(hint):
            bad += unknown_keys(sub, hint, full + ".")
        elif args and dataclasses.is_dataclass(args[0]) and isinstance(sub, ListConfig):
            for i, item in enumerate(sub):
                bad += unknown_keys(item, args[0], f"{full}[{i}].")
    return bad
