"""The run directory: where every stage of one experiment reads and writes.

    runs/<run_name>/
      data/            samples.jsonl, counts.json, meta.json            (data)
      cache/           index.json, shard-*.safetensors                  (cache, bf16 target)
      cache-<variant>/ the same, on the quantized target target/<variant>/ (cache cache.target=<variant>)
      drafter/<variant>/   checkpoints: bf16 reference + each quantized one (quantize-drafter)
      target/<variant>/    quantized targets                             (quantize-target)
      checks/<kind>-<variant>.json  reload / dequantize / error reports
      eval/            results.json, report.md, *.png, vllm_commands.sh  (evaluate)
      stages/<stage>[-<variant>].json  captured command, overrides, resolved config, wall time
      calibration_manifest.json, quant_run_manifest.json, provenance/   (manifest)
      publish/         assembled repo folders and publish records        (publish)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def from_cfg(cls, cfg) -> RunDir:
        return cls(Path(cfg.run_dir))

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def cache_for(self, target: str = "bf16") -> Path:
        """The hidden states of the bf16 target (`cache/`) or of a quantized target variant (`cache-<variant>/`)."""
        return self.cache if target == "bf16" else self.root / f"cache-{target}"

    def caches(self) -> dict[str, Path]:
        """{target variant: cache dir} of every finished cache in the run."""
        found = {"bf16": self.cache} if (self.cache / "index.json").is_file() else {}
        for p in sorted(self.root.glob("cache-*")):
            if (p / "index.json").is_file():
                found[p.name[len("cache-"):]] = p
        return found

    def drafter(self, variant: str) -> Path:
        return self.root / "drafter" / variant

    def target(self, variant: str) -> Path:
        return self.root / "target" / variant

    @property
    def checks(self) -> Path:
        return self.root / "checks"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def stages(self) -> Path:
        return self.root / "stages"

    @property
    def provenance(self) -> Path:
        return self.root / "provenance"

    @property
    def publish(self) -> Path:
        return self.root / "publish"

    @property
    def calibration_manifest(self) -> Path:
        return self.root / "calibration_manifest.json"

    @property
    def quant_run_manifest(self) -> Path:
        return self.root / "quant_run_manifest.json"

    def check_confined(self) -> None:
        """Refuse a run directory holding a symlink that resolves outside it (before any stage writes)."""
        import os

        from pipeline.core.io import confine

        if not self.root.exists():
            return
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                if p.is_symlink():
                    confine(p, self.root, field=f"run_dir/{p.relative_to(self.root).as_posix()}")

    def drafter_variants(self) -> list[str]:
        return self._variants(self.root / "drafter")

    def target_variants(self) -> list[str]:
        return self._variants(self.root / "target")

    @staticmethod
    def _variants(d: Path) -> list[str]:
        # `.partial-*` folders are checkpoints a killed run left half-written
        return sorted(p.name for p in d.iterdir()
                      if not p.name.startswith(".") and (p / "config.json").is_file()) if d.is_dir() else []
