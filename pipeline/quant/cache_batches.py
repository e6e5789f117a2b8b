"""Calibration and held-apart batches for the drafter, drawn from the target hidden-state cache.

The split is a seeded permutation of the cache's samples: the first `heldout_samples` are kept
apart for the checks, the next `num_samples` calibrate. Anchors are drawn where the loss mask is
1, with one seeded generator per role, so the same seed and cache give the same batches.
"""

from __future__ import annotations

import torch

from pipeline.errors import bad_value

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
    if isinstance(batches, DrafterBatches):
        return sum(a for a, _ in batches.built.values())
    return int(sum(int(b["anchor_valid"].sum()) for b in batches))


def count_tokens(batches) -> int:
    if isinstance(batches, DrafterBatches):
        return sum(t for _, t in batches.built.values())
    return int(sum(b["input_ids"].numel() for b in batches))
