"""Full-state DCP checkpoints: model, AdamW, LR schedule, data position, every rank's RNG, step.

Layout of `DIR/checkpoints/`:
    step_00000010/            a complete checkpoint (DCP files + COMPLETE)
    .tmp-step_00000020/       being written; never picked by resume
A checkpoint is written to `.tmp-*`, every file fsync'd (DCP's writer does it per file), a
`COMPLETE` JSON marker written and fsync'd, then the folder is renamed to `step_*` and the parent
fsync'd. The rename is the commit: a crash at any earlier point leaves only a `.tmp-*` folder,
which resume ignores and the next save removes. Resume takes the newest `step_*` that holds
`COMPLETE`.

Sharded experts: each expert stack (and its Adam moments) enters the state dict as a DTensor
`Shard(0)` over a 1-D mesh of the group, so DCP records one global [E, ...] tensor assembled from
the ranks' pieces; a checkpoint therefore also loads under another EP size. Replicated dense
tensors are written once (DCP deduplicates them). Everything in the state dict is a tensor, so
loading never unpickles a value (DCP's own `.metadata` file is pickled by DCP; it is only read
from checkpoints this trainer wrote). RNG states are per rank under `rng/rank{r}/...` and are
restored only when the world size matches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from workbench.checkpoint.export import fsync_path
from workbench.train.distributed import DistInfo, barrier

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint folder is unusable; the message names it."""


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    meta: dict


def checkpoint_root(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def list_complete(out: str | Path) -> list[Found]:
    root = checkpoint_root(out)
    found = []
    if not root.is_dir():
        return found
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        marker = p / COMPLETE
        if m and p.is_dir() and marker.is_file():
            try:
                meta = json.loads(marker.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{marker}: COMPLETE marker is not valid JSON ({e})") from e
            found.append(Found(int(m.group(1)), p, meta))
    return sorted(found, key=lambda f: f.step)


def newest_complete(out: str | Path) -> Found | None:
    found = list_complete(out)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------
# The state dict: flat {key: tensor}; expert tensors wrapped as DTensor shards.


def _expert_wrapper(info: DistInfo, model: nn.Module):
    from workbench.model.parallel import is_expert_param

    if info.group is None:
        return lambda name, t: t
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(info.device.type, (info.world,))

    def wrap(name: str, t: torch.Tensor) -> torch.Tensor:
        if not is_expert_param(model, name):
            return t
        shape = (t.shape[0] * info.world, *t.shape[1:])
        # run_check=False: no collective, and the DTensor's local tensor IS `t` (loads in place).
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    return wrap


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state as `AdamW._init_group` does, so a load can fill it."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def state_dict(model: nn.Module, opt: torch.optim.Optimizer, sched, step: int,
               info: DistInfo) -> dict[str, torch.Tensor]:
    wrap = _expert_wrapper(info, model)
    ensure_optimizer_state(opt)
    sd: dict[str, torch.Tensor] = {}
    index = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        sd[f"model/{name}"] = wrap(name, p.data)
    for gi, group in enumerate(opt.param_groups):
        sd[f"optim/group{gi}/lr"] = torch.tensor(float(group["lr"]), dtype=torch.float64)
        for p in group["params"]:
            name = index[id(p)]
            for k, v in opt.state[p].items():
                sd[f"optim/{name}/{k}"] = wrap(name, v) if v.dim() else v
    sd["sched/last_epoch"] = torch.tensor(int(sched.last_epoch), dtype=torch.int64)
    sd["train/step"] = torch.tensor(int(step), dtype=torch.int64)
    sd[f"rng/rank{info.rank}/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        sd[f"rng/rank{info.rank}/cuda"] = torch.cuda.get_rng_state(info.device)
    return sd


def save(out: str | Path, model: nn.Module, opt, sched, step: int, info: DistInfo, *,
         keep: int, meta: dict) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    root = checkpoint_root(out)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if info.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash: never complete, safe to discard
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier(info)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state_dict(model, opt, sched, step, info), checkpoint_id=str(tmp),
                 process_group=info.group, no_dist=info.group is None)
    barrier(info)
    if info.is_main:
        marker = tmp / COMPLETE
        with open(marker, "w") as f:
            json.dump({"step": step, "world_size": info.world, **meta}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # a re-run of the same step after a resume: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(root)
        _prune(root, keep)
    barrier(info)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = list_complete(root.parent)
    for f in complete[:-keep]:
        shutil.rmtree(f.path)
    for p in root.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p)


def load(found: Found, model: nn.Module, opt, sched, info: DistInfo) -> int:
    """Collective: restore everything in place from a complete checkpoint; returns its step."""
    sd = state_dict(model, opt, sched, 0, info)
    same_world = int(found.meta.get("world_size", -1)) == info.world
    if not same_world:  # another EP size: weights and moments reshard, RNG streams do not map
        sd = {k: v for k, v in sd.items() if not k.startswith("rng/")}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(found.path), process_group=info.group,
                     no_dist=info.group is None)
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {found.path}: {e}") from e
    lrs = [float(sd[f"optim/group{gi}/lr"]) for gi in range(len(opt.param_groups))]
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    sched.last_epoch = int(sd["sched/last_epoch"])
    sched._last_lr = lrs  # what get_last_lr() returns after the step the checkpoint ended on
    if same_world:
        torch.set_rng_state(sd[f"rng/rank{info.rank}/cpu"])
        if torch.cuda.is_available() and f"rng/rank{info.rank}/cuda" in sd:
            torch.cuda.set_rng_state(sd[f"rng/rank{info.rank}/cuda"], info.device)
    step = int(sd["train/step"])
    if step != found.step:
        raise CheckpointError(f"{found.path}: folder says step {found.step}, state says {step}")
    if dist.is_initialized() and info.group is not None:
        barrier(info)
    return step
