"""Process-group set-up for the trainer.

Default layout, EP size = world size: the one process group is both the expert-parallel group
(experts sharded contiguously, tokens exchanged with all-to-all) and the data-parallel group (dense
parameters replicated, each rank trains on its slice of the global batch). gloo on CPU, NCCL on
GPU. With FSDP, `Layout` (below) splits the world into EP groups x expert-data-parallel groups.
"""

from __future__ import annotations

import os
import sys
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


def setup(*, single_rank_group: bool = False) -> DistInfo:
    """Use an existing default group; else init one from RANK/WORLD_SIZE/MASTER_* when WORLD_SIZE>1.
    `single_rank_group`: at world 1, still make a (one-rank) group: FSDP2 needs one."""
    cuda = torch.cuda.is_available()
    owns = False
    if single_rank_group and not dist.is_initialized() and _env_int("WORLD_SIZE", 1) <= 1:
        ensure_group_for_fsdp()
        owns = True
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
            # The layout's subgroups first, each after every rank is done with all groups, and
            # a barrier before the default group goes: the same race, once per gloo group
            # (seen once at EP2 x FSDP2, world 4: "terminate called" in one rank at exit).
            subgroups, _SUBGROUPS[:] = list(_SUBGROUPS), []
            for group in subgroups:
                dist.destroy_process_group(group)
            if subgroups:
                dist.barrier()
        dist.destroy_process_group()


# Thread names (Linux /proc/self/task/*/comm) of gloo's C++ threads: a ProcessGroupGloo's work
# threads and its transport's event loop.
_BACKEND_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def live_backend_threads() -> list[str]:
    """Names of this process's gloo threads still running (empty where /proc is not readable).

    After teardown() a run without FSDP has none: destroying a group joins its threads. With
    FSDP some stay: DTensor's sharding caches keep DeviceMesh objects, which keep their
    ProcessGroup objects alive, so destroy_process_group() cannot free them (torch 2.13)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if name in _BACKEND_THREADS:
            names.append(name)
    return sorted(names)


def exit_process(code: int = 0) -> None:
    """End a trainer process after teardown(). Where gloo threads are still alive, skip the
    interpreter's finalisation: a gloo thread that reaches a Python object while the interpreter
    shuts down ends the process in std::terminate ("terminate called without an active
    exception", exit -6) after a run that succeeded; seen about once in three test suites at
    world 2 with FSDP. Otherwise exit normally. Only for a process's own entry point
    (jobs/qat.py, `python -m workbench.train.cli`): a caller that goes on after the trainer
    returns (submitit's task writes its result then) must not use it."""
    if not live_backend_threads():
        raise SystemExit(code)
    import atexit

    # What a normal exit does first (wandb's teardown, logging's flush, ...), then no more: the
    # crash comes later, in the finalisation that frees the objects gloo's threads still reach.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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


# ---------------------------------------------------------------------------------------------
# The parallel layout: world = ep x dp.


@dataclass(frozen=True)
class Layout:
    """Which rank holds which shard. Mesh ("dp", "ep") over ranks arange(world).view(dp, ep):
    rank = d * ep + e, so an EP group (same d) is a contiguous block of ranks (EP4 x 2 over two
    nodes of 4 keeps each EP group, and its all-to-alls, on one node) and the expert-data-parallel
    group of EP index e is the ranks {e, ep + e, 2 ep + e, ...}.

    `ep_group`: the all-to-all group (the EP index is the rank in it); `dp_group`: the ranks that
    hold the same experts; `mesh` / `world_mesh`: the 2-D mesh and a 1-D mesh of every rank
    (FSDP shards dense parameters over it). Meshes are None without FSDP (and at world 1
    without FSDP): the legacy layout, EP size = world size, one process group."""

    ep: int
    dp: int
    fsdp: bool
    ep_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh
    world_mesh: object | None = None

    @property
    def world(self) -> int:
        return self.ep * self.dp


_SUBGROUPS: list = []  # process groups make_layout's meshes created (see teardown)


def ensure_group_for_fsdp() -> None:
    """FSDP2 needs a process group even in one process: make a single-rank one (gloo on CPU,
    NCCL on GPU) on a free loopback port when none exists and WORLD_SIZE is unset or 1."""
    if dist.is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store,
                            rank=0, world_size=1)


def make_layout(info: DistInfo, ep: int | None, fsdp: bool) -> Layout:
    """The layout for `ep` (None: the world size) and `fsdp` on this world. Collective when it
    builds meshes (every rank calls it). Errors name the TrainConfig field."""
    world = info.world
    ep = world if ep is None else ep
    if ep <= 0 or world % ep:
        raise ValueError(f"TrainConfig.ep={ep} does not divide the world size {world}")
    dp = world // ep
    if not fsdp:
        if dp != 1:
            raise ValueError(f"TrainConfig.ep={ep} < world size {world} needs TrainConfig.fsdp")
        return Layout(ep, 1, False, info.group, None)
    if not dist.is_initialized():
        raise RuntimeError("make_layout(fsdp=True) needs a process group "
                           "(distributed.ensure_group_for_fsdp at world 1)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
    world_mesh = init_device_mesh(info.device.type, (world,), mesh_dim_names=("world",))
    ep_group = mesh.get_group("ep") if ep > 1 else None
    default = dist.group.WORLD
    for g in (mesh.get_group("dp"), mesh.get_group("ep"), world_mesh.get_group()):
        if g is not default and g not in _SUBGROUPS:
            _SUBGROUPS.append(g)  # destroyed by teardown() before the default group
    return Layout(ep, dp, True, ep_group, mesh.get_group("dp"), mesh, world_mesh)
