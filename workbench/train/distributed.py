"""Process-group set-up for the trainer.

EP size = world size: the one process group is both the expert-parallel group (experts sharded
contiguously, tokens exchanged with all-to-all) and the data-parallel group (dense parameters
replicated, each rank trains on its slice of the global batch). gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None  # None when running as a single process without a group
    owns_group: bool  # True when setup() created the group (and teardown() destroys it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def setup() -> DistInfo:
    """Use an existing default group; else init one from RANK/WORLD_SIZE/MASTER_* when WORLD_SIZE>1."""
    cuda = torch.cuda.is_available()
    owns = False
    if not dist.is_initialized() and _env_int("WORLD_SIZE", 1) > 1:
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(f"WORLD_SIZE>1 but {var} is not set; launch with torchrun "
                                   "or submitit (they set RANK, WORLD_SIZE, MASTER_ADDR/PORT)")
        local = _env_int("LOCAL_RANK", 0)
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _env_int("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1) if cuda else 0)
        group = dist.group.WORLD if world > 1 else None
    else:
        rank, world, local, group = 0, 1, 0, None
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return DistInfo(rank, world, local, device, group, owns)


def teardown(info: DistInfo) -> None:
    """Destroy the group setup() created. Every rank first passes a barrier: a rank that finished
    the last collective early must not close its gloo connections (and join their transport
    threads) while a peer is still reading from them, which can end the peer's process in
    std::terminate at exit instead of a clean exit 0."""
    if info.owns_group and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.group is not None:
        dist.barrier(group=info.group)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=info.group)
    return x


def all_reduce_max(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=info.group)
    return x
