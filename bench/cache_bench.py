"""Benchmark the cache stage against the stock `output_hidden_states=True` extraction, side by side.

Not a test. Same model, same token batches, same process; each mode reports tokens/s and peak memory:
  stock    model(ids, output_hidden_states=True) (all layers + lm_head logits), then `.cpu()` of the aux layers
  capture  the cache stage's forward (hooks, stop after the deepest aux layer, packed + cast on device)
           + async pinned device->host copies; nothing written (upper bound of the stage)
  stage    the cache stage's real loop: capture + background shard writer (safetensors, sha256, fsync)
           writing to --out-dir (use a tmpfs such as /dev/shm to take the disk out of the measure)

    python bench/cache_bench.py --device cpu --tiny                          # smoke test, seconds
    python bench/cache_bench.py --device cuda --shape qwen3-8b --out-dir /dev/shm/cache-bench --json out.json
    python bench/cache_bench.py --device cuda --target /path/to/Qwen3-8B ...   # real weights

Random weights at the chosen shape (bf16 on CUDA); the aux layers default to DFlash's 5 layers for
a 36-layer target (HF indices 2 10 18 26 34).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.artifacts.cache import Layout, plan_shards  # noqa: E402
from pipeline.stages.cache import LayerCapture, cache_shards  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960),
    "tiny": dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256),
}


def dflash_aux_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """z-lab's build_target_layer_ids(num_layers, n), +1 for the HF index convention."""
    if n == 1:
        return [num_layers // 2 + 1]
    return [round(1 + i * (num_layers - 4) / (n - 1)) + 1 for i in range(n)]


def build_model(args, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    dtype = getattr(torch, args.dtype)
    if args.target:
        return AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype, attn_implementation=args.attn,
                                                    device_map=str(device) if device.type == "cuda" else None
                                                    ).to(device).eval()
    cfg = Qwen3Config(**SHAPES[args.shape], attn_implementation=args.attn, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):  # random init directly on the device: seconds, not minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> dict:
    out = {"host_max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if device.type == "cuda":
        out["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_stock(model, batches: list[torch.Tensor], aux: list[int], device, warmup: int) -> dict:
    """The usual way: full forward with every hidden state and the logits, then blocking host copies."""
    def step(ids):
        out = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
        return [out.hidden_states[m].cpu() for m in aux]

    with torch.inference_mode():
        for ids in batches[:warmup]:
            step(ids)
        _reset_peak(device)
        t0 = time.perf_counter()
        for ids in batches[warmup:]:
            step(ids)
        _sync(device)
        dt = time.perf_counter() - t0
    tokens = sum(b.numel() for b in batches[warmup:])
    return {"mode": "stock", "tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
            **_peak(device)}


def run_stage(model, batches, aux, device, warmup: int, storage: str, out_dir: Path | None,
              samples_per_shard: int, shards_in_flight: int = 1) -> dict:
    """The cache stage's own loop (pipeline.stages.cache.cache_shards) over the same batches."""
    h = model.config.hidden_size
    layout = Layout(tuple(aux), h, storage)
    samples = [{"id": f"bench/{i}", "input_ids": row.tolist(), "loss_mask": [1] * row.numel()}
               for b in batches for i, row in enumerate(b)]
    bsz, seq = batches[0].shape
    n_warm = warmup * bsz
    capture = LayerCapture(model, aux)
    dry = out_dir is None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir)) if out_dir else Path(tempfile.mkdtemp())
    try:
        if n_warm:  # warm up kernels and pinned buffers with the same loop
            plans = plan_shards([seq] * n_warm, layout, samples_per_shard, 2**62)
            cache_shards(capture, plans, samples[:n_warm], layout, tmp / "warm", "bench", device, bsz * seq,
                         rank=1, dry_run=True)
        rest = samples[n_warm:]
        plans = plan_shards([seq] * len(rest), layout, samples_per_shard, 2**62)
        _reset_peak(device)
        t0 = time.perf_counter()
        cache_shards(capture, plans, rest, layout, tmp / "cache", "bench", device, bsz * seq, rank=1, dry_run=dry,
                     shards_in_flight=shards_in_flight)
        _sync(device)
        dt = time.perf_counter() - t0
        written = sum(p.stat().st_size for p in (tmp / "cache").glob("*.safetensors")) if not dry else 0
    finally:
        capture.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = len(rest) * seq
    return {"mode": "capture" if dry else "stage", "storage_dtype": storage, "shards_in_flight": shards_in_flight,
            "tokens": tokens,
            "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1), "bytes_written": written,
            "write_gb_per_s": round(written / dt / 1e9, 3) if written else None, **_peak(device)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shape and sizes (CPU smoke test)")
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="random-weight Qwen3 shape")
    ap.add_argument("--target", default=None, help="load real weights from this path instead of --shape")
    ap.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation")
    ap.add_argument("--aux-layer-ids", type=int, nargs="+", default=None,
                    help="HF output_hidden_states indices (default: DFlash's 5 layers for this depth)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=12, help="timed batches per mode (plus --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--storage-dtype", nargs="+", default=["bfloat16", "fp8"],
                    help="storage dtypes for the stage mode")
    ap.add_argument("--samples-per-shard", type=int, default=64)
    ap.add_argument("--shards-in-flight", type=int, default=1,
                    help="cache.shards_in_flight: shards written at once (each hashes on its own core)")
    ap.add_argument("--out-dir", default=None, help="where the stage mode writes shards (default: system temp)")
    ap.add_argument("--modes", nargs="+", default=["stock", "capture", "stage"], choices=["stock", "capture", "stage"])
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer's forward")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    a = ap.parse_args(argv)
    if a.tiny:
        a.shape, a.batch_size, a.seq_len, a.batches, a.warmup = "tiny", 2, 64, 4, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    a.dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = build_model(a, device)
    n_layers = model.config.num_hidden_layers
    aux = a.aux_layer_ids or (dflash_aux_layer_ids(n_layers) if n_layers >= 8 else [2, 4])
    if a.compile:  # the stage's cache.compile_layers=true; the stock path then runs compiled layers too
        cap = LayerCapture(model, aux)
        cap.compile_layers()
        cap.remove()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batches = [torch.randint(0, vocab, (a.batch_size, a.seq_len), generator=g) for _ in range(a.warmup + a.batches)]
    results = []
    for mode in a.modes:
        if mode == "stock":
            results.append(run_stock(model, batches, aux, device, a.warmup))
        elif mode == "capture":
            results.append(run_stage(model, batches, aux, device, a.warmup, a.storage_dtype[0], None,
                                     a.samples_per_shard))
        else:
            for st in a.storage_dtype:
                results.append(run_stage(model, batches, aux, device, a.warmup, st, Path(a.out_dir) if a.out_dir
                                         else Path(tempfile.gettempdir()), a.samples_per_shard,
                                         a.shards_in_flight))
        print(json.dumps(results[-1]), flush=True)
    base = next((r["tokens_per_s"] for r in results if r["mode"] == "stock"), None)
    setup = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "shape": a.target or a.shape, "dtype": a.dtype, "aux_layer_ids": aux, "batch_size": a.batch_size,
             "seq_len": a.seq_len, "batches": a.batches, "compile": a.compile, "torch": torch.__version__}
    print(f"\n{setup}\n| mode | storage | tok/s | vs stock | GPU peak GiB | host RSS GiB | write GB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {r['mode']} | {r.get('storage_dtype', '-')} | {r['tokens_per_s']:.0f} | {ratio} | "
              f"{r.get('gpu_peak_gib', '-')} | {r['host_max_rss_gib']} | {r.get('write_gb_per_s') or '-'} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
