"""The pipeline's stages, one module per make target, each exposing `run(cfg) -> dict`.

`STAGES` is the one list of them, in the order `make all` runs them: the entry point
(`python -m pipeline <stage>`) dispatches on it, provenance orders a run's stage records by it,
`make all` and the reproducibility check (`tests/repro.py`) run it in this order
(`python -m pipeline stages` prints it). Adding a stage is one line here plus its module and its
`conf/` group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str  # the make target and the `python -m pipeline <name>` command
    module: str  # exposes run(cfg) -> dict
    summary: str


STAGES: tuple[Stage, ...] = (
    Stage("data", "pipeline.stages.data", "calibration blend with a loss mask on assistant tokens"),
    Stage("cache", "pipeline.stages.cache", "the target's hidden states at the drafter's aux layers"),
    Stage("quantize-target", "pipeline.stages.quantize_target", "the target in 4 bits (llm-compressor oneshot)"),
    Stage("quantize-drafter", "pipeline.stages.quantize_drafter", "the drafter in 4 bits, calibrated on cached states"),
    Stage("evaluate", "pipeline.stages.evaluate", "acceptance length per subset, paired against bf16"),
    Stage("serve-check", "pipeline.stages.serve_check", "every checkpoint loaded and run in vLLM (GPU)"),
    Stage("manifest", "pipeline.stages.manifest", "hashed manifests, file list and in-toto provenance"),
    Stage("publish", "pipeline.stages.publish", "Hub repos with cards, verified remote hashes"),
)
ORDER: tuple[str, ...] = tuple(s.name for s in STAGES)
MODULES: dict[str, str] = {s.name: s.module for s in STAGES}

__all__ = ["MODULES", "ORDER", "STAGES", "Stage"]
