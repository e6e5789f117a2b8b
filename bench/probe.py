"""Run one pipeline stage exactly as `python -m pipeline <stage> ...` does, and record what it cost.

    python -m bench.probe <probe.json> <stage> [hydra overrides]

Works under torchrun too (each rank writes `<probe>.rank<R>.json`). Recorded: wall time, peak GPU
memory (torch.cuda.max_memory_allocated / reserved), peak host memory as `ru_maxrss` (includes
page-cache pages of memory-mapped checkpoints) and as sampled anonymous RSS (`RssAnon`, the memory
the process itself allocated - what grows if a stage holds samples in memory).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class MemorySampler(threading.Thread):
    """Samples RssAnon / VmRSS every `period` s (peak and a coarse time series)."""

    def __init__(self, period: float = 0.25):
        super().__init__(daemon=True)
        self.period = period
        self.peak_anon = self.peak_rss = 0
        self.series: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        last = -1.0
        while not self._halt.is_set():
            anon, rss = _status_kib("RssAnon"), _status_kib("VmRSS")
            self.peak_anon, self.peak_rss = max(self.peak_anon, anon), max(self.peak_rss, rss)
            t = time.perf_counter() - self._t0
            if t - last >= 2.0:
                self.series.append((round(t, 1), anon // 1024))
                last = t
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)


def instrument(stage: str, notes: dict) -> None:
    """Timers around the stage's own functions (no behaviour change), and the opt-in GPU shim.

    cache: time spent in `load_target`, so steady-state tokens/s can be told apart from loading.
    quantize-drafter with BENCH_GPU_SHIM=1: the stage loads the drafter on the CPU and llm-compressor's
    basic pipeline calibrates where the model is; the shim moves the loaded drafter to
    `target.device` (recorded as `gpu_shim_applied`), so the calibration forward runs on the GPU.
    """
    import torch

    if stage == "cache":
        import pipeline.stages.cache as mod

        orig_load = mod.load_target

        def timed_load(cfg, device, *args, **kwargs):
            t0 = time.perf_counter()
            model = orig_load(cfg, device, *args, **kwargs)
            notes["load_target_s"] = round(notes.get("load_target_s", 0.0) + time.perf_counter() - t0, 3)
            return model

        mod.load_target = timed_load
    if stage == "quantize-drafter" and os.environ.get("BENCH_GPU_SHIM") == "1":
        import pipeline.stages.quantize_drafter as mod

        orig_drafter = mod.load_working_drafter

        def on_device(cfg, dconf):
            model = orig_drafter(cfg, dconf)
            dev = torch.device(cfg.target.device)
            if dev.type == "cuda" and next(model.parameters()).device.type == "cpu":
                model = model.to(dev)
                notes["gpu_shim_applied"] = True
            return model

        mod.load_working_drafter = on_device


def main(argv: list[str]) -> int:
    out, stage, overrides = Path(argv[0]), argv[1], argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    if "WORLD_SIZE" in os.environ:
        out = out.with_name(f"{out.stem}.rank{rank}{out.suffix}")
    import torch

    from pipeline.__main__ import main as pipeline_main

    notes: dict = {}
    instrument(stage, notes)
    sampler = MemorySampler()
    sampler.start()
    t0 = time.perf_counter()
    rc = pipeline_main([stage, *overrides])
    wall = time.perf_counter() - t0
    sampler.stop()
    rec = {"stage": stage, "overrides": overrides, "rc": rc, "wall_s": round(wall, 3), "rank": rank,
           "world_size": int(os.environ.get("WORLD_SIZE", "1")),
           "host_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
           "host_peak_anon_mib": sampler.peak_anon // 1024, "host_peak_rss_mib": sampler.peak_rss // 1024,
           "host_anon_series_mib": sampler.series, **notes}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devs = range(torch.cuda.device_count())
        rec["gpu_peak_alloc_mib"] = max(torch.cuda.max_memory_allocated(d) for d in devs) // 2**20
        rec["gpu_peak_reserved_mib"] = max(torch.cuda.max_memory_reserved(d) for d in devs) // 2**20
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
