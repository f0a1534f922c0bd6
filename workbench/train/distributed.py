"""Process-group set-up for the trainer.

Default layout, EP size = world size: the one process group is both the expert-parallel group
(experts sharded contiguously, tokens exchanged with all-to-all) and the data-parallel group (dense
parameters replicated, each rank trains on its slice of the global batch). gloo on CPU, NCCL on
GPU. With FSDP, `Layout` (below) splits the world into EP groups x expert-data-parallel groups.

Failures (docs/reliability.md). Every collective waits at most the run's distributed timeout
(`--dist-timeout`, minutes); a rank that stops answering is then named by the others. An error
is printed once per run, not once per rank: `on_main` and `agree` share one rank's failure with
every rank at a point where all of them meet (the failing rank reports it, the others raise
`PeerFailed`, which prints nothing), and `failure_line` elects one reporter through the process
group's key-value store for errors that every rank meets alike or one rank meets alone.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

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


DEFAULT_TIMEOUT_MIN = 10.0  # TrainConfig.dist_timeout's default, for callers without a config


def setup(*, single_rank_group: bool = False, timeout_min: float = DEFAULT_TIMEOUT_MIN
          ) -> DistInfo:
    """Use an existing default group; else init one from RANK/WORLD_SIZE/MASTER_* when WORLD_SIZE>1.
    `single_rank_group`: at world 1, still make a (one-rank) group: FSDP2 needs one.
    `timeout_min`: how long any collective of a group made here waits for the other ranks
    (torch's own default is 30 minutes)."""
    cuda = torch.cuda.is_available()
    owns = False
    timeout = _dt.timedelta(minutes=timeout_min)
    if single_rank_group and not dist.is_initialized() and _env_int("WORLD_SIZE", 1) <= 1:
        ensure_group_for_fsdp(timeout)
        owns = True
    if not dist.is_initialized() and _env_int("WORLD_SIZE", 1) > 1:
        for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(f"WORLD_SIZE>1 but {var} is not set; launch with torchrun "
                                   "or submitit (they set RANK, WORLD_SIZE, MASTER_ADDR/PORT)")
        local = _env_int("LOCAL_RANK", 0)
        if cuda:
            torch.cuda.set_device(local)
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        except dist.DistError as e:  # the rendezvous: a rank that never came
            raise RankTimeout(f"the {_env_int('WORLD_SIZE', 1)} ranks did not all join within "
                              f"--dist-timeout ({timeout_min:g} min): "
                              f"{' '.join(str(e).split())[:300]}") from None
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = _env_int("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1) if cuda else 0)
        group = dist.group.WORLD if world > 1 else None
    else:
        rank, world, local, group = 0, 1, 0, None
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return DistInfo(rank, world, local, device, group, owns)


def teardown(info: DistInfo, *, failed: bool = False) -> None:
    """Destroy the group setup() created. Every rank first passes a barrier: a rank that finished
    the last collective early must not close its gloo connections (and join their transport
    threads) while a peer is still reading from them, which can end the peer's process in
    std::terminate at exit instead of a clean exit 0. After a failure (`failed`) the other ranks
    may never reach that barrier: the groups are left to the process's exit."""
    if failed:
        return
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


def ensure_group_for_fsdp(timeout: _dt.timedelta | None = None) -> None:
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
                            rank=0, world_size=1,
                            timeout=timeout or _dt.timedelta(minutes=DEFAULT_TIMEOUT_MIN))


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


# ---------------------------------------------------------------------------------------------
# Failures: one rank's error reaches every rank, and one line per run reaches the user.

T = TypeVar("T")
_ON_MAIN_CALLS = itertools.count()  # every rank calls on_main in the same order: one key each


class PeerFailed(RuntimeError):
    """Another rank failed and reports it; this rank stops too, printing nothing (exit 2)."""


class RankTimeout(RuntimeError):
    """A rank stopped answering within the distributed timeout (hung or died)."""


def _raise_agreed(info: DistInfo, failures: list[tuple[int, str]],
                  mine: BaseException | None) -> None:
    """Raise on every rank after an agreement found `failures` ((rank, message) pairs, at least
    one): the lowest failing rank raises its own exception (it reports), the others PeerFailed."""
    reporter, message = failures[0]
    if info.rank == reporter and mine is not None:
        mine.reporter = reporter  # read by failure_line
        raise mine
    raise PeerFailed(f"rank {reporter} failed: {message}")


def on_main(info: DistInfo, fn: Callable[[], T]) -> T:
    """Collective: rank 0 runs `fn` (what only it does: claim the run folder, write the first
    files, tokenize the data), however long it takes (the others wait on the store, not in a
    collective the distributed timeout would end); its result reaches every rank, and so does
    its failure: rank 0 raises the exception (and reports it), the others PeerFailed. `fn`'s
    result must pickle (our own data, between this job's ranks)."""
    result: Any = None
    error: BaseException | None = None
    store = _store() if info.group is not None else None
    key = _key(f"on_main/{next(_ON_MAIN_CALLS)}")
    if info.is_main:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
            error = e
        if store is not None:
            store.set(key, "1")
    elif store is not None:
        pause = 0.01
        while not store.check([key]):
            time.sleep(pause)
            pause = min(0.5, pause * 2)
    if info.group is not None:
        box = [(result, None if error is None else _one_line(error))]
        dist.broadcast_object_list(box, src=0, group=info.group)
        result, message = box[0]
        if message is not None:
            _raise_agreed(info, [(0, message)], error)
    if error is not None:
        raise error
    return result


def agree(info: DistInfo, error: BaseException | None) -> None:
    """Collective: every rank passes the error it met in a step every rank does (or None);
    if any rank has one, the lowest such rank raises its own and the others PeerFailed."""
    if info.group is None:
        if error is not None:
            raise error
        return
    mine = None if error is None else _one_line(error)
    gathered: list[Any] = [None] * info.world
    dist.all_gather_object(gathered, mine, group=info.group)
    failures = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if failures:
        _raise_agreed(info, failures, error)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# The texts of gloo's and the store's failures when a peer is gone or silent (they have no type
# of their own beyond RuntimeError / DistError).
_LOST = re.compile(r"Timed out|timed out|Connection closed by peer|Connection reset by peer|"
                   r"Broken pipe|Connection was likely closed|failed to recv|Socket Timeout",
                   re.IGNORECASE)


def is_collective_failure(e: BaseException) -> bool:
    """`e` says that a collective could not complete: a peer died, or did not answer in time."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError)
                                             and bool(_LOST.search(str(e))))


def _agent_store() -> bool:
    # torchrun's agent hosts the store and outlives every rank
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _store_reachable(info: DistInfo) -> bool:
    """Whether the group's key-value store still answers. Rank 0 hosts it (unless torchrun's
    agent does); when rank 0 is gone, any store call would print a C++ stack trace."""
    if _agent_store() or info.is_main:
        return True
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return False
    try:
        with socket.create_connection((addr, int(port)), timeout=2.0):
            return True
    except (OSError, ValueError):
        return False


def _store():
    try:
        return dist.distributed_c10d._get_default_store()  # the group's own store (no API)
    except (RuntimeError, ValueError, AttributeError):
        return None


def _key(name: str) -> str:
    return f"workbench/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def _elect(store, info: DistInfo) -> bool:
    """The first rank to ask becomes the run's one reporter; True on that rank."""
    won = store.compare_set(_key("reporter"), "", str(info.rank))
    return won == str(info.rank).encode()


def failure_line(info: DistInfo, e: BaseException, *, timeout_min: float) -> str | None:
    """The one line this rank prints for `e` before exiting with code 2, or None when another
    rank reports (for every rank's failures of one run, exactly one rank gets a line).

    - PeerFailed: never (the failing rank reports); an agreed failure: its reporter.
    - A collective that could not complete: if a peer reported its error, nothing; else the ranks
      that are still alive name the ones that stopped answering (hung, or died).
    - Any other error: the first rank to meet it reports (an error every rank meets alike is
      one line); rank 0 waits for the others' word before leaving, as its exit ends the store."""
    if isinstance(e, PeerFailed):
        return None
    reporter = getattr(e, "reporter", None)
    if reporter is not None or info.group is None or not dist.is_initialized():
        return _one_line(e) if reporter in (None, info.rank) else None
    store = _store() if _store_reachable(info) else None
    if store is None:
        return (f"(rank {info.rank}) lost contact with rank 0, which hosts the job's rendezvous: "
                f"it died or was killed ({_one_line(e)[:200]})")
    try:
        if is_collective_failure(e):
            return _diagnose(store, info, e, timeout_min)
        line = _one_line(e) if _elect(store, info) else None
        store.add(_key("voted"), 1)
        if info.is_main and not _agent_store():
            _wait(lambda: int(store.add(_key("voted"), 0)) >= info.world, 10.0)
        return line
    except (RuntimeError, ValueError) as store_error:  # the store went away meanwhile
        return f"(rank {info.rank}) {_one_line(e)} [{_one_line(store_error)[:120]}]"


def _wait(done: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not done():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _diagnose(store, info: DistInfo, e: BaseException, timeout_min: float) -> str | None:
    """After a collective failed: who stopped answering? Every live rank marks itself alive and
    waits (at most the distributed timeout, a minute at most) for the others' marks."""
    if store.check([_key("reporter")]):
        return None  # a peer met an error of its own and reports it
    store.set(_key(f"alive/{info.rank}"), "1")
    alive = [_key(f"alive/{r}") for r in range(info.world)]
    _wait(lambda: store.check(alive) or store.check([_key("reporter")]),
          min(60.0, timeout_min * 60))
    if store.check([_key("reporter")]):
        return None
    missing = [r for r in range(info.world) if not store.check([_key(f"alive/{r}")])]
    if not _elect(store, info):
        return None
    if not missing:
        return f"a collective failed on every rank: {_one_line(e)[:300]}"
    who = ", ".join(map(str, missing))
    return (f"rank{'s' if len(missing) > 1 else ''} {who} stopped answering: the other ranks "
            f"waited --dist-timeout ({timeout_min:g} min) in a collective; "
            f"{'they are' if len(missing) > 1 else 'it is'} hung or died")
