"""One process group for the stages that run under `torchrun` (cache, quantize-target).

Ranks come from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); one process = world 1 and
every method is a no-op. NCCL on CUDA (one GPU per local rank), gloo on the CPU.
"""

from __future__ import annotations

import datetime as _dt
import os

import torch


def rank_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for one process."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun each local rank owns one GPU: `cuda` becomes `cuda:<LOCAL_RANK>`."""
    _, world, local_rank = rank_world()
    if device.type == "cuda" and world > 1:
        return torch.device("cuda", local_rank)
    return device


def partition(num_items: int, rank: int, world: int) -> range:
    """Contiguous, near-equal share of `num_items` for `rank` (the first ranks take the remainder)."""
    base, extra = divmod(num_items, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class Group:
    """The process group (or nothing, for one process)."""

    def __init__(self, backend: str, device: torch.device):
        self.rank, self.world, self.local_rank = rank_world()
        self.nccl = False
        if self.world > 1:
            import torch.distributed as dist

            if backend == "auto":
                backend = "nccl" if device.type == "cuda" else "gloo"
            self.nccl = backend == "nccl"
            if self.nccl:
                torch.cuda.set_device(self.local_rank)
            if not dist.is_initialized():
                # ranks may wait hours for each other at a final barrier (the slowest shard, a save)
                kwargs = {"device_id": torch.device("cuda", self.local_rank)} if self.nccl else {}
                dist.init_process_group(backend, timeout=_dt.timedelta(hours=24), **kwargs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(device_ids=[self.local_rank]) if self.nccl else dist.barrier()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
