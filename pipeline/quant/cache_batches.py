"""Calibration and held-apart batches for the drafter, drawn from the target hidden-state cache.

The split is a seeded permutation of the cache's samples: the first `heldout_samples` are kept
apart for the checks, the next `num_samples` calibrate. Anchors are drawn where the loss mask is
1, with one seeded generator per role, so the same seed and cache give the same batches.
"""

from __future__ import annotations

import torch

from pipeline.core.errors import bad_value

HELDOUT_SEED_OFFSET = 1_000_003  # held-apart anchors come from their own stream
SAMPLE_SEED_STRIDE = 1_000_003  # anchor generator of cache sample i: seed * stride + i


def split_indices(num_cached: int, num_calib: int, num_heldout: int, seed: int, need_calib: bool,
                  field: str = "quant") -> tuple[list[int], list[int]]:
    """(calibration indices, held-apart indices); fails with one sentence when the cache is too small."""
    if num_heldout < 1:
        raise bad_value(f"{field}.heldout_samples", num_heldout, "the checks need held-apart samples",
                        "use 1 or more")
    want = num_heldout + (num_calib if need_calib else 0)
    if want > num_cached:
        raise bad_value(f"{field}.num_samples", num_calib, f"{num_heldout} held-apart + {num_calib} calibration "
                        f"samples are needed but the cache holds {num_cached}",
                        "lower quant.num_samples / quant.heldout_samples or cache more samples")
    order = torch.randperm(num_cached, generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(order[:num_heldout])
    calib = order[num_heldout:num_heldout + num_calib] if need_calib else []
    return calib, held


def _truncate(sample: dict, max_len: int) -> dict:
    return {"id": sample["id"], "input_ids": sample["input_ids"][:max_len],
            "loss_mask": sample["loss_mask"][:max_len], "hidden_states": sample["hidden_states"][:max_len]}


class DrafterBatches:
    """Anchored calibration batches built lazily from the cache, one cached sample per batch.

    Map-style, so oneshot's DataLoader reads one sample at a time (a 2,048-token sample with five
    4096-wide aux layers is ~170 MB in fp32: never hold them all). Each sample's anchors come from
    its own generator seeded by (seed, cache index), so batches do not depend on reading order.
    """

    def __init__(self, reader, indices: list[int], anchors_per_sequence: int, block_size: int,
                 mask_token_id: int, max_seq_len: int, seed: int):
        self.reader, self.indices = reader, list(indices)
        self.anchors, self.block_size, self.mask_token_id = anchors_per_sequence, block_size, mask_token_id
        self.max_seq_len, self.seed = max_seq_len, seed
        self.built: dict[int, tuple[int, int]] = {}  # position -> (valid anchors, tokens)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> dict:
        from pipeline.models.calibration import build_calibration_batch

        i = self.indices[j]
        gen = torch.Generator().manual_seed(self.seed * SAMPLE_SEED_STRIDE + i)
        sample = _truncate(self.reader[i], self.max_seq_len)
        batch = build_calibration_batch([sample], self.anchors, self.block_size, self.mask_token_id, gen)
        self.built[j] = (int(batch["anchor_valid"].sum()), int(batch["input_ids"].numel()))
        return batch

    def __iter__(self):
        for j in range(len(self)):
            yield self[j]


def drafter_batches(reader, indices: list[int], anchors_per_sequence: int, block_size: int, mask_token_id: int,
                    max_seq_len: int, seed: int) -> DrafterBatches:
    return DrafterBatches(reader, indices, anchors_per_sequence, block_size, mask_token_id, max_seq_len, seed)


def count_anchors(batches) -> int:
    """Valid anchors over the batches built so far (a DrafterBatches) or over a list of batches."""
    if isinstance(batches, (DrafterBatches, Prefetched)):
        return sum(a for a, _ in batches.built.values())
    return int(sum(int(b["anchor_valid"].sum()) for b in batches))


def count_tokens(batches) -> int:
    if isinstance(batches, (DrafterBatches, Prefetched)):
        return sum(t for _, t in batches.built.values())
    return int(sum(b["input_ids"].numel() for b in batches))


def reader_dtype(index: dict) -> torch.dtype:
    """The dtype a calibration reader hands out hidden states in: the cache's own storage dtype (bf16 stays
    bf16 on the host and in the host->device copy; the drafter casts it to its weights' dtype on the
    device, which is exact), float32 for fp8 (its decode multiplies by a float32 scale)."""
    from pipeline.artifacts.cache import STORAGE_DTYPES

    dtype = str(index.get("storage_dtype", "float32"))
    return torch.float32 if dtype == "fp8" or dtype not in STORAGE_DTYPES else STORAGE_DTYPES[dtype]


VERIFY_THREADS = 8  # sha256 releases the GIL: shards of a large cache verify side by side


class ShardVerifier:
    """Verifies, on background threads, the cache shards a set of samples reads, in the order they are
    first read; `wait(i)` blocks until sample i's shard is verified and re-raises its error (the same
    sentence the reader's lazy check raises). The reader then treats the shard as verified."""

    def __init__(self, reader, indices, threads: int = VERIFY_THREADS):
        from concurrent.futures import ThreadPoolExecutor

        self.reader = reader
        done = getattr(reader, "_verified", set()) if getattr(reader, "_verify", True) else None
        order: list[int] = []
        for i in indices if done is not None else ():  # verify=False: nothing to check
            k = int(reader.index["samples"][i]["shard"])
            if k not in order and k not in done:
                order.append(k)
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(threads, len(order))),
                                        thread_name_prefix="specquant-verify") if order else None
        # the reader's own check (sha256 of the shard against index.json, its own sentence on a mismatch)
        self._futures = {k: self._pool.submit(reader.verify_shard, k) for k in order}

    def wait(self, i: int) -> None:
        k = int(self.reader.index["samples"][i]["shard"])
        fut = self._futures.get(k)
        if fut is not None:
            fut.result()

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._futures.values():
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


class Prefetched:
    """A DrafterBatches read ahead: while position j is in use, j+1 is read from the cache and built on a
    background thread and, on CUDA, copied from pinned host memory to the device without blocking. The
    batches are the same tensors, bit for bit (each depends only on its cache index and seed); only
    where they are made and when changes. Map-style like DrafterBatches (oneshot's DataLoader reads
    positions 0, 1, ... once; the scale search reads a prefix again). At most two batches are in
    flight, so host memory does not grow with the number of samples."""

    def __init__(self, batches: DrafterBatches, device, verifier: ShardVerifier | None = None):
        from concurrent.futures import ThreadPoolExecutor

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the worker thread must not pick its own device
            device = torch.device("cuda", torch.cuda.current_device())
        self.batches, self.device, self.verifier = batches, device, verifier
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specquant-prefetch")
        self._ahead: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def __deepcopy__(self, memo):
        # llm-compressor keeps a deep copy of the calibration loader in its session state (the basic pipeline
        # never iterates it): the plain batches over a reader of their own (threads and open shards do not copy)
        b = self.batches
        reader = type(b.reader)(b.reader.dir, dtype=b.reader.dtype)
        return DrafterBatches(reader, b.indices, b.anchors, b.block_size, b.mask_token_id, b.max_seq_len, b.seed)

    @property
    def built(self) -> dict[int, tuple[int, int]]:
        return self.batches.built

    def _make(self, j: int) -> dict:
        if self.verifier is not None:
            self.verifier.wait(self.batches.indices[j])
        batch = self.batches[j]
        if self.device.type != "cuda":
            return batch
        # pinned staging + non_blocking: the copy is queued on the device's stream and the host moves on;
        # torch's pinned allocator keeps the staging buffer until the copy has run
        return {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()}

    def _submit(self, j: int) -> None:
        if 0 <= j < len(self) and j not in self._ahead:
            self._ahead[j] = self._pool.submit(self._make, j)

    def __getitem__(self, j: int) -> dict:
        if not 0 <= j < len(self):
            raise IndexError(j)
        self._submit(j)
        fut = self._ahead.pop(j)
        for stale in [k for k in self._ahead if k != j + 1]:  # an out-of-order read: drop what it will not use
            self._ahead.pop(stale).cancel()
        self._submit(j + 1)
        return fut.result()

    def __iter__(self):
        for j in range(len(self)):
            yield self[j]

    def close(self) -> None:
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        self._pool.shutdown(wait=True)
