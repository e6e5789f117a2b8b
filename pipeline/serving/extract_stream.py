"""cache.engine=vllm: vLLM's own hidden-state extraction, streamed into the cache's sharded format.

vLLM (`serve.python`, its own interpreter) runs `pipeline.serving.extract`: the target under
`extract_hidden_states` with the ExampleHiddenStatesConnector, one `generate` per shard, one file
per sample in `runs/<name>/.work/vllm-extract-<pid>/`, at a path the request names
(`extract.sample_path`). A shard goes to a writer lane before vLLM has computed it, and this process
reads each sample's file as soon as vLLM has written it (a shared flock on `<file>.lock` waits for
the write), so a shard is written while the rest of it is still being computed; it checks its
token ids and shape, converts it to the cache's storage dtype and hands it to the same
`BackgroundWriter` the HF engine uses: same shard plan, same file format, same sidecars, hashes
and index, so every reader (`CacheReader`, quantize-drafter, manifest) sees no difference. The
values are vLLM's kernels' (bf16 differences of ~1e-2 relative to the HF forward), so the inputs
hash records `engine: vllm` and the content hash is vLLM's own. Scratch space is bounded: the
worker waits while more than `cache.vllm_backlog` + `cache.shards_in_flight` shards' files are unread; each file is deleted
once read, and the folder is removed at the end (also on errors and Ctrl-C).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pipeline.artifacts.cache import Layout, encode_hidden
from pipeline.artifacts.cache_writer import BackgroundWriter
from pipeline.core.errors import SpecquantError, bad_value
from pipeline.core.io import atomic_write_json
from pipeline.serving.extract import sample_path

FIELD = "cache.engine"


def check_vllm_engine(cfg, aux: list[int], num_layers: int) -> dict:
    """Before any work: an interpreter with vLLM and a GPU, layer ids vLLM can extract, one process."""
    from pipeline.serving.launch import probe

    bad = [m for m in aux if not 1 <= m <= num_layers - 1]
    if bad:
        raise bad_value("cache.aux_layer_ids" if cfg.cache.get("aux_layer_ids") else "drafter aux_layer_ids", aux,
                        f"vLLM's extractor reads the input of decoder layers 1..{num_layers - 1}, so id {bad[0]} "
                        "(the embeddings or the final norm's output) is not available there",
                        "use cache.engine=hf for this drafter")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise bad_value(FIELD, "vllm", "it runs one vLLM engine, not one per torchrun rank",
                        "run it without torchrun (NPROC=1) and set cache.vllm_tensor_parallel_size for several GPUs")
    try:
        return probe(cfg.serve.python)
    except SpecquantError as exc:
        raise SpecquantError(f"cache.engine=vllm needs vLLM: {exc}") from None


def _worker_env() -> dict:
    from pipeline.serving.launch import worker_env

    return worker_env(in_process=False)  # the engine core must step on its own (module docstring)


class _Worker:
    """The vLLM extraction process and its scratch folder."""

    module = "pipeline.serving.extract"

    def __init__(self, python: str, job: dict, scratch: Path, work: Path):
        from pipeline.serving.launch import repo_root

        self.scratch = scratch
        self.log_path = work / f"{scratch.name}.log"  # kept when the extraction fails
        job_file = work / f"{scratch.name}.job.json"
        atomic_write_json(job_file, job)
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([python, "-m", self.module, str(job_file)], stdout=self._log,
                                     stderr=subprocess.STDOUT, env=_worker_env(), cwd=str(repo_root()),
                                     start_new_session=True)  # Ctrl-C reaches us; we stop the worker ourselves
        self.job_file = job_file

    def failure(self) -> str:
        res = self.scratch / "result.json"
        if res.is_file():
            with contextlib.suppress(ValueError, OSError):
                r = json.loads(res.read_text(encoding="utf-8"))
                if not r.get("ok"):
                    return r.get("error", "no error recorded")
        lines = self.log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        return f"the worker exited {self.proc.returncode} ({(lines[-1:] or ['no output'])[0][:300]})"

    def stopped(self) -> bool:
        return self.proc.poll() is not None

    def finish(self) -> dict:
        """The worker's report once it has written it (before vLLM's teardown), with `stop_s`: how long
        the process then took to exit (the engine's shutdown, a fixed cost per run like `load_s`)."""
        res = self.scratch / "result.json"
        while not res.is_file() and self.proc.poll() is None:
            time.sleep(0.01)
        t0 = time.perf_counter()
        rc = self.proc.wait()
        r = json.loads(res.read_text(encoding="utf-8")) if res.is_file() else {}
        if rc != 0 or not r.get("ok"):
            raise bad_value(FIELD, "vllm", f"vLLM's extraction failed: {self.failure()}",
                            f"read {self.log_path} for vLLM's log, or use cache.engine=hf")
        return {**r, "stop_s": round(time.perf_counter() - t0, 3)}

    def close(self, ok: bool) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.job_file.unlink(missing_ok=True)
        if ok:
            self.log_path.unlink(missing_ok=True)


def read_sample(path: str, ids: list[int], layout: Layout, where: str):
    """One file of vLLM's connector -> (storage tensor [T, n_aux, H], fp8 scales or None); deleted once read.

    Called once the file exists (`_stream` waits for that, and for a worker that dies first). The
    connector creates `<file>.lock` under an exclusive flock before it starts the file and releases it
    once the file is complete, so the shared lock waits for the end of the write."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    with open(lock) as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)  # sleeps until the connector's writer thread has released it
        data = load_file(path, device="cpu")
    os.remove(path)
    os.remove(lock)
    hs, tok = data["hidden_states"], data["token_ids"]
    want = (len(ids), layout.n_aux, layout.hidden_size)
    if tuple(hs.shape) != want:
        raise bad_value(FIELD, "vllm", f"vLLM wrote hidden states of shape {list(hs.shape)} for {where}, "
                        f"expected {list(want)}", "use cache.engine=hf for this target")
    if tok.tolist() != list(ids):
        raise bad_value(FIELD, "vllm", f"vLLM's file for {where} holds other token ids than the sample",
                        "use cache.engine=hf (and report this vLLM version)")
    return encode_hidden(hs, layout)


def cache_shards_vllm(cfg, plans, samples, layout: Layout, out: Path, resume_key: str, tcfg, work: Path,
                      samples_file: Path) -> tuple[int, int, dict]:
    """Extract and write `plans` with vLLM; returns (shards, tokens written, the worker's report)."""
    from tqdm import tqdm

    if not plans:
        return 0, 0, {}
    c = cfg.cache
    lanes = max(1, int(c.shards_in_flight))
    longest = max(len(s["input_ids"]) for s in samples)
    work.mkdir(parents=True, exist_ok=True)
    # vLLM's per-sample files: in the run's .work, or e.g. /dev/shm so that they never touch the run's disk
    scratch = Path(str(c.vllm_scratch or work)).expanduser() / f"specquant-vllm-extract-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    job = {"target": str(Path(str(tcfg.path)).resolve()) if Path(str(tcfg.path)).is_dir() else str(tcfg.path),
           "aux_layer_ids": list(layout.aux_layer_ids), "samples": str(samples_file.resolve()),
           "chunks": [list(range(p.first, p.first + p.count)) for p in plans], "out_dir": str(scratch),
           "dtype": cfg.target.dtype, "max_model_len": longest + 8,
           "max_num_batched_tokens": max(int(c.batch_tokens), longest),
           "gpu_memory_utilization": float(c.vllm_gpu_memory_utilization),
           "tensor_parallel_size": int(c.vllm_tensor_parallel_size), "enforce_eager": bool(c.vllm_enforce_eager),
           "backlog": int(c.vllm_backlog) + lanes, "seed": int(cfg.seed)}
    worker = _Worker(str(cfg.serve.python), job, scratch, work)
    writer = BackgroundWriter(out, samples, layout, resume_key, torch.device("cpu"), lanes=lanes)
    bar = tqdm(total=sum(p.num_tokens for p in plans), unit="tok", unit_scale=True, desc="cache (vLLM)",
               mininterval=1.0)
    ok = False
    try:
        with ThreadPoolExecutor(2 * lanes, thread_name_prefix="cache-vllm-read") as pool:
            _stream(worker, writer, pool, plans, samples, layout, lanes, bar)
        writer.finish()
        report = worker.finish()
        ok = True
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
        worker.close(ok)
    return len(plans), sum(p.num_tokens for p in plans), report


READ_AHEAD = 2  # samples per open shard read ahead of the writer


def _stream(worker: _Worker, writer: BackgroundWriter, pool, plans, samples, layout: Layout, lanes: int, bar) -> None:
    """Samples go to the writer in the order vLLM writes them, not in a fixed interleave.

    Each shard goes to a writer lane as soon as the lane has closed its last one, before vLLM has
    computed it. A shard's samples must reach its lane in the shard's order, but the lanes are
    independent: each pass reads the next samples of every open shard whose files have appeared
    (a read then waits only for the file's write to finish, never for vLLM to compute it, so the
    read threads are never all parked on samples of a later chunk) and hands over every finished
    read whose lane has room. A slow lane or a chunk vLLM has not reached holds up nobody else."""
    free = list(range(lanes))
    todo: dict[int, collections.deque] = {}  # lane -> samples of its open shard not yet submitted
    reads: dict[int, collections.deque] = {}  # lane -> (sample, future) submitted, in the shard's order
    shard: dict[int, int] = {}  # lane -> the index of its open shard
    k, n = 0, len(plans)
    while k < n or todo:
        progressed = False
        while free and k < n:
            lane, order = free.pop(0), list(range(plans[k].first, plans[k].first + plans[k].count))
            writer.open_shard(plans[k], order, lane)
            todo[lane], reads[lane], shard[lane] = collections.deque(order), collections.deque(), k
            k, progressed = k + 1, True
        for lane in sorted(todo, key=shard.get):  # the oldest shard first
            q, r = todo[lane], reads[lane]
            while q and len(r) < READ_AHEAD and os.path.exists(sample_path(worker.scratch, q[0])):
                g = q.popleft()
                r.append((g, pool.submit(read_sample, sample_path(worker.scratch, g), samples[g]["input_ids"],
                                         layout, f"sample {samples[g]['id']}")))
                progressed = True
            while r and r[0][1].done() and writer.lane_has_room(lane):
                g, fut = r.popleft()
                hs, scale = fut.result()
                t = len(samples[g]["input_ids"])
                writer.put_batch([g], [t], hs, scale, lane)
                bar.update(t)
                progressed = True
            if not q and not r:
                writer.close_shard(lane)
                del todo[lane], reads[lane], shard[lane]
                free.append(lane)
                progressed = True
        if not progressed:
            writer.check()
            waiting = [q[0] for q in todo.values() if q]
            if worker.stopped() and waiting and not any(os.path.exists(sample_path(worker.scratch, g)) for g in waiting):
                g = min(waiting)
                raise bad_value(FIELD, "vllm", f"vLLM's extraction stopped before sample {samples[g]['id']}: "
                                f"{worker.failure()}", f"read {worker.log_path} for vLLM's log, or use cache.engine=hf")
            time.sleep(0.002)


__all__ = ["check_vllm_engine", "cache_shards_vllm", "read_sample"]
