"""Runs one stage and records how it was invoked (captured, never reconstructed)."""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import shlex
import sys
import time
from typing import Any

from omegaconf import OmegaConf

from pipeline.artifacts.rundir import RunDir
from pipeline.artifacts.stage_record import StageRecord, write_record
from pipeline.core.errors import SpecquantError
from pipeline.core.io import remove_stale_temps
from pipeline.core.secrets import scrub, scrub_obj
from pipeline.provenance.environment import device_info, git_state, package_versions


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def stage_record_name(stage: str, cfg) -> str:
    if stage == "quantize-drafter":
        return f"{stage}-{cfg.quant.name}"
    if stage == "quantize-target":
        return f"{stage}-{cfg.target_quant.name}"
    if stage == "cache" and str(cfg.cache.get("target") or "bf16") != "bf16":
        return f"{stage}-{cfg.cache.target}"
    return stage


# stages that drive llm-compressor: it is imported first, quietly (pipeline.core.quiet.import_llmcompressor)
LLMCOMPRESSOR_STAGES = ("quantize-drafter", "quantize-target")


def run_stage(stage: str, module: str, cfg, overrides: list[str]) -> dict[str, Any]:
    if stage in LLMCOMPRESSOR_STAGES:
        from pipeline.core.quiet import import_llmcompressor

        import_llmcompressor()
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise SpecquantError(f"stage `{stage}` is not built yet ({module} is missing); "
                                 "see the open issues for its status.") from None
        raise
    from pipeline.core.secrets import remember

    remember(OmegaConf.select(cfg, "publish.token"))  # a token in a config file is scrubbed from what any stage writes
    rd = RunDir.from_cfg(cfg)
    rd.check_confined()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # under torchrun the cache stage cleans up after its barrier
        remove_stale_temps(rd.root)
    from pipeline.core import hashes
    from pipeline.provenance.record import source_tree_sha256

    hashes.use_run(rd.root)  # the digests earlier stages of this run remembered (hash once: pipeline/core/hashes.py)
    hashes.reset_counters()  # bytes_hashed: every byte this stage reads to hash a file, from here on
    source_sha256 = source_tree_sha256()  # the code that is about to run, for the manifests
    started = time.time()
    result = mod.run(cfg) or {}
    wall = time.time() - started
    if _rank() == 0:
        rd = RunDir.from_cfg(cfg)
        record = StageRecord(
            stage=stage,
            argv=[sys.executable, "-m", "pipeline", *sys.argv[1:]] if sys.argv and sys.argv[0].endswith(
                "__main__.py") else list(sys.argv),
            command=shlex.join(["python", "-m", "pipeline", stage, *overrides]),
            overrides=list(overrides),
            launcher={"torchrun": "LOCAL_WORLD_SIZE" in os.environ,
                      "world_size": int(os.environ.get("WORLD_SIZE", "1"))},
            resolved_config=OmegaConf.to_container(cfg, resolve=True),
            started_utc=_dt.datetime.fromtimestamp(started, _dt.UTC).isoformat(),
            wall_time_s=round(wall, 3),
            seed=int(cfg.seed),
            versions=package_versions(),
            git=git_state(),
            source_sha256=source_sha256,
            device=device_info(),
            # what this process read to hash files, and what remembered digests saved (pipeline/core/hashes.py);
            # kept out of `result`, which the manifests copy
            **hash_report(rd),
            result=result,
        )
        write_record(rd.root, stage_record_name(stage, cfg), record, scrub=scrub_obj)
        where = result.get("output") if isinstance(result, dict) else None
        print(scrub(f"[specquant] {stage} done in {wall:.1f}s" + (f" -> {where}" if where else "")))
    hashes.flush()  # every rank: the digests this stage learnt, for the next stages of the run
    return result


def hash_report(rd: RunDir) -> dict[str, Any]:
    """The stage record's hashing figures: `bytes_hashed` (bytes read to hash files in this process),
    `files_hashed`, the digests reused instead (`hash_reused`: files, bytes) and which files were read
    (`hashed_files`: {run-relative or absolute path: bytes})."""
    from pipeline.core import hashes

    c = hashes.counters()
    return {"bytes_hashed": c["bytes_hashed"], "files_hashed": c["files_hashed"],
            "hash_reused": {"files": c["files_reused"], "bytes": c["bytes_reused"]},
            "hashed_files": hashes.reads(rd.root)}
