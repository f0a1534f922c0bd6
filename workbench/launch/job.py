"""What runs inside each task of a submitit job: distributed set-up, the trainer call, preemption.

`DistributedJob` is the pickled callable submitit runs once per task (rank). It wires
`torch.distributed` from submitit's environment (`TorchDistributedEnvironment`, NCCL when CUDA is
present, gloo otherwise), calls the target (`workbench.train.cli:main` by default) with the trainer
argv, and writes rank 0's return value as JSON next to the run (no pickle needed to read it back).

Preemption and time limits, designed against submitit 1.5.4's sources
(core/submission.py, core/job_environment.py, slurm/slurm.py):

* Before calling us, submitit's `process_job` installs `SignalHandler`: SIGTERM and SIGCONT are
  logged and ignored; SIGUSR2 runs `checkpoint_and_try_requeue`, which on rank 0 calls our
  `checkpoint()`, dumps the resubmission pickle, runs `scontrol requeue` and then `sys.exit(-1)`
  *from inside the signal handler*, wherever the main thread is: possibly in the middle of an
  all-to-all, with a DCP save half written. Ranks other than 0 only log and carry on, then hang in
  the next collective until the requeue kills them. Nothing is saved since the last periodic
  checkpoint.
* So `__call__` replaces (only) the SIGUSR2 handler with one that calls `stop_hook()`
  (`workbench.train.loop.request_stop`), which merely sets a flag: safe in a signal handler.
  The request is latched: a helper thread re-asserts it every 0.5 s until the target returns,
  so a signal that comes during start-up survives a target that resets its flag there (the
  workbench trainer no longer does: it clears the flag only after training returns).
  Slurm delivers `scancel --signal=USR2` (what `job._interrupt()` sends) and the `--signal=USR2@90`
  warning before the time limit to every task; one rank receiving it is enough, because the trainer
  all-reduces the flag at each step boundary. All ranks then save a DCP checkpoint and the trainer
  returns `{"stopped": True, ...}`.
* Back here every rank passes a barrier (all shards are on disk), the process group is destroyed,
  and rank 0 writes the resubmission, this callable with `resume=True` (the trainer then gets
  `--resume`), to the job's submitted pickle (atomically; submitit reloads that file when the job
  restarts) and requeues through submitit's own `JobEnvironment._requeue` (`scontrol requeue` on
  Slurm, the requeue exit code on the local executor). Every rank then leaves with `SystemExit`,
  which `process_job` does not catch, so no result pickle is written and the job is not finished.
* Time limits count as in submitit, except for when a stop is a time limit: a stop requested
  within the executor's signal delay (+60 s slack) of the limit uses one of the job's
  `max_num_timeout` requeues; with none left the job ends with `UncompletedJobError` instead of
  requeueing. Preemptions do not use them up.
* A SIGUSR2 that arrives during start-up, before our handler is installed, still reaches
  submitit's handler; `checkpoint()` then returns the `resume=True` resubmission, which is safe
  because no collective has started.
* An outside `scontrol requeue` (e.g. a node failure) does not call `checkpoint()`; the job
  restarts from the original pickle, with `resume=False`. Slurm numbers the restarts of a job in
  `SLURM_RESTART_COUNT` (every task of an attempt sees the same value), so any attempt after the
  first passes `--resume` anyway: it continues from the newest complete checkpoint (or starts
  fresh if there is none) instead of meeting the trainer's refusal to overwrite a run.

This relies on private submitit 1.5.4 names (`DelayedSubmission._timeout_min`,
`_timeout_countdown`, `JobEnvironment._requeue`, `_usr_sig`): the launch extra pins submitit.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from submitit.core import utils as _su
from submitit.core.job_environment import JobEnvironment
from submitit.helpers import Checkpointable, TorchDistributedEnvironment

from workbench._io import atomic_write_json

log = logging.getLogger("workbench.launch")


def resolve(dotted: str) -> Callable:
    """Import `package.module:function`."""
    module, _, attr = dotted.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"cannot import {dotted!r} in the job ({e}); is its folder on the job's "
                          "PYTHONPATH (LaunchSpec.pythonpath)?") from e
    if not callable(fn):
        raise TypeError(f"{dotted!r} is not callable")
    return fn


def restarted() -> bool:
    """True in a Slurm job's second and later attempts (requeued by anyone, for any reason)."""
    raw = os.environ.get("SLURM_RESTART_COUNT", "")
    try:
        return int(raw) > 0
    except ValueError:
        return False  # unset (first attempt, or the local executor) or not a number


class _LatchedStop:
    """Level-triggered stop request. The signal handler calls the hook once; after that a
    daemon thread calls it again every `every_s` until the target returns, because a target may
    reset its flag while starting up, and a preemption signal that arrives during a long start-up
    must not be lost."""

    def __init__(self, hook: Callable[[], object], every_s: float = 0.5):
        self._hook, self._every_s = hook, every_s
        self._seen = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def on_signal(self, signum, frame) -> None:
        self._hook()  # only sets a flag; safe in a signal handler
        if not self._seen.is_set():
            self._seen.set()
            self._thread = threading.Thread(target=self._reassert, name="workbench-stop",
                                            daemon=True)
            self._thread.start()

    def _reassert(self) -> None:
        while not self._done.wait(self._every_s):
            self._hook()

    def close(self) -> None:
        self._done.set()


@dataclass
class DistributedJob(Checkpointable):
    """Runs `target(argv)` in every rank of a submitit job; see the module docstring."""

    target: str
    argv: tuple[str, ...]
    result_path: str
    stop_hook: str
    pythonpath: tuple[str, ...] = ()
    resume: bool = False
    dist_timeout_s: int = 600
    signal_delay_s: int = 90  # --signal=USR2@N: the time-limit warning comes N s early

    def checkpoint(self, *args, **kwargs) -> _su.DelayedSubmission:
        # Only reached through submitit's own handler (signal before __call__ installed ours).
        return _su.DelayedSubmission(dataclasses.replace(self, resume=True))

    def __call__(self) -> object:
        for p in reversed(self.pythonpath):
            if p not in sys.path:
                sys.path.insert(0, p)
        stop = _LatchedStop(resolve(self.stop_hook))
        signal.signal(JobEnvironment._usr_sig(), stop.on_signal)
        started = time.time()

        import torch
        import torch.distributed as dist

        # overwrite=True: sbatch exports the submitter's environment, which may carry a stale
        # RANK/MASTER_ADDR (e.g. when launched from inside another distributed job).
        denv = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        node = os.environ.get("SLURMD_NODENAME", socket.gethostname())
        print(f"[workbench.launch] rank {denv.rank}/{denv.world_size} local_rank {denv.local_rank} "
              f"on {node} master {denv.master_addr}:{denv.master_port} resume={self.resume} "
              f"restart={os.environ.get('SLURM_RESTART_COUNT', '0')}",
              flush=True)
        own_pg = False
        if denv.world_size > 1 and not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(denv.local_rank % torch.cuda.device_count())
            dist.init_process_group("nccl" if cuda else "gloo",
                                    timeout=_dt.timedelta(seconds=self.dist_timeout_s))
            own_pg = True

        argv = list(self.argv)
        if (self.resume or restarted()) and "--resume" not in argv:
            argv.append("--resume")
        try:
            result = resolve(self.target)(argv)
        finally:
            stop.close()

        if isinstance(result, Mapping) and result.get("stopped"):
            self._requeue_after_stop(denv.rank, started, own_pg)  # never returns
        if denv.rank == 0:
            atomic_write_json(Path(self.result_path), {"ok": True, "result": result}, default=str)
        if own_pg:
            dist.barrier()
            dist.destroy_process_group()
        return result

    def _requeue_after_stop(self, rank: int, started: float, own_pg: bool) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank has returned, so every DCP shard is written
            if own_pg:
                dist.destroy_process_group()
        if rank != 0:
            print(f"[workbench.launch] rank {rank}: stopped at a step boundary; rank 0 requeues",
                  flush=True)
            sys.exit(-1)
        env = JobEnvironment()
        pickle_path = env.paths.submitted_pickle
        current = _su.DelayedSubmission.load(pickle_path)  # submitit's own submission file
        # A stop that came within the time-limit warning window (plus start-up slack) is a time
        # limit; anything earlier is a preemption. submitit's own rule, min(0.8 x limit,
        # limit - 10 min), would count every signal of a job shorter than 10 min as a time limit.
        limit_s = current._timeout_min * 60
        timed_out = time.time() - started >= limit_s - self.signal_delay_s - 60
        countdown = current._timeout_countdown - int(timed_out)
        if countdown < 0:
            raise _su.UncompletedJobError(
                f"job {env.job_id} stopped at its time limit too many times; not requeued")
        nxt = _su.DelayedSubmission(dataclasses.replace(self, resume=True))
        nxt.set_timeout(current._timeout_min, countdown)
        with _su.temporary_save_path(pickle_path) as tmp:
            nxt.dump(tmp)
        why = "time limit" if timed_out else "preempted"
        print(f"[workbench.launch] rank 0: checkpoint saved ({why}),"
              f" requeueing job {env.job_id} ({countdown} time-limit requeues left)", flush=True)
        env._requeue(countdown)  # Slurm: scontrol requeue; local: exits with the requeue code
        sys.exit(-1)
