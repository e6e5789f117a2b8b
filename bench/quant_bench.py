"""Time the quantize stages: wall time (per phase) and peak GPU / host memory, one stage per process.

    python -m bench.quant_bench --out OUT --tiny --device cpu             # CPU smoke test, tiny shapes
    python -m bench.quant_bench --out OUT --device cuda                    # DFlash-b16 / Qwen3-8B shapes
    python -m bench.quant_bench --out OUT --target T --drafter D --run-dir R  # given checkpoints + cache

Issue 20 (part 2) headline, on a run directory with an 8B-shape cache (e.g. made by bench.run_8b's
build,data,cache phases with the same --work and --runs):

    python -m bench.quant_bench --out OUT --work W --run-dir RUNS/bench --device cuda:0 --samples 264 \
        --heldout 8 --variants drafter-nvfp4-expanded-mse --results bench/results

writes bench/results/<date>-<gpu>-quant.json: `quantize_drafter_nvfp4_<N>_s` (the stage's own wall,
N = --samples - --heldout calibration samples), its phases, peak GPU and host memory, the goal
(60 s) and run 4's figures (docs/benchmarks-archive.md, 2026-11-30) beside it.

Without --target/--drafter it builds random-weight models of the chosen shape (bench.shapes), a
synthetic blend of --samples x --seq-len tokens and its cache (the real cache stage). Then each
variant runs as `python -m bench.probe ... quantize-drafter|quantize-target <overrides>` (the real
stage, plus peak memory); the stage's own phase timings (load, oneshot, write, check) come from
its record. Results: OUT/quant_bench.json and OUT/quant_bench.md (a table for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# (key, stage, overrides): the drafter variants the issue asks for, plus minmax and the baseline
VARIANTS = {
    "drafter-nvfp4-expanded-mse": ("quantize-drafter", ["quant=nvfp4", "quant.observer=nvfp4_expanded_mse"]),
    "drafter-nvfp4-minmax": ("quantize-drafter", ["quant=nvfp4", "quant.observer=minmax",
                                                  "quant.name=nvfp4-minmax"]),
    "drafter-nvfp4-nocalib": ("quantize-drafter", ["quant=nvfp4-nocalib"]),
    "drafter-w4a16": ("quantize-drafter", ["quant=w4a16"]),
    "target-w4a16": ("quantize-target", ["target_quant=w4a16"]),
}


# how a stage's process is started (`subprocess.run`'s signature); the smoke test forks it (tests/warm.py)
run_process = subprocess.run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for quant_bench.json / quant_bench.md")
    p.add_argument("--work", default="auto", help="work folder (auto: the largest free local disk)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--device", default="cuda", help="where the stages calibrate (quant.device)")
    p.add_argument("--target", help="existing target directory (skips building one)")
    p.add_argument("--drafter", help="existing drafter directory (skips building one)")
    p.add_argument("--run-dir", help="existing run directory holding data/ and cache/ for these models")
    p.add_argument("--samples", type=int, default=264, help="cached samples (calibration = samples - heldout)")
    p.add_argument("--heldout", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=32, help="anchors per calibration sequence")
    p.add_argument("--target-samples", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", default="", help="extra Hydra overrides for every stage, space-separated")
    p.add_argument("--results", help="folder for <date>-<gpu>-quant.json (e.g. bench/results): the NVFP4 drafter's "
                   "stage wall as quantize_drafter_nvfp4_<N>_s, its phases and peak memory")
    return p.parse_args(argv)


class QuantBench:
    def __init__(self, args: argparse.Namespace):
        from bench.run_8b import pick_work_dir

        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = pick_work_dir(args.work)
        self.target = Path(args.target) if args.target else self.work / "models" / "target"
        self.drafter = Path(args.drafter) if args.drafter else self.work / "models" / "drafter"
        self.run_dir = Path(args.run_dir) if args.run_dir else self.work / "runs" / "qbench"
        self.results: dict = {"argv": sys.argv, "variants": {}}

    def overrides(self, extra: list[str] = ()) -> list[str]:
        a = self.args
        n = a.samples - a.heldout
        base = [f"run_name={self.run_dir.name}", f"runs_root={self.run_dir.parent}", f"seed={a.seed}",
                f"target.path={self.target}", f"target.tokenizer={self.target}", f"target.device={a.device}",
                f"target.dtype={'float32' if a.tiny else 'bfloat16'}", f"drafter.path={self.drafter}",
                "drafter.format=auto", f"data.max_seq_len={a.seq_len}",
                f"quant.num_samples={n}", f"quant.heldout_samples={a.heldout}", f"quant.max_seq_len={a.seq_len}",
                f"quant.anchors_per_sequence={a.anchors}", f"quant.device={a.device}",
                f"target_quant.num_samples={a.target_samples}", f"target_quant.max_seq_len={a.seq_len}",
                f"target_quant.device={a.device}"]
        return base + list(extra) + a.extra.split()

    def build(self) -> None:
        """Random-weight target + drafter, synthetic blend and its cache, unless given."""
        from bench.shapes import QWEN3_8B, TINY, build_drafter, build_target, write_blend

        shapes = TINY if self.args.tiny else QWEN3_8B
        dev = self.args.device
        if not (self.target / "config.json").is_file():
            self.results["build_target"] = build_target(shapes, self.target, dev, self.args.seed)
        if not (self.drafter / "config.json").is_file():
            self.results["build_drafter"] = build_drafter(shapes, self.drafter, self.target, dev, self.args.seed)
        if not (self.run_dir / "data" / "meta.json").is_file():
            (self.run_dir / "data").mkdir(parents=True, exist_ok=True)
            write_blend(shapes, self.run_dir / "data", self.target, self.args.samples, self.args.seq_len,
                        self.args.seed)
        if not (self.run_dir / "cache" / "index.json").is_file():
            self.results["cache"] = self.probe("cache", "cache", [])

    def probe(self, key: str, stage: str, extra: list[str]) -> dict:
        """One stage in its own process under bench.probe; the probe record + the stage's result."""
        probe = self.work / "probes" / f"{key}.json"
        cmd = [sys.executable, "-m", "bench.probe", str(probe), stage, *self.overrides(extra)]
        print(f"[quant-bench] $ {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = run_process(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                         cwd=Path(__file__).resolve().parent.parent).returncode
        rec = json.loads(probe.read_text()) if probe.is_file() else {}
        rec.update({"rc": rc, "process_wall_s": round(time.perf_counter() - t0, 3)})
        return rec

    def stage_record(self, stage: str, extra: list[str]) -> dict:
        name = next(e.split("=", 1)[1] for e in reversed(extra) if e.startswith(("quant.name=", "quant=",
                                                                                   "target_quant=")))
        path = self.run_dir / "stages" / f"{stage}-{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def stage_result(self, stage: str, extra: list[str]) -> dict:
        return self.stage_record(stage, extra).get("result", {})

    def run(self) -> dict:
        self.build()
        for key in [v.strip() for v in self.args.variants.split(",") if v.strip()]:
            if key not in VARIANTS:
                raise SystemExit(f"unknown variant {key!r}; choose from {', '.join(VARIANTS)}")
            stage, extra = VARIANTS[key]
            rec = self.probe(key, stage, extra)
            record = self.stage_record(stage, extra)
            result = record.get("result", {})
            rec.update({k: result.get(k) for k in ("timings", "device", "num_calibration_samples",
                                                    "num_calibration_anchors", "num_calibration_tokens",
                                                    "observer", "scheme")})
            rec["check"] = result.get("check")
            rec["stage_wall_time_s"] = record.get("wall_time_s")
            rec["command"] = "python -m pipeline " + " ".join([stage, *self.overrides(extra)])
            rec["versions"], rec["git"] = record.get("versions"), record.get("git")
            search = result.get("activation_scale_search") or {}
            rec["activation_scale_search"] = {"samples": search.get("samples"),
                                              "candidates": 2 + len(search.get("multipliers") or [])} if search else None
            rec["hashing"] = {k: record.get(k) for k in ("bytes_hashed", "files_hashed", "hash_reused") if k in record}
            self.results["variants"][key] = rec
            self.save()
        return self.results

    def save(self) -> None:
        (self.out / "quant_bench.json").write_text(json.dumps(self.results, indent=2, sort_keys=True) + "\n")
        (self.out / "quant_bench.md").write_text(markdown(self.results))

    def headline(self, results_dir: Path) -> Path | None:
        """<results_dir>/<date>-<gpu>-quant.json for the NVFP4 drafter (issue 20, part 2); None if it did not run."""
        rec = self.results["variants"].get("drafter-nvfp4-expanded-mse")
        if not rec:
            return None
        n = self.args.samples - self.args.heldout
        timings = dict(rec.get("timings") or {})
        peak = {k: timings.pop(k) for k in list(timings) if k.startswith(("peak_gpu", "peak_host"))}
        doc = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gpu": gpu_name(),
               f"quantize_drafter_nvfp4_{n}_s": rec.get("stage_wall_time_s"), "goal_s": 60.0, "rc": rec.get("rc"),
               "phases_s": timings, **peak,
               "probe": {k: rec.get(k) for k in ("wall_s", "process_wall_s", "gpu_peak_alloc_mib",
                                                   "gpu_peak_reserved_mib", "host_peak_anon_mib", "host_maxrss_mib")},
               "calibration": {"samples": rec.get("num_calibration_samples"),
                               "anchors": rec.get("num_calibration_anchors"),
                               "tokens": rec.get("num_calibration_tokens"), "seq_len": self.args.seq_len,
                               "activation_scale_search": rec.get("activation_scale_search")},
               "hashing": rec.get("hashing"), "command": rec.get("command"), "bench_argv": sys.argv,
               "versions": rec.get("versions"), "git": rec.get("git"),
               "baseline_run4": {"date": "2026-11-30", "gpu": "NVIDIA H200", "quantize_drafter_nvfp4_256_s": 123.6,
                                 "phases_s": {"load_s": 10.8, "oneshot_s": 41.0, "scale_search_s": 34.5,
                                              "write_s": 3.0, "check_s": 8.5},
                                 "peak_gpu": "24.1 GiB", "source": "docs/benchmarks.md, run 4"}}
        results_dir.mkdir(parents=True, exist_ok=True)
        path = results_dir / f"{time.strftime('%Y-%m-%d', time.gmtime())}-{gpu_slug(doc['gpu'])}-quant.json"
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        return path


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200" (file names in bench/results/)."""
    import re

    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words[:2]) or "gpu"


def markdown(results: dict) -> str:
    rows = ["| variant | rc | wall s | load / oneshot / scale search / write / check s | calib samples x anchors | "
            "peak GPU alloc MiB | peak host RSS MiB | top-1 vs bf16 (served) |",
            "|---|---|---|---|---|---|---|---|"]
    for key, r in results.get("variants", {}).items():
        t = r.get("timings") or {}
        phases = " / ".join(str(t.get(k, "-")) for k in ("load_s", "oneshot_s", "scale_search_s", "write_s", "check_s"))
        served = ((r.get("check") or {}).get("served") or {}).get("top1_agreement")
        rows.append(f"| {key} | {r.get('rc')} | {r.get('wall_s')} | {phases} | "
                    f"{r.get('num_calibration_samples')} x {r.get('num_calibration_anchors')} | "
                    f"{r.get('gpu_peak_alloc_mib', '-')} | {r.get('host_peak_rss_mib')} | "
                    f"{'-' if served is None else round(served, 4)} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = QuantBench(args)
    print(f"[quant-bench] work dir {bench.work} ({shutil.disk_usage(bench.work).free / 2**30:.0f} GiB free)",
          flush=True)
    results = bench.run()
    print(markdown(results), flush=True)
    if args.results:
        path = bench.headline(Path(args.results))
        print(f"[quant-bench] {path or 'no headline: the drafter-nvfp4-expanded-mse variant did not run'}", flush=True)
        if path:
            print(path.read_text(), flush=True)
    return 0 if all(r.get("rc") == 0 for r in results["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
