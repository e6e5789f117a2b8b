"""The whole pipeline at Qwen3-8B / DFlash-b16 shapes (random weights), against the stock tools.

    python -m bench.run_8b --out OUT [--phases build,data,cache,profile,quant,stock,manifest]
    python -m bench.run_8b --out OUT --tiny --device cpu          # smoke test on a CPU (= --shape tiny)
    python -m bench.run_8b --out OUT --phases build,data,dist --nproc 2   # cache: one vs N GPUs
    python -m bench.run_8b --out OUT --phases build,data,disttarget --nproc 2  # GPTQ target: one vs N

Every stage runs as `python -m bench.probe ... <stage> <overrides>` (= `python -m pipeline <stage>`
plus wall time and peak GPU / host memory), in a work directory on the machine's local disk.
Results accumulate in OUT/results.json after every phase (a run cut short still reports what it
measured) and OUT/results.md holds the table for docs/benchmarks.md. Phases whose inputs are
missing build them first, so any phase can be asked for alone.

The hybrid target family (Qwen3.5 / Qwen3.8: `Qwen3_5ForCausalLM`, Gated DeltaNet + full attention 3:1)
runs the same phases with `--shape qwen3.8-27b` (its text tower, random weights, with a DFlash b16 drafter
of 5 layers at width 5120; bench/shapes.py) or `--shape tiny-hybrid` (CPU smoke test). On one H200:

    python -m bench.run_8b --out OUT --shape qwen3.8-27b --work /root/w --runs /dev/shm/runs \\
        --phases build,data,cache,quant --samples 64

The target (54 GB in bf16) is built on the GPU and written in 5 GB safetensors shards; the quant phase of a
hybrid shape makes only quantize-target[w4a16] unless --quant-variants says otherwise. With --samples 64 the
second (host-memory) cache holds 16 samples (--small-samples). A results.json holds one shape's records
(each labelled with it): use another --out for another shape.
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

from bench import report
from bench.shapes import SHAPES, build_drafter, build_target, dir_bytes, write_blend

ALL_PHASES = ("build", "data", "cache", "profile", "quant", "stock", "manifest")
DENSE_QUANT_VARIANTS = "quantize-drafter[nvfp4],quantize-drafter[w4a16],quantize-target[w4a16]"
HYBRID_QUANT_VARIANTS = "quantize-target[w4a16]"  # the drafter's quantization does not depend on the target family
SMOKE_DEFAULTS = {"tiny-hybrid": {"samples": 24, "seq_len": 512}}  # --samples / --seq-len where not given


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json / results.md / probe records")
    p.add_argument("--work", default="auto", help="work folder on local disk (auto: the largest free of "
                   "/tmp, /var/tmp, /root, the current folder)")
    p.add_argument("--runs", default=None, help="runs_root (default WORK/runs), e.g. on a tmpfs")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shapes (bench/shapes.py): qwen3-8b (default), tiny (CPU smoke test), qwen3.8-27b "
                   "(the hybrid Qwen3_5ForCausalLM target), tiny-hybrid (its CPU smoke test)")
    p.add_argument("--tiny", action="store_true", help="the same as --shape tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--phases", default=",".join(ALL_PHASES))
    p.add_argument("--samples", type=int, default=None, help="blend samples = cached samples; the drafter "
                   "calibrates on all but --heldout of them (default 264; tiny-hybrid: 24)")
    p.add_argument("--heldout", type=int, default=8, help="cached samples held apart for the drafter check")
    p.add_argument("--small-samples", type=int, default=None, help="second cache size, for host memory "
                   "(default: 64, or a quarter of --samples when that is smaller)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048; tiny-hybrid: 512)")
    p.add_argument("--target-samples", type=int, default=64, help="target calibration samples (GPTQ/NVFP4)")
    p.add_argument("--quant-variants", default=None,
                   help=f"which quantize runs the quant phase makes, in order (default {DENSE_QUANT_VARIANTS}; "
                   f"for a hybrid shape {HYBRID_QUANT_VARIANTS})")
    p.add_argument("--nproc", type=int, default=2, help="processes for the `dist` phase (torchrun)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile-reps", type=int, default=3)
    p.add_argument("--serve-python", default=None, help="interpreter with vLLM, for the `serve` phase")
    p.add_argument("--serve-prompts", type=int, default=8, help="prompts (random words) for the `serve` phase")
    p.add_argument("--peer-variants", default="stock,hf1,hf4,fp8,vllmraw,vllm,compile",
                   help="the `peers` phase: which of stock, hf1, hf4, fp8, vllmraw, vllm, compile to run")
    p.add_argument("--extra", default="", help="extra Hydra overrides for every stage, space-separated")
    args = p.parse_args(argv)
    if args.tiny and args.shape not in (None, "tiny"):
        p.error(f"--tiny means --shape tiny, not --shape {args.shape}")
    args.shape = "tiny" if args.tiny else (args.shape or "qwen3-8b")
    args.tiny = args.shape.startswith("tiny")  # small shapes (CPU smoke tests)
    # transformers' reference PyTorch Gated DeltaNet (no flash-linear-attention on a CPU) runs ~2k tok/s at the
    # tiny hybrid shape on one CPU core: its smoke test caches 12k tokens, not the 540k of the defaults
    small = SMOKE_DEFAULTS.get(args.shape, {})
    args.samples = args.samples if args.samples is not None else small.get("samples", 264)
    args.seq_len = args.seq_len if args.seq_len is not None else small.get("seq_len", 2048)
    if args.quant_variants is None:
        args.quant_variants = HYBRID_QUANT_VARIANTS if SHAPES[args.shape].hybrid else DENSE_QUANT_VARIANTS
    if args.small_samples is None:
        args.small_samples = min(64, max(1, args.samples // 4))
    if not 0 <= args.heldout < args.samples:
        p.error(f"--heldout {args.heldout} must leave calibration samples out of --samples {args.samples}")
    return args


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.shapes = SHAPES[args.shape]
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = pick_work_dir(args.work)
        self.models = self.work / "models"
        self.runs = Path(args.runs) if args.runs else self.work / "runs"
        self.results_path = self.out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.is_file() else {}
        had = self.results.get("shape")
        if had and had != self.shapes.name:
            raise SystemExit(f"{self.results_path} holds {had}'s records, not {self.shapes.name}'s: use another --out")
        self.results["shape"] = self.shapes.name
        self.results["shape_config"] = shape_summary(self.shapes)
        self.results.setdefault("env", report.environment(self.work))
        self.results["env"]["argv"] = sys.argv
        self.results.setdefault("phases", {})
        self.save()

    # ---- bookkeeping -------------------------------------------------------------------------
    def save(self) -> None:
        tmp = self.results_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, self.results_path)
        (self.out / "results.md").write_text(shape_line(self.results) + report.markdown(self.results))

    def record(self, key: str, value: dict) -> None:
        value = {"shape": self.shapes.name, **value}
        self.results["phases"][key] = value
        self.save()
        print(f"[bench] {key}: {json.dumps(value, default=str)[:600]}", flush=True)

    def overrides(self, run: str, extra: list[str] = ()) -> list[str]:
        t, d = self.models / "target", self.models / "drafter"
        base = [f"run_name={run}", f"runs_root={self.runs}", f"seed={self.args.seed}",
                f"target.path={t}", f"target.tokenizer={t}", f"target.name={self.shapes.name}-shape-random",
                f"target.device={self.args.device}", "target.dtype=bfloat16",
                f"drafter.path={d}", "drafter.format=speculators",
                f"drafter.name=dflash-b{self.shapes.block_size}-{self.shapes.name}-shape-random",
                f"data.max_seq_len={self.args.seq_len}"]
        return base + list(extra) + self.args.extra.split()

    def stage(self, key: str, stage: str, run: str, extra: list[str] = (), nproc: int = 1) -> dict:
        """Run one pipeline stage under the probe; returns the probe record + the stage's own record."""
        probe = self.work / "probes" / f"{key}.json"
        cmd = [sys.executable, "-m", "bench.probe", str(probe), stage, *self.overrides(run, extra)]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "bench.probe", str(probe), stage, *self.overrides(run, extra)]
        print(f"[bench] $ {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        wall = time.perf_counter() - t0
        rec: dict = {"command": "python -m pipeline " + " ".join([stage, *self.overrides(run, extra)]),
                     "rc": rc, "process_wall_s": round(wall, 2), "nproc": nproc}
        probes = sorted(probe.parent.glob(f"{key}.rank*.json")) if nproc > 1 else [probe]
        rec["probe"] = [json.loads(p.read_text()) for p in probes if p.is_file()]
        stage_json = self.runs / run / "stages" / f"{stage_file(stage, extra)}.json"
        if stage_json.is_file():
            rec["stage_record"] = {k: v for k, v in json.loads(stage_json.read_text()).items()
                                   if k in ("wall_time_s", "result", "device", "versions", "bytes_hashed",
                                            "files_hashed", "hash_reused", "hashed_files")}
        return rec

    # ---- phases ------------------------------------------------------------------------------
    def _built_shape(self) -> bool:
        """Whether the models in the work folder are this shape's (a work folder another shape used is rebuilt)."""
        t, d = self.models / "target" / "config.json", self.models / "drafter" / "config.json"
        if not (t.is_file() and d.is_file()):
            return False
        cfg, s = json.loads(t.read_text()), self.shapes
        want = {"model_type": "qwen3_5_text" if s.hybrid else "qwen3", "hidden_size": s.hidden_size,
                "vocab_size": s.vocab_size, "num_hidden_layers": s.num_target_layers,
                "intermediate_size": s.intermediate_size}
        return all(cfg.get(k) == v for k, v in want.items())

    def build(self) -> None:
        if self._built_shape():
            return
        if (self.models / "target" / "config.json").is_file():  # another shape's models: its blends are stale too
            print(f"[bench] {self.models} holds another shape's models: rebuilding them, dropping the bench runs",
                  flush=True)
            for run in ("bench", "bench-small"):
                shutil.rmtree(self.runs / run, ignore_errors=True)
        shutil.rmtree(self.models, ignore_errors=True)
        t = build_target(self.shapes, self.models / "target", self.args.device, self.args.seed)
        d = build_drafter(self.shapes, self.models / "drafter", self.models / "target", self.args.device,
                          self.args.seed)
        self.record("build", {"target": t, "drafter": d})

    def data(self) -> None:
        self.build()
        for run, n in (("bench", self.args.samples), ("bench-small", self.args.small_samples)):
            if (self.runs / run / "data" / "meta.json").is_file():
                continue
            t0 = time.perf_counter()
            info = write_blend(self.shapes, self.runs / run / "data", self.models / "target", n,
                               self.args.seq_len, self.args.seed)
            info["write_s"] = round(time.perf_counter() - t0, 2)
            self.record(f"data[{run}]", info)

    def _cache_done(self, run: str) -> bool:
        return (self.runs / run / "cache" / "index.json").is_file()

    def cache(self) -> None:
        self.data()
        for run in ("bench-small", "bench"):
            if self._cache_done(run) and f"cache[{run}]" in self.results["phases"]:
                continue
            rec = self.stage(f"cache-{run}", "cache", run)
            rec.update(report.cache_summary(self.runs / run, rec))
            self.record(f"cache[{run}]", rec)
        # the small cache only served to show host memory is flat: free its disk for later stages
        shutil.rmtree(self.runs / "bench-small" / "cache", ignore_errors=True)

    def profile(self) -> None:
        from bench.profile_cache import profile

        self.build()
        aux = [i + 1 for i in self.shapes.zlab_layer_ids]
        batch = 4 if not self.args.tiny else 2  # args.tiny: any tiny shape
        res = profile(str(self.models / "target"), aux, self.args.device, batch, self.args.seq_len,
                      self.args.profile_reps, write_dir=str(self.work))
        self.record("profile", res)
        _empty()
        stock_bench = Path(__file__).with_name("cache_bench.py")
        if stock_bench.is_file() and self._cache_done("bench"):
            self.record("cache_bench", run_cache_bench(self, aux))

    def cachebench(self) -> None:
        """Only helper C's side-by-side (bench/cache_bench.py: stock vs capture vs stage)."""
        self.build()
        self.record("cache_bench", run_cache_bench(self, [i + 1 for i in self.shapes.zlab_layer_ids]))

    def quant(self) -> None:
        wanted = [v.strip() for v in self.args.quant_variants.split(",") if v.strip()]
        if any(v.startswith("quantize-drafter") for v in wanted) and not self._cache_done("bench"):
            self.cache()  # the drafter calibrates on the cache; the target only needs the blend
        self.data()
        n = self.args.samples - self.args.heldout
        held = f"quant.heldout_samples={self.args.heldout}"
        n_target = min(self.args.target_samples, self.args.samples)  # the blend holds --samples
        variants = [
            ("quantize-drafter[nvfp4]", "quantize-drafter",
             ["quant=nvfp4", "quant.observer=nvfp4_expanded_mse", f"quant.num_samples={n}", held,
              f"quant.max_seq_len={self.args.seq_len}"]),
            ("quantize-drafter[w4a16]", "quantize-drafter", ["quant=w4a16", f"quant.num_samples={n}", held,
                                                             f"quant.max_seq_len={self.args.seq_len}"]),
            ("quantize-drafter[w4a16-gptq]", "quantize-drafter",
             ["quant=w4a16-gptq", f"quant.num_samples={n}", held, f"quant.max_seq_len={self.args.seq_len}"]),
            ("quantize-drafter[nvfp4a16-gptq]", "quantize-drafter",
             ["quant=nvfp4a16-gptq", f"quant.num_samples={n}", held, f"quant.max_seq_len={self.args.seq_len}"]),
            ("quantize-target[w4a16]", "quantize-target",
             ["target_quant=w4a16", f"target_quant.num_samples={n_target}",
              f"target_quant.max_seq_len={self.args.seq_len}"]),
        ]
        variants = sorted((v for v in variants if v[0] in wanted), key=lambda v: wanted.index(v[0]))
        for key, stage, extra in variants:
            if key in self.results["phases"] and self.results["phases"][key].get("rc") == 0:
                continue
            rec = self.stage(key.replace("[", "-").rstrip("]"), stage, "bench", extra)
            result = (rec.get("stage_record") or {}).get("result") or {}
            rec["tokens"] = result.get("num_calibration_tokens") or None
            wall = (rec.get("stage_record") or {}).get("wall_time_s")
            rec["tok_s"] = round(rec["tokens"] / wall) if rec["tokens"] and wall else None
            out_dir = self.runs / "bench" / ("drafter" if stage == "quantize-drafter" else "target") / extra[0].split("=")[1]
            rec["output_bytes"] = dir_bytes(out_dir) if out_dir.is_dir() else None
            self.record(key, rec)

    def serve(self) -> None:
        """serve-check at 8B shape: the quantized drafters beside the 36-layer target in vLLM.

        Random weights make acceptance meaningless, so the tau floors are off (min_tau 1.0, ratio 0.01):
        what is checked is that every drafter loads, which kernel vLLM builds, load time and GPU memory;
        outputs are compared with the target alone and with the bf16 drafter's (near-tie logits of a
        random model flip between vLLM's batch shapes, so exact equality is reported, not required).
        """
        import random

        self.build()
        have = {v for v in ("nvfp4", "w4a16") if (self.runs / "bench" / "drafter" / v / "config.json").is_file()}
        if have != {"nvfp4", "w4a16"}:
            self.quant()
        rng = random.Random(self.args.seed)
        prompts = self.work / "serve-prompts.jsonl"
        margin = min(1000, self.shapes.vocab_size // 4)  # clear of the special tokens at both ends
        words = range(margin, self.shapes.vocab_size - margin)
        prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.choice(words)}" for _ in range(64))}) + "\n"
                                   for _ in range(self.args.serve_prompts)))
        extra = [f"serve.python={self.args.serve_python}", "serve.min_tau=1.0", "serve.min_tau_ratio=0.01",
                 "serve.require_lossless=false",
                 "serve.parallel=4", "eval.name=random-words", "eval.max_new_tokens=64",
                 f"eval.prompt_sets=[{{name:random,path:{prompts},field:prompt}}]", "serve.targets=[bf16]"]
        rec = self.stage("serve-check", "serve-check", "bench", extra)
        sc = self.runs / "bench" / "eval" / "serve_check.json"
        if sc.is_file():
            summary = json.loads(sc.read_text())
            rec["serve_check"] = {k: {x: p.get(x) for x in ("ok", "load_s", "generate_s", "peak_gpu_bytes", "lossless",
                                                           "drafter_kernel", "target_kernel", "tau", "problems")}
                                  for k, p in summary["pairs"].items()}
            rec["targets_alone"] = summary.get("targets_alone")
            rec["versions"] = summary.get("versions")
        self.record("serve", rec)

    def paircache(self) -> None:
        """The cache stage on the quantized W4A16 target (loaded dequantized, cache.target=w4a16) next to
        the bf16 target's: tokens/s and peak GPU / host memory of each, same blend."""
        run = "bench-small"  # the --small-samples blend: both caches of the large one would not fit a 64 GiB disk
        self.data()
        if f"cache[{run}]" not in self.results["phases"]:
            rec = self.stage(f"cache-{run}", "cache", run)
            rec.update(report.cache_summary(self.runs / run, rec))
            self.record(f"cache[{run}]", rec)
        shutil.rmtree(self.runs / run / "cache", ignore_errors=True)
        if not (self.runs / run / "target" / "w4a16" / "config.json").is_file():
            extra = ["target_quant=w4a16", f"target_quant.num_samples={self.args.target_samples}",
                     f"target_quant.max_seq_len={self.args.seq_len}"]
            self.record(f"quantize-target[w4a16,{run}]", self.stage(f"quantize-target-w4a16-{run}", "quantize-target",
                                                                    run, extra))
        rec = self.stage(f"cache-{run}-w4a16", "cache", run, ["cache.target=w4a16"])
        rec.update(report.cache_summary(self.runs / run, rec, target="w4a16"))
        self.record(f"cache[{run},target=w4a16]", rec)
        shutil.rmtree(self.runs / run / "cache-w4a16", ignore_errors=True)
        shutil.rmtree(self.runs / run / "target", ignore_errors=True)

    # ---- the cache stage against its peers (issue 20): one run, one GPU, the same target and samples
    PEER_CACHE = {"hf1": ["cache.shards_in_flight=1"], "hf4": ["cache.shards_in_flight=4"], "hf8": ["cache.shards_in_flight=8"],
                  "fp8": ["cache.shards_in_flight=4", "cache.storage_dtype=fp8"],
                  "vllm": ["cache.shards_in_flight=4", "cache.engine=vllm"],
                  "vllm8": ["cache.shards_in_flight=8", "cache.engine=vllm"],
                  "vllm1g": ["cache.shards_in_flight=4", "cache.engine=vllm", "cache.max_shard_bytes=1073741824"],
                  "vllm512m": ["cache.shards_in_flight=4", "cache.engine=vllm", "cache.max_shard_bytes=536870912"],
                  "compile": ["cache.shards_in_flight=4", "cache.compile_layers=true"]}

    def peers(self) -> None:
        self.data()
        aux = [i + 1 for i in self.shapes.zlab_layer_ids]
        for v in [x.strip() for x in self.args.peer_variants.split(",") if x.strip()]:
            if v == "stock":
                out = self.work / "probes" / "peer-stock.json"
                cmd = [sys.executable, "-m", "bench.cache_bench", "--target", str(self.models / "target"),
                       "--device", self.args.device, "--seq-len", str(self.args.seq_len), "--json", str(out),
                       "--batches", "12", "--warmup", "2", "--modes", "stock"]
                out.parent.mkdir(parents=True, exist_ok=True)
                print(f"[bench] $ {' '.join(cmd)}", flush=True)
                rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
                res = json.loads(out.read_text())["results"][0] if out.is_file() else {}
                self.record("peer[stock]", {"rc": rc, "command": " ".join(cmd[1:]), **res})
            elif v == "vllmraw":
                self.record("peer[vllmraw]", self._vllm_raw(aux))
            elif v in self.PEER_CACHE:
                run = f"peer-{v}"
                src, dst = self.runs / "bench" / "data", self.runs / run / "data"
                if not dst.is_dir():
                    shutil.copytree(src, dst)
                shutil.rmtree(self.runs / run / "cache", ignore_errors=True)
                extra = list(self.PEER_CACHE[v])
                if v.startswith("vllm"):
                    extra.append(f"serve.python={self.args.serve_python or 'python3'}")
                rec = self.stage(f"peer-{v}", "cache", run, extra)
                rec.update(report.cache_summary(self.runs / run, rec))
                eng = ((rec.get("stage_record") or {}).get("result") or {}).get("engine") or {}
                if eng.get("load_s") and rec.get("tokens"):
                    secs = ((rec.get("stage_record") or {}).get("result") or {}).get("seconds")
                    rec["tok_s_steady"] = round(rec["tokens"] / (secs - eng["load_s"])) if secs else None
                    rec["engine_load_s"], rec["engine_extract_s"] = eng["load_s"], eng.get("extract_s")
                    if secs and eng.get("stop_s") is not None:  # without vLLM's start-up and teardown
                        rec["engine_stop_s"] = eng["stop_s"]
                        rec["tok_s_running"] = round(rec["tokens"] / (secs - eng["load_s"] - eng["stop_s"]))
                self.record(f"peer[{v}]", rec)
                shutil.rmtree(self.runs / run / "cache", ignore_errors=True)  # memory for the next one (tmpfs)
            else:
                raise SystemExit(f"unknown peer variant {v!r}")

    def _vllm_raw(self, aux: list[int]) -> dict:
        """vLLM's extract_hidden_states alone, writing its own files (nobody reads them), all samples at once."""
        samples = self.runs / "bench" / "data" / "samples.jsonl"
        n = sum(1 for _ in samples.open())
        scratch = self.runs / "vllm-raw"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        job = {"target": str(self.models / "target"), "aux_layer_ids": aux, "samples": str(samples),
               "chunks": [list(range(n))], "out_dir": str(scratch), "dtype": "bfloat16",
               "max_model_len": self.args.seq_len + 8, "max_num_batched_tokens": 8192, "backlog": 1 << 30,
               "gpu_memory_utilization": 0.85}
        job_file = self.work / "probes" / "vllm-raw.job.json"
        job_file.parent.mkdir(parents=True, exist_ok=True)
        job_file.write_text(json.dumps(job))
        cmd = [self.args.serve_python or "python3", "-m", "pipeline.serving.extract", str(job_file)]
        from pipeline.serving.extract_stream import _worker_env

        env = {**_worker_env(), "PYTHONUNBUFFERED": "1"}  # vLLM's interpreter, as the stage starts it
        print(f"[bench] $ {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env).returncode
        wall = time.perf_counter() - t0
        res = json.loads((scratch / "result.json").read_text()) if (scratch / "result.json").is_file() else {}
        files = [p for p in scratch.glob("*.safetensors")]
        rec = {"rc": rc, "command": " ".join(cmd[1:]), "process_wall_s": round(wall, 2), **res,
               "files": len(files), "bytes": sum(p.stat().st_size for p in files)}
        if res.get("extract_s") and res.get("tokens"):
            rec["tok_s"] = round(res["tokens"] / res["extract_s"])
            rec["bytes_per_token"] = round(rec["bytes"] / res["tokens"], 1)
        shutil.rmtree(scratch, ignore_errors=True)
        return rec

    def peersreport(self) -> None:
        """bench/results/<date>-<gpu>-cache.json's keys, from the peers phase's records."""
        ph = self.results["phases"]
        # the vLLM engine's rate is counted like its peer's `extract_s`: without vLLM's start-up and teardown
        # (`tok_s_running`; the stage's own start-up and tail stay in); the HF engine's without the target load
        tok = lambda k, f="tok_s_steady": ((ph.get(k) or {}).get("tok_s_running") if f == "tok_s_steady" else None) \
            or (ph.get(k) or {}).get(f) or (ph.get(k) or {}).get("tok_s")  # noqa: E731
        stock = (ph.get("peer[stock]") or {}).get("tokens_per_s")
        vllm = tok("peer[vllmraw]", "tok_s")
        # the stage's best bf16-storage configuration, either engine (which one is named beside it)
        bf16_runs = {v: tok(f"peer[{v}]") for v in ("hf1", "hf4", "hf8", "vllm", "vllm8", "vllm1g", "vllm512m")}
        best = max((v for v in bf16_runs if bf16_runs[v]), key=lambda v: bf16_runs[v], default=None)
        bf16 = bf16_runs[best] if best else None
        flop = report.flop_limit(self.shapes, self.args.seq_len, [i + 1 for i in self.shapes.zlab_layer_ids])
        import datetime

        gpu = ((self.results.get("env") or {}).get("gpus") or ["none"])[0]
        out = {"date": datetime.date.today().isoformat(), "gpu": gpu, "command": " ".join(sys.argv),
               "stock_hf_tok_s": stock, "vllm_extract_tok_s": vllm, "cache_bf16_tok_s": bf16,
               "cache_bf16_config": best, "cache_hf_engine_bf16_tok_s": max([bf16_runs[v] for v in ("hf1", "hf4", "hf8")
                                                                         if bf16_runs[v]] or [0]) or None,
               "cache_fp8_tok_s": tok("peer[fp8]"), "cache_vllm_engine_tok_s": tok("peer[vllm]"),
               "cache_vllm_engine_1g_shards_tok_s": tok("peer[vllm1g]"),
               "cache_vllm_engine_512m_shards_tok_s": tok("peer[vllm512m]"),
               "cache_compile_tok_s": tok("peer[compile]"), "cache_bf16_1_shard_in_flight_tok_s": tok("peer[hf1]"),
               "cache_bf16_4_shards_in_flight_tok_s": tok("peer[hf4]"), "flop_limit_tok_s": flop,
               "cache_bf16_vs_stock": round(bf16 / stock, 3) if bf16 and stock else None,
               "cache_bf16_vs_vllm": round(bf16 / vllm, 3) if bf16 and vllm else None,
               "content_sha256": {k: (ph.get(f"peer[{k}]") or {}).get("content_sha256")
                                  for k in ("hf1", "hf4", "fp8", "vllm", "vllm1g", "vllm512m", "compile")}}
        eng, raw = ph.get("peer[vllm]") or {}, ph.get("peer[vllmraw]") or {}
        if eng.get("tok_s_running") and raw.get("extract_s"):  # where the vLLM engine's time goes, against its peer
            secs = eng["stage_record"]["result"]["seconds"]
            out["vllm_engine_profile_s"] = {
                "stage": secs, "vllm_load": eng["engine_load_s"], "vllm_extract": eng["engine_extract_s"],
                "vllm_teardown": eng["engine_stop_s"], "vllm_extract_alone": raw["extract_s"],
                "stage_start_and_tail": round(secs - eng["engine_load_s"] - eng["engine_extract_s"]
                                              - eng["engine_stop_s"], 3)}
            out["cache_vllm_engine_steady_tok_s"] = eng.get("tok_s_steady")  # with vLLM's teardown
        h = out["content_sha256"]
        out["hf1_equals_hf4"] = bool(h["hf1"]) and h["hf1"] == h["hf4"]
        (self.out / "cache-peers.json").write_text(json.dumps(out, indent=2) + "\n")
        self.record("peersreport", out)

    def stock(self) -> None:
        """Plain llm-compressor oneshot on the target, same scheme as quantize-target (the baseline)."""
        self.build()
        probe = self.work / "probes" / "stock-oneshot-target.json"
        out_dir = self.work / "stock-target-w4a16"
        cmd = [sys.executable, "-m", "bench.stock_target", "--target", str(self.models / "target"),
               "--out-dir", str(out_dir), "--probe", str(probe), "--device", self.args.device]
        print(f"[bench] $ {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        rec = json.loads(probe.read_text()) if probe.is_file() else {}
        rec.update({"rc": rc, "command": " ".join(cmd[1:])})
        self.record("stock-oneshot-target[w4a16]", rec)
        shutil.rmtree(out_dir, ignore_errors=True)

    def manifest(self) -> None:
        rec = self.stage("manifest", "manifest", "bench")
        self.record("manifest", rec)

    def hashreport(self) -> None:
        """Hash once (issue 18) at 8B shape: bytes read for hashing by the cache, quantize-drafter,
        quantize-target and manifest stages of the `bench` run, from their stage records; "without the
        memo" adds the bytes a remembered digest saved (`hash_reused`)."""
        stages = self.runs / "bench" / "stages"
        target = str((self.models / "target").resolve())
        rows, total, saved = {}, 0, 0
        for f in sorted(stages.glob("*.json")) if stages.is_dir() else []:
            if not f.stem.startswith(("cache", "quantize-drafter", "quantize-target", "manifest")):
                continue
            r = json.loads(f.read_text())
            if "bytes_hashed" not in r:
                continue
            reused = int((r.get("hash_reused") or {}).get("bytes", 0))
            tgt = sum(int(b) for k, b in (r.get("hashed_files") or {}).items() if str(k).startswith((target, str(self.models / "target"))))
            rows[f.stem] = {"bytes_hashed": int(r["bytes_hashed"]), "files_hashed": r.get("files_hashed"),
                            "reused_bytes": reused, "target_bytes_hashed": tgt}
            total, saved = total + int(r["bytes_hashed"]), saved + reused
        target_bytes = sum(p.stat().st_size for p in (self.models / "target").glob("*.safetensors"))
        out = {"stages": rows, "bytes_hashed": total, "bytes_without_memo": total + saved,
               "target_weight_bytes": target_bytes,
               "stages_hashing_target": sorted(k for k, v in rows.items() if v["target_bytes_hashed"])}
        (self.out / "hash-once.json").write_text(json.dumps(out, indent=2) + "\n")
        self.record("hashreport", out)

    def disttarget(self) -> None:
        """quantize-target GPTQ W4A16 on 1 process then N (torchrun, llm-compressor's distributed
        oneshot): wall time, memory, and whether the checkpoints are identical."""
        self.data()
        extra = ["target_quant=w4a16", "target_quant.algorithm=gptq", "target_quant.calibration=cache",
                 "target_quant.pipeline=sequential", f"target_quant.num_samples={self.args.target_samples}",
                 f"target_quant.max_seq_len={self.args.seq_len}"]
        recs = {}
        for nproc in (1, self.args.nproc):
            key = f"quantize-target[gptq,n{nproc}]"
            if key in self.results["phases"] and self.results["phases"][key].get("rc") == 0:
                recs[nproc] = self.results["phases"][key]
                continue
            run = f"bench-gptq-n{nproc}"
            shutil.rmtree(self.runs / run, ignore_errors=True)
            shutil.copytree(self.runs / "bench" / "data", self.runs / run / "data")
            rec = self.stage(f"quantize-target-gptq-n{nproc}", "quantize-target", run, extra, nproc=nproc)
            out_dir = self.runs / run / "target" / "w4a16"
            rec["output_bytes"] = dir_bytes(out_dir) if out_dir.is_dir() else None
            result = (rec.get("stage_record") or {}).get("result") or {}
            rec["outputs"] = result.get("outputs")
            rec["tokens"] = result.get("num_calibration_tokens")
            rec["weight_error"] = (result.get("check") or {}).get("weight_error")
            self.record(key, rec)
            recs[nproc] = rec
        one, many = recs.get(1, {}), recs.get(self.args.nproc, {})
        w1 = (one.get("stage_record") or {}).get("wall_time_s")
        wn = (many.get("stage_record") or {}).get("wall_time_s")
        t1 = ((one.get("stage_record") or {}).get("result") or {}).get("timings") or {}
        tn = ((many.get("stage_record") or {}).get("result") or {}).get("timings") or {}
        summary = {"wall_1": w1, f"wall_{self.args.nproc}": wn,
                   "speedup_wall": round(w1 / wn, 3) if w1 and wn else None,
                   "oneshot_1": t1.get("oneshot_s"), f"oneshot_{self.args.nproc}": tn.get("oneshot_s"),
                   "speedup_oneshot": round(t1["oneshot_s"] / tn["oneshot_s"], 3)
                   if t1.get("oneshot_s") and tn.get("oneshot_s") else None,
                   "weight_error_1": one.get("weight_error"), f"weight_error_{self.args.nproc}": many.get("weight_error"),
                   "identical_outputs": bool(one.get("outputs")) and one.get("outputs") == many.get("outputs"),
                   "differing_files": sorted(k for k in (one.get("outputs") or {})
                                             if (one.get("outputs") or {}).get(k) != (many.get("outputs") or {}).get(k))}
        if not summary["identical_outputs"] and one.get("outputs") and many.get("outputs"):
            summary["weight_diff"] = compare_checkpoints(self.runs / "bench-gptq-n1" / "target" / "w4a16",
                                                         self.runs / f"bench-gptq-n{self.args.nproc}" / "target" / "w4a16")
        self.record(f"quantize-target[gptq,1-vs-{self.args.nproc}]", summary)
        for nproc in (1, self.args.nproc):
            shutil.rmtree(self.runs / f"bench-gptq-n{nproc}" / "target", ignore_errors=True)

    def dist(self) -> None:
        """Cache with 1 process then with N (torchrun): throughput and content hash, same machine."""
        self.data()
        if not self._cache_done("bench"):
            rec = self.stage("cache-bench", "cache", "bench")
            rec.update(report.cache_summary(self.runs / "bench", rec))
            self.record("cache[bench]", rec)
        name = f"bench-n{self.args.nproc}"
        shutil.rmtree(self.runs / name, ignore_errors=True)
        shutil.copytree(self.runs / "bench" / "data", self.runs / name / "data")
        rec = self.stage(f"cache-{name}", "cache", name, nproc=self.args.nproc)
        rec.update(report.cache_summary(self.runs / name, rec))
        one = self.results["phases"]["cache[bench]"]
        rec["content_hash_equal"] = (rec.get("content_sha256") is not None
                                     and rec.get("content_sha256") == one.get("content_sha256"))
        for key in ("tok_s", "tok_s_steady", "tok_s_end_to_end"):
            if one.get(key) and rec.get(key):
                rec[f"speedup_{key}"] = round(rec[key] / one[key], 3)
        rec["speedup"] = rec.get("speedup_tok_s_steady") or rec.get("speedup_tok_s")
        rec["scaling_efficiency"] = round(rec["speedup"] / self.args.nproc, 3) if rec["speedup"] else None
        self.record(f"cache[{name}]", rec)
        shutil.rmtree(self.runs / name / "cache", ignore_errors=True)  # disk for the later phases


def shape_summary(s) -> dict:
    """The shape's defining numbers, for results.json."""
    out = {"name": s.name, "target_architecture": s.target_architecture, "hidden_size": s.hidden_size,
           "vocab_size": s.vocab_size, "target_layers": s.num_target_layers, "drafter_layers": s.drafter_layers,
           "block_size": s.block_size, "aux_layer_ids": [i + 1 for i in s.zlab_layer_ids]}
    if s.hybrid:
        kinds = s.hybrid_target["layer_types"]
        out["layer_mix"] = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    return out


def shape_line(results: dict) -> str:
    c = results.get("shape_config") or {}
    if not c:
        return ""
    mix = ", ".join(f"{n} {k}" for k, n in (c.get("layer_mix") or {}).items())
    return (f"Shape: {c['name']} (random weights): target {c['target_architecture']}, {c['target_layers']} layers"
            f"{f' ({mix})' if mix else ''}, hidden {c['hidden_size']}, vocabulary {c['vocab_size']}; DFlash drafter "
            f"{c['drafter_layers']} layers, block {c['block_size']}, aux layers {c['aux_layer_ids']}\n\n")


def compare_checkpoints(a: Path, b: Path) -> dict:
    """How far two compressed checkpoints of the same model differ, tensor by tensor (the stages
    write one model.safetensors)."""
    from safetensors import safe_open

    out = {"tensors": 0, "differing": 0, "max_frac_elements_differing": 0.0}
    with safe_open(str(a / "model.safetensors"), "pt") as ha, safe_open(str(b / "model.safetensors"), "pt") as hb:
        for key in ha.keys():
            x, y = ha.get_tensor(key), hb.get_tensor(key)
            out["tensors"] += 1
            if x.shape != y.shape or not bool((x == y).all()):
                out["differing"] += 1
                frac = float((x != y).float().mean()) if x.shape == y.shape else 1.0
                out["max_frac_elements_differing"] = max(out["max_frac_elements_differing"], round(frac, 6))
    return out


def stage_file(stage: str, extra: list[str]) -> str:
    for e in extra:
        if stage == "quantize-drafter" and e.startswith("quant="):
            return f"{stage}-{e.split('=', 1)[1]}"
        if stage == "quantize-target" and e.startswith("target_quant="):
            return f"{stage}-{e.split('=', 1)[1]}"
        if stage == "cache" and e.startswith("cache.target=") and e.split("=", 1)[1] != "bf16":
            return f"{stage}-{e.split('=', 1)[1]}"
    return stage


def run_cache_bench(bench: Bench, aux: list[int]) -> dict:
    """Helper C's side-by-side (stage vs output_hidden_states) if present; its JSON is recorded as is."""
    out = bench.work / "probes" / "cache_bench.json"
    cmd = [sys.executable, "-m", "bench.cache_bench", "--target", str(bench.models / "target"),
           "--device", bench.args.device, "--seq-len", str(bench.args.seq_len), "--json", str(out),
           "--batches", "8", "--warmup", "2", "--out-dir", str(bench.work / "cache-bench")]
    (bench.work / "cache-bench").mkdir(parents=True, exist_ok=True)  # cache_bench.py does not create it
    print(f"[bench] $ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    print(proc.stdout[-4000:], proc.stderr[-4000:], flush=True)
    rec = {"rc": proc.returncode, "command": " ".join(cmd[1:]), "stdout_tail": proc.stdout[-2000:]}
    if out.is_file():
        rec["result"] = json.loads(out.read_text())
    return rec


def pick_work_dir(arg: str) -> Path:
    if arg != "auto":
        p = Path(arg)
    else:
        cands = [Path(c) for c in ("/tmp", "/var/tmp", "/root", os.getcwd()) if Path(c).is_dir()]
        p = max(cands, key=lambda c: shutil.disk_usage(c).free) / "specquant-bench"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _empty() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench = Bench(args)
    print(f"[bench] work dir {bench.work} ({shutil.disk_usage(bench.work).free / 2**30:.0f} GiB free)", flush=True)
    for phase in [p.strip() for p in args.phases.split(",") if p.strip()]:
        extra_phases = ["dist", "disttarget", "cachebench", "serve", "paircache", "peers", "peersreport", "hashreport"]
        if phase not in {*ALL_PHASES, *extra_phases}:
            raise SystemExit(f"unknown phase {phase!r}; choose from {', '.join([*ALL_PHASES, *extra_phases])}")
        t0 = time.perf_counter()
        try:
            getattr(bench, phase)()
        except Exception as exc:  # a failed phase is reported, the others still run
            import traceback

            traceback.print_exc()
            bench.record(f"error[{phase}]", {"error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(f"[bench] phase {phase} took {time.perf_counter() - t0:.1f}s", flush=True)
    print(report.markdown(bench.results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
