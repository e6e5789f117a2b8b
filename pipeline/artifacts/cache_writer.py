"""The writer side of the hidden-state cache: shards streamed to disk and hashed while written.

`ShardWriter` writes one shard (safetensors) and its sidecar; `BackgroundWriter` runs shard writers
on background threads so the target never waits for the disk or the hashes. The format they write
(layout, shard plan, sidecars, index, reader) is `pipeline.artifacts.cache`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts.cache import FORMAT, FORMAT_VERSION, Layout, ShardPlan, shard_file, sidecar_file
from pipeline.core.dtypes import SAFETENSORS_DTYPES
from pipeline.core.io import HashingWriter, atomic_open, atomic_write_json


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (CPU, contiguous)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _sample_digest(sample_id: str, layout: Layout, ids: torch.Tensor, mask: torch.Tensor,
                   hs: torch.Tensor, scale: torch.Tensor | None) -> str:
    """sha256 of one cached sample: its id, shapes, storage dtype and every stored byte."""
    h = hashlib.sha256(f"{sample_id}\0{ids.numel()}\0{layout.n_aux}\0{layout.hidden_size}\0"
                       f"{layout.storage_dtype}\0".encode())
    for t in (ids, mask, *(() if scale is None else (scale,)), hs):
        h.update(_raw(t))
    return h.hexdigest()


class _AsyncFile:
    """File-like: each write is queued to a one-thread pool (FIFO, so in order) and returns at once,
    so the caller (HashingWriter) hashes a buffer while the previous one goes to disk.
    Buffers must stay alive until `drain()`."""

    def __init__(self, fh, pool: ThreadPoolExecutor):
        self._fh, self._pool, self._pending = fh, pool, []

    def write(self, data) -> int:
        self._pending.append(self._pool.submit(self._fh.write, data))
        return len(data)

    def drain(self, keep: int = 0) -> None:
        """Wait for all queued writes but the last `keep`."""
        while len(self._pending) > keep:
            self._pending.pop(0).result()


class ShardWriter:
    """Streams one shard to a temp file: header and token ids first, hidden states as they arrive,
    loss masks last; sha256 computed while writing; renamed into place (then the sidecar) on close.
    Three threads share each buffer: the caller hashes the file stream, `io_pool` writes it and
    `digest_pool` hashes each sample for the content hash (hashlib and writes release the GIL).

    Offsets are known up front because every sample's length is, so nothing is buffered beyond the
    batch being written. `order` is the processing order of the shard's global sample indices."""

    def __init__(self, cache_dir: Path, plan: ShardPlan, order: list[int], samples: list[dict],
                 layout: Layout, resume_key: str, digest_pool: ThreadPoolExecutor, io_pool: ThreadPoolExecutor):
        self.cache_dir, self.plan, self.order, self.layout = cache_dir, plan, order, layout
        self.samples, self.resume_key, self.pool = samples, resume_key, digest_pool
        self.ids = {g: torch.tensor(samples[g]["input_ids"], dtype=torch.int64) for g in order}
        self._header_bytes = b""
        self.masks = {g: torch.tensor(samples[g]["loss_mask"], dtype=torch.uint8) for g in order}
        self.digests: dict[int, str] = {}
        self._futures = []
        self._next = 0
        header, off = {}, 0

        def put(name, dtype, shape, nbytes):
            nonlocal off
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes

        # int64 first, then (float32 scales, storage dtype) per sample, uint8 last: every offset stays aligned
        for g in order:
            put(f"s{g}.input_ids", torch.int64, [len(self.ids[g])], 8 * len(self.ids[g]))
        el = torch.empty((), dtype=layout.torch_dtype).element_size()
        for g in order:
            t = len(self.ids[g])
            if layout.fp8:
                put(f"s{g}.hidden_states_scale", torch.float32, [t, layout.n_aux], 4 * t * layout.n_aux)
            put(f"s{g}.hidden_states", layout.torch_dtype, [t, layout.n_aux, layout.hidden_size],
                el * t * layout.n_aux * layout.hidden_size)
        for g in order:
            put(f"s{g}.loss_mask", torch.uint8, [len(self.masks[g])], len(self.masks[g]))
        header["__metadata__"] = {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                                  "resume_key": resume_key, "storage_dtype": layout.storage_dtype,
                                  "aux_layer_ids": json.dumps(list(layout.aux_layer_ids))}
        blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
        blob += b" " * (-len(blob) % 8)
        self._stack = contextlib.ExitStack()
        self._file = _AsyncFile(self._stack.enter_context(atomic_open(cache_dir / shard_file(plan.index))), io_pool)
        self._fh = HashingWriter(self._file)
        self._header_bytes = struct.pack("<Q", len(blob)) + blob  # kept alive until written
        self._fh.write(self._header_bytes)
        for g in order:
            self._fh.write(_raw(self.ids[g]))

    def add(self, g: int, hs: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Queue sample `g` ([T, n_aux, H] storage dtype, CPU); its buffers must live until `drain()`."""
        if self._next >= len(self.order) or self.order[self._next] != g:
            raise RuntimeError(f"shard {self.plan.index}: sample {g} arrived out of the planned order")
        self._next += 1
        if scale is not None:
            self._fh.write(_raw(scale))
        self._fh.write(_raw(hs))
        sid = str(self.samples[g]["id"])
        fut = self.pool.submit(_sample_digest, sid, self.layout, self.ids[g], self.masks[g], hs, scale)
        self._futures.append((g, fut))

    def drain(self, keep: int = 0) -> None:
        """Wait until every queued buffer but the last `keep` samples' is written and hashed (then the
        caller may reuse them). keep > 0 lets the next sample's stream hash overlap this one's digest."""
        while len(self._futures) > keep:
            g, fut = self._futures.pop(0)
            self.digests[g] = fut.result()
        self._file.drain(keep * (2 if self.layout.fp8 else 1))  # one or two writes (scales, states) per sample

    def close(self) -> dict[str, Any]:
        if self._next != len(self.order):
            raise RuntimeError(f"shard {self.plan.index}: closed after {self._next}/{len(self.order)} samples")
        for g in self.order:
            self._fh.write(_raw(self.masks[g]))
        self.drain()
        self._stack.close()  # fsync + rename
        g_range = range(self.plan.first, self.plan.first + self.plan.count)
        record = {"format_version": FORMAT_VERSION, "resume_key": self.resume_key,
                  "shard": {**asdict(self.plan), "file": shard_file(self.plan.index), "sha256": self._fh.hexdigest(),
                            "bytes": self._fh.bytes},
                  "samples": [{"id": str(self.samples[g]["id"]), "num_tokens": len(self.ids[g]),
                               "sha256": self.digests[g]} for g in g_range]}
        atomic_write_json(self.cache_dir / sidecar_file(self.plan.index), record)
        return record

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self._file.drain()
        with contextlib.suppress(Exception):
            self._stack.__exit__(RuntimeError, RuntimeError("aborted"), None)  # unlinks the temp file


class _Lane:
    """One writer thread with its own queue and io thread: writes one shard at a time, in order."""

    def __init__(self, owner: BackgroundWriter, k: int, slots: int):
        self.owner = owner
        self.q: queue.Queue = queue.Queue(maxsize=slots)
        self.io_pool = ThreadPoolExecutor(1, thread_name_prefix=f"cache-io{k}")
        self.shard: ShardWriter | None = None
        self.thread = threading.Thread(target=self._loop, name=f"cache-writer{k}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        o = self.owner
        try:
            while True:
                item = self.q.get()
                if item[0] == "stop" or o.error is not None:
                    break
                if o.dry_run:  # benchmarks: wait for the copy, write nothing
                    if item[0] == "batch" and item[5] is not None:
                        item[5].synchronize()
                        o.free.put(item[6])
                elif item[0] == "open":
                    self.shard = ShardWriter(o.cache_dir, item[1], item[2], o.samples, o.layout, o.resume_key,
                                             o.pool, self.io_pool)
                elif item[0] == "batch":
                    self._write_batch(*item[1:])
                else:
                    rec = self.shard.close()
                    self.shard = None
                    with o.lock:
                        o.records.append(rec)
        except BaseException as exc:  # noqa: BLE001 - handed to the producer
            o.error = exc
        if self.shard is not None:
            self.shard.abort()
        self.io_pool.shutdown()

    def _write_batch(self, gs, lens, hs, scale, done, slot) -> None:
        o = self.owner
        if done is not None:
            done.synchronize()
        off = 0
        for g, n in zip(gs, lens, strict=True):
            self.shard.add(g, hs[off:off + n], None if scale is None else scale[off:off + n])
            off += n
        if done is not None:
            self.shard.drain()  # the io and digest threads read the pinned buffer too: drained before reuse
            o.free.put(slot)
        else:  # tensors of their own (CPU, cache.engine=vllm): one sample stays in flight, memory stays bounded
            self.shard.drain(keep=1)


class BackgroundWriter:
    """Writes shards on background threads so the target never waits for the disk or the hashes.

    On CUDA, each batch is copied device->host on a side stream into one of `slots` pinned buffers
    (non_blocking, overlapping the next forward); a writer thread waits for the copy's event, writes
    and hashes, then frees the buffer. Bounded queues and the buffer pool cap host memory at a few
    batches whatever the dataset size. With `lanes` > 1, that many shards are written at once (the
    caller interleaves their batches): a shard's sha256 is sequential, so one lane is bounded by one
    core's hash rate. Errors on a writer thread surface on the producer's next call."""

    def __init__(self, cache_dir: Path, samples: list[dict], layout: Layout, resume_key: str,
                 device: torch.device, slots: int = 3, dry_run: bool = False, max_batch_tokens: int = 0,
                 lanes: int = 1):
        self.cache_dir, self.samples, self.layout, self.resume_key = cache_dir, samples, layout, resume_key
        self.cuda, self.dry_run = device.type == "cuda", dry_run
        # pinned buffers sized once for the largest batch, so varying batches do not re-pin memory
        self.slot_bytes = max_batch_tokens * layout.hidden_bytes_per_token() + 64
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.free: queue.Queue = queue.Queue()
        for _ in range(slots + lanes - 1):
            self.free.put(None)  # pinned buffers are allocated on first use
        self.pool = ThreadPoolExecutor(lanes + 1, thread_name_prefix="cache-digest")
        self.error: BaseException | None = None
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.lanes = [_Lane(self, k, slots) for k in range(lanes)]

    # ---- producer side (main thread)
    def _wait(self, fn):
        """Call a blocking queue operation in short slices, raising a writer thread's error."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                return fn(timeout=0.5)
            except (queue.Full, queue.Empty):
                continue

    def _put(self, lane: int, item) -> None:
        self._wait(lambda timeout: self.lanes[lane].q.put(item, timeout=timeout))

    def open_shard(self, plan: ShardPlan, order: list[int], lane: int = 0) -> None:
        self._put(lane, ("open", plan, order))

    def check(self) -> None:
        """Raise a writer thread's error now (a producer that polls instead of putting)."""
        if self.error is not None:
            raise self.error

    def lane_has_room(self, lane: int) -> bool:
        """Whether a put to `lane` would not wait (its queue is not full); a producer feeding several
        lanes in the order their data arrives uses it to never block on a slow lane."""
        return not self.lanes[lane].q.full()

    def put_batch(self, gs: list[int], lens: list[int], hs: torch.Tensor, scale: torch.Tensor | None,
                  lane: int = 0) -> None:
        if not self.cuda:
            self._put(lane, ("batch", gs, lens, hs, scale, None, None))
            return
        slot = self._wait(self.free.get)
        n_hs = hs.numel() * hs.element_size()
        s_off = (n_hs + 63) // 64 * 64
        need = s_off + (0 if scale is None else scale.numel() * 4)
        if slot is None or slot.numel() < need:
            slot = torch.empty(max(need, self.slot_bytes), dtype=torch.uint8, pin_memory=True)
        host_hs = slot[:n_hs].view(hs.dtype).view(hs.shape)
        host_scale = None if scale is None else slot[s_off:s_off + scale.numel() * 4].view(torch.float32).view(scale.shape)
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            host_hs.copy_(hs, non_blocking=True)
            if scale is not None:
                host_scale.copy_(scale, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the writer thread sleeps on it instead of spinning a core
            done.record(self.copy_stream)
        # the allocator must not hand these blocks to the next forward before the copy has read them
        hs.record_stream(self.copy_stream)
        if scale is not None:
            scale.record_stream(self.copy_stream)
        self._put(lane, ("batch", gs, lens, host_hs, host_scale, done, slot))

    def close_shard(self, lane: int = 0) -> None:
        self._put(lane, ("close",))

    def finish(self) -> list[dict]:
        for k in range(len(self.lanes)):
            self._put(k, ("stop",))
        for lane in self.lanes:
            lane.thread.join()
        self.pool.shutdown()
        if self.error is not None:
            raise self.error
        return sorted(self.records, key=lambda r: r["shard"]["index"])

    def abort(self) -> None:
        self.error = self.error or RuntimeError("aborted")
        for lane in self.lanes:
            with contextlib.suppress(Exception):
                lane.q.put_nowait(("stop",))
        for lane in self.lanes:
            lane.thread.join(timeout=60)
        self.pool.shutdown()


__all__ = ["BackgroundWriter", "ShardWriter"]
