"""Host-side ceilings of the cache writer: sha256 and tmpfs writes, 1..N threads at once.

    python -m bench.host_io [--dir /dev/shm] [--mb 84] [--reps 12] [--writer]

Each thread hashes (or writes, or both, as the shard writer does) its own `--reps` buffers of
`--mb` MB; the aggregate GB/s shows whether threads scale (hashlib and file writes release the GIL)
or something serialises them. Prints one JSON line per (mode, threads)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time


def run(mode: str, threads: int, buf: bytes, reps: int, folder: str) -> dict:
    def work(k: int) -> None:
        h = hashlib.sha256()
        path = os.path.join(folder, f"host-io-{os.getpid()}-{k}")
        with open(path, "wb") as fh:
            for _ in range(reps):
                if mode in ("sha256", "both"):
                    h.update(buf)
                if mode in ("write", "both"):
                    fh.write(buf)
        os.remove(path)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    secs = time.perf_counter() - t0
    gb = threads * reps * len(buf) / 1e9
    return {"mode": mode, "threads": threads, "gb": round(gb, 2), "seconds": round(secs, 3), "gb_s": round(gb / secs, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--mb", type=int, default=84)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--writer", action="store_true", help="also time the cache's BackgroundWriter with 1..N lanes")
    a = ap.parse_args()
    buf = os.urandom(a.mb * 1_000_000)
    for mode in ("sha256", "write", "both"):
        for n in [int(x) for x in a.threads.split(",")]:
            print(json.dumps(run(mode, n, buf, a.reps, a.dir)), flush=True)
    if a.writer:
        for n in [int(x) for x in a.threads.split(",")]:
            print(json.dumps(writer_rate(a.dir, n)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def writer_rate(folder: str, lanes: int, samples: int = 64, tokens: int = 2048, n_aux: int = 5,
                hidden: int = 4096) -> dict:
    """The cache's own BackgroundWriter alone (CPU tensors, one sample per batch, as cache.engine=vllm
    feeds it): GB/s through serialisation, the shard's sha256, the per-sample digests and the writes."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch

    from pipeline.artifacts.cache import Layout, plan_shards
    from pipeline.artifacts.cache_writer import BackgroundWriter

    layout = Layout(tuple(range(1, n_aux + 1)), hidden, "bfloat16")
    data = [{"id": f"s{i}", "input_ids": [1] * tokens, "loss_mask": [1] * tokens} for i in range(samples)]
    plans = plan_shards([tokens] * samples, layout, 8, 2 * 1024**3)  # 8 per shard: enough shards for 8 lanes
    hs = torch.randn(tokens, n_aux, hidden).to(torch.bfloat16)
    out = Path(tempfile.mkdtemp(dir=folder, prefix="host-io-writer-"))
    w = BackgroundWriter(out, data, layout, "bench", torch.device("cpu"), lanes=lanes)
    t0 = time.perf_counter()
    for start in range(0, len(plans), lanes):
        group = plans[start:start + lanes]
        for lane, p in enumerate(group):
            w.open_shard(p, list(range(p.first, p.first + p.count)), lane)
        for step in range(max(p.count for p in group)):
            for lane, p in enumerate(group):
                if step < p.count:
                    w.put_batch([p.first + step], [tokens], hs, None, lane)
        for lane in range(len(group)):
            w.close_shard(lane)
    w.finish()
    secs = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    gb = samples * hs.numel() * 2 / 1e9
    return {"mode": "BackgroundWriter", "lanes": lanes, "shards": len(plans), "gb": round(gb, 2),
            "seconds": round(secs, 3), "gb_s": round(gb / secs, 2)}
