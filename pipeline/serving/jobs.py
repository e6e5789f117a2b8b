"""serve-check's jobs from a run's checkpoints: one engine per target alone and per pair (a W4A4 drafter a second
time with `linear_backend=emulation` where the GPU has no FP4 tensor cores), one load-and-probe per drafter of a
load-and-probe family (DFlash2), every engine with the same settings (`engine_settings`, from `serve.*`). Which
drafters each target serves is the stage's (`pipeline.stages.serve_check.pairs_to_serve`); the records are
`pipeline.serving.records`'. What a drafter is (its family, whether its activations are FP4) is
`CheckpointInfo`'s, read from its config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.errors import bad_value
from pipeline.models.checkpoint_info import CheckpointInfo
from pipeline.models.formats import load_drafter_config
from pipeline.serving.records import EngineJob, LoadProbeJob


def _resolved(path: Path) -> str:
    """A local folder's absolute path, a Hub id as it is."""
    return str(path.resolve()) if path.exists() else str(path)


def is_quantized(target: Path) -> bool:
    """Whether a target folder holds a quantized checkpoint (its config.json has a quantization_config)."""
    conf = target / "config.json"
    return conf.is_file() and "quantization_config" in json.loads(conf.read_text(encoding="utf-8"))


def max_model_len(cfg, prompts: dict[str, list[list[int]]]) -> int:
    """`serve.max_model_len`, or the longest prompt + `eval.max_new_tokens` + 64."""
    longest = max(len(p) for ps in prompts.values() for p in ps)
    return int(cfg.serve.max_model_len or 0) or longest + int(cfg.eval.max_new_tokens) + 64


def engine_settings(cfg, stop: list[int], max_len: int, parallel: int, timed: bool) -> dict[str, Any]:
    """The settings every engine of the run shares (`EngineJob`'s), from `serve.*`; `parallel`: engines at once
    (their share of the GPU's memory); `timed`: engines timed here (CUDA graphs on). With `serve.speed`, the
    worker's timing block (it says "not measured" on the CPU build)."""
    s = cfg.serve
    tokenizer = Path(str(cfg.target.tokenizer or cfg.target.path))
    base = {"max_tokens": int(cfg.eval.max_new_tokens), "stop_token_ids": stop, "max_model_len": max_len,
            "kv_cache_memory_bytes": int(s.kv_cache_memory_bytes), "seed": int(cfg.seed), "dtype": s.dtype,
            "kv_cache_dtype": str(s.kv_cache_dtype),
            "gpu_memory_utilization": float(s.gpu_memory_utilization or round(0.9 / max(1, parallel), 3)),
            "cpu_nvfp4_emulation": bool(s.cpu_nvfp4_emulation), "cpu_int4_emulation": bool(s.cpu_int4_emulation),
            "attention_backend": s.attention_backend, "additional_config": dict(s.additional_config or {}),
            "enforce_eager": bool(s.enforce_eager) and not timed,
            "tokenizer": str(tokenizer.resolve()) if tokenizer.exists() else str(cfg.target.tokenizer or cfg.target.path)}
    if s.speed:
        if int(s.speed_batch) < 1 or int(s.speed_max_tokens) < 2:
            raise bad_value("serve.speed_batch/speed_max_tokens", [s.speed_batch, s.speed_max_tokens],
                            "the batch must be >= 1 and the tokens >= 2", "use e.g. 16 and 128")
        if s.speed_tau is not None and not float(s.speed_tau) >= 1:
            raise bad_value("serve.speed_tau", s.speed_tau, "an acceptance length is at least 1",
                            "give the tau of your own run (e.g. 3.2) or null for the reference loop's")
        base["speed"] = {"batches": sorted({1, int(s.speed_batch)}), "max_tokens": int(s.speed_max_tokens)}
    return base


def load_probe_job(cfg, variant: str, target_variant: str, drafter: Path, max_len: int) -> LoadProbeJob:
    """A drafter of a load-and-probe family (DFlash2) beside the configured target: no engine runs it here, vLLM's
    model class loads it; the job is named after its family (`dflash2--<variant>`)."""
    s = cfg.serve
    return LoadProbeJob(name=f"{CheckpointInfo.read(drafter).family}--{variant}", variant=variant, target_variant=target_variant,
                        target=_resolved(Path(str(cfg.target.path))), drafter=str(drafter.resolve()), dtype=s.dtype,
                        seed=int(cfg.seed), num_speculative_tokens=int(load_drafter_config(drafter).block_size) - 1,
                        max_model_len=max_len, cpu_nvfp4_emulation=bool(s.cpu_nvfp4_emulation),
                        cpu_int4_emulation=bool(s.cpu_int4_emulation))


def target_jobs(settings: dict[str, Any], target_variant: str, target: Path, drafters: dict[str, Path],
                prompts: dict[str, list[list[int]]], served: dict[str, Any] | None, emulate: bool) -> list[EngineJob]:
    """The target alone, then each drafter beside it (`emulate`: a drafter whose activations are FP4, NVFP4 W4A4 as
    `CheckpointInfo.fp4_activation` reads it, again on the emulation kernel);
    `served`: the target is served from a copy in its wrapper's layout (`serve_check.served_layouts`)."""
    path = served["path"] if served else _resolved(target)
    as_served = {"served_as": served, "language_model_only": True} if served else {}
    jobs = [EngineJob(**settings, name=f"{target_variant}--target-only", target_variant=target_variant, target=path,
                      drafter=None, variant=None, linear_backend="auto", prompts=prompts, **as_served)]
    for v, dpath in drafters.items():
        k = int(load_drafter_config(dpath).block_size) - 1
        for b in ["auto"] + (["emulation"] if emulate and CheckpointInfo.read(dpath).fp4_activation else []):
            jobs.append(EngineJob(**settings, name=f"{target_variant}--{v}" + ("" if b == "auto" else f"--{b}"),
                                  target_variant=target_variant, target=path, drafter=str(dpath.resolve()),
                                  variant=v, linear_backend=b, num_speculative_tokens=k, prompts=prompts,
                                  **as_served))
    return jobs
