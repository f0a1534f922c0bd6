"""Small real distributed functions run inside submitit jobs by the launch tests.

Each takes the job argv (`--out=DIR --steps=N --seed=S ...`, see LaunchSpec.job_argv) and
runs in every rank of the job with the process group the launch layer set up. They are imported
by the job through LaunchSpec.pythonpath (this folder).

`counting_loop` follows the trainer's preemption contract (see workbench.launch.job): a flag set
by `request_stop` (the job's USR2 handler), all-reduced at each step boundary; when any rank asked,
every rank writes its checkpoint shard and the function returns {"stopped": True}. It lets the
launch layer's preemption path be tested before, and independently of, the real trainer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

_STOP = False


def request_stop() -> None:
    global _STOP
    _STOP = True


def _args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--start-s", type=float, default=0.0)
    args, _ = p.parse_known_args(argv)
    return args


def rank_info(argv):
    """A real gloo all_reduce and all_gather; rank 0 returns what every rank saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    me = {"rank": rank, "world_size": world, "local_rank": int(os.environ["LOCAL_RANK"]),
          "node": os.environ.get("SLURM_NODEID", "local"),
          "slurmd": os.environ.get("SLURMD_NODENAME"),
          "host": socket.gethostname(), "master_addr": os.environ["MASTER_ADDR"],
          "backend": dist.get_backend(), "all_reduce_sum": t.item(), "pid": os.getpid()}
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    return {"ranks": everyone, "seed": _args(argv).seed}


def single(argv):
    """World size 1: no process group; returns the seed it was given."""
    return {"seed": _args(argv).seed, "initialized": dist.is_available() and dist.is_initialized()}


def sleeper(argv):
    time.sleep(600)
    return {"slept": True}


def counting_loop(argv):
    """A toy distributed 'training' loop with checkpoint/resume and a continuous curve."""
    global _STOP
    a = _args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(a.out)
    if a.start_s:  # a slow start-up that then resets the stop flag, as the trainer's main does
        (out / f"starting{rank}").write_text("")
        time.sleep(a.start_s)
        _STOP = False
    ckpt = out / "ckpt"
    start = 0
    if a.resume and (ckpt / "complete").is_file():
        start = int((ckpt / "complete").read_text())
        shard = json.loads((ckpt / f"rank{rank}.json").read_text())
        assert shard["step"] == start, shard
    metrics = out / "metrics.jsonl"
    if rank == 0 and a.resume and metrics.is_file():  # keep only steps <= the checkpoint
        kept = [ln for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= start]
        metrics.write_text("".join(ln + "\n" for ln in kept))
    for step in range(start + 1, a.steps + 1):
        x = torch.tensor([float(step * (rank + 1))])
        dist.all_reduce(x)  # the step's "collective"
        loss = math.exp(-0.1 * step) + x.item() / (step * world * (world + 1) / 2) - 1.0
        if rank == 0:
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "pid": os.getpid()}) + "\n")
        time.sleep(a.step_s)
        flag = torch.tensor([1.0 if _STOP else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0 and step < a.steps:
            ckpt.mkdir(parents=True, exist_ok=True)
            (ckpt / f"rank{rank}.json").write_text(json.dumps({"step": step}))
            dist.barrier()
            if rank == 0:
                (ckpt / "complete").write_text(str(step))
            dist.barrier()
            return {"stopped": True, "step": step}
    return {"stopped": False, "steps": a.steps, "started_at": start, "pid": os.getpid()}
