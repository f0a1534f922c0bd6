"""Full-state DCP checkpoints: model, AdamW, LR schedule, data position, every rank's RNG, step.

Layout of `DIR/checkpoints/`:
    step_00000010/            a complete checkpoint (DCP files + COMPLETE)
    .tmp-step_00000020/       being written; never picked by resume
A checkpoint is written to `.tmp-*`, every file fsync'd (DCP's writer does it per file), the
files' sizes and SHA-256 digests computed (each rank hashes a share of the files), a `COMPLETE`
JSON marker holding them, the step, the world size and the run's configuration written and
fsync'd, then the folder is renamed to `step_*` and the parent fsync'd. The rename is the commit:
a crash at any earlier point leaves only a `.tmp-*` folder, which resume ignores and the next save
removes.

Ownership (`workbench.train.runfolder`): every `.tmp-*` and `step_*` folder is named in the run
folder's manifest before it is created; pruning, the clean-up of `.tmp-*` leftovers and the
replacement of a checkpoint of the same step touch only folders the manifest names, so a folder
someone else put in `checkpoints/` is never removed (nor counted by `keep`). A full disk (or
quota) is reported as such, naming the file system and the file, even where DCP's writer turns
the OS error into a bare "unexpected pos" (its zip writer swallows it).

Resume (`resume`) tries the complete checkpoints newest first. One is used only if every file
the marker lists has its recorded size and digest, its `.metadata` passes the allow-listed reader
(`workbench.checkpoint.dcp_metadata`: DCP's metadata is a pickle, and a run folder is not
trusted to hold code) and DCP loads it; otherwise the reason is printed and the next older one
is tried. When none loads, resume fails with every reason rather than start afresh over them.
The checkpoint a run resumed from is never pruned by that run (`save(protect=...)`): a newer
checkpoint may be bad in ways no digest sees (trained on NaNs), and it is the last one known good.
Every failure (DCP's `CheckpointException` derives from `BaseException`, so an `except Exception`
misses it) becomes a `CheckpointError` naming the file, raised on every rank alike.

Sharded experts: each expert stack (and its Adam moments) enters the state dict as a DTensor
`Shard(0)` over a 1-D mesh of the group, so DCP records one global [E, ...] tensor assembled from
the ranks' pieces; a checkpoint therefore also loads under another EP size. Replicated dense
tensors are written once (DCP deduplicates them). Everything in the state dict is a tensor, so
the reader refuses DCP's pickled-object entries outright. RNG states are per rank under
`rng/rank{r}/...` and are restored only when the world size matches.

Under FSDP the same keys hold the same global tensors (see `_expert_wrapper`), so a checkpoint
saved at one layout (EP size, FSDP or not, world size) loads at any other: DCP reads, for each
rank, the piece of each global tensor that rank holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from workbench._io import atomic_write_json, device_of, fsync_path, is_no_space, no_space
from workbench.checkpoint import errors as reader_errors
from workbench.checkpoint.dcp_metadata import SafeFileSystemReader
from workbench.train import runfolder
from workbench.train.distributed import DistInfo, barrier
from workbench.train.fsdp import EXPERT_DIM, reshard_
from workbench.model.parallel import is_expert_param

COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d{8})$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 1 << 22
# torch's zip writer (under DCP's) turns a failed write, ENOSPC included, into these texts; with
# less than _FULL_BELOW bytes left on the file system right after, the disk was full.
_WRITER_FAILED = re.compile(r"unexpected pos|PytorchStreamWriter failed writing")
_FULL_BELOW = 4 << 20


class CheckpointError(reader_errors.CheckpointError, RuntimeError):
    """A checkpoint folder is unusable, or cannot be written; the message names it."""


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    meta: dict


def checkpoint_root(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _read_marker(marker: Path) -> dict:
    try:
        meta = json.loads(marker.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"COMPLETE marker is not valid JSON ({e})", path=marker) from None
    if not isinstance(meta, dict):
        raise CheckpointError("COMPLETE marker is not a JSON object", path=marker)
    return meta


def _step_folders(out: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(out)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def list_complete(out: str | Path) -> list[Found]:
    """Every `step_*` folder with a COMPLETE marker, oldest first (a marker that is not JSON
    raises: see `candidates` for the scan that tolerates it)."""
    return [Found(step, p, _read_marker(p / COMPLETE)) for step, p in _step_folders(out)]


def candidates(out: str | Path) -> list[Found | CheckpointError]:
    """The complete checkpoints newest first; a damaged marker stands as its error."""
    res: list[Found | CheckpointError] = []
    for step, p in reversed(_step_folders(out)):
        try:
            res.append(Found(step, p, _read_marker(p / COMPLETE)))
        except CheckpointError as e:
            res.append(e)
    return res


def newest_complete(out: str | Path) -> Found | None:
    found = list_complete(out)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------
# Collective agreement: a failure seen by one rank is raised on all of them, never a hang.


def _agree(info: DistInfo, error: str | tuple[Path, str] | None, path: Path) -> None:
    """Raise CheckpointError on every rank if any rank has an `error` (a message about `path`,
    or a (file, message) pair naming another file)."""
    errs = _gather(info, None if error is None else
                   (str(error[0]), error[1]) if isinstance(error, tuple) else (str(path), error))
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        rank, (where, msg) = bad[0]
        raise CheckpointError(msg if info.world == 1 else f"(rank {rank}) {msg}", path=where)


def _gather(info: DistInfo, obj: Any) -> list[Any]:
    if info.group is None:
        return [obj]
    objs: list[Any] = [None] * info.world
    dist.all_gather_object(objs, obj, group=info.group)
    return objs


def _dcp_failure(e: BaseException) -> str:
    """One line from DCP's CheckpointException (rank -> (exception, traceback)) or an error."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, (exc, _tb) in sorted(e.failures.items()):
            parts.append(f"rank {rank}: {_dcp_failure(exc)}")
        return "; ".join(parts) or "DCP reported a failure without details"
    if isinstance(e, reader_errors.CheckpointError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _failures(e: BaseException) -> list[BaseException]:
    if isinstance(e, CheckpointException):
        return [x for _, (exc, _tb) in sorted(e.failures.items()) for x in _failures(exc)]
    return [e]


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def _disk_full(e: BaseException, folder: Path) -> str | None:
    """The one-line "no space left on DEVICE while writing PATH" for a failed write into
    `folder`, or None when the failure is not a full disk or quota."""
    failures = _failures(e)
    for x in failures:
        if is_no_space(x):
            return str(no_space(x, getattr(x, "filename", None) or folder))
    if not any(_WRITER_FAILED.search(str(x)) for x in failures):
        return None
    free = _free_bytes(folder)
    if free is not None and free < _FULL_BELOW:
        return f"no space left on {device_of(folder)} while writing {folder}"
    return None


# ---------------------------------------------------------------------------------------------
# Digests: every file of a checkpoint folder, hashed by the ranks in turn.


def _sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _digests(folder: Path, names: list[str], info: DistInfo) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of `names` in `folder`; rank r hashes names[r::world].
    Collective; a file that cannot be read raises CheckpointError on every rank."""
    mine: dict[str, dict] = {}
    err = None
    for name in names[info.rank::info.world]:
        try:
            n, hexd = _sha256(folder / name)
        except OSError as e:
            err = (folder / name, f"cannot read it: {e.strerror or e}")
            break
        mine[name] = {"bytes": n, "sha256": hexd}
    _agree(info, err, folder)
    out: dict[str, dict] = {}
    for part in _gather(info, mine):
        out.update(part)
    return dict(sorted(out.items()))


def verify(found: Found, info: DistInfo) -> bool:
    """Collective. Check the files against the marker's digests; False when the marker predates
    digests (nothing to check), CheckpointError naming the first file that differs."""
    files = found.meta.get("files")
    if files is None:
        return False
    marker = found.path / COMPLETE
    if not (isinstance(files, dict) and files and all(
            isinstance(k, str) and "/" not in k and k not in (".", "..", COMPLETE)
            and isinstance(v, dict) and isinstance(v.get("bytes"), int)
            and isinstance(v.get("sha256"), str) and _SHA256_RE.match(v["sha256"])
            for k, v in files.items())):
        raise CheckpointError("its file list is damaged", path=marker)
    names = sorted(files)
    err = None
    for name in names:  # sizes first: cheap, and what a truncation or a lost file changes
        p = found.path / name
        if p.is_symlink() or not p.is_file():
            err = (p, "missing (COMPLETE lists it)")
            break
        size = p.stat().st_size
        if size != files[name]["bytes"]:
            err = (p, f"{size} bytes, COMPLETE recorded {files[name]['bytes']} (truncated?)")
            break
    _agree(info, err, found.path)
    got = _digests(found.path, names, info)
    for name in names:
        if got[name]["sha256"] != files[name]["sha256"]:
            raise CheckpointError("SHA-256 differs from the one COMPLETE recorded (the file "
                                  "changed after it was written)", path=found.path / name)
    return True


# ---------------------------------------------------------------------------------------------
# The state dict: flat {key: tensor}; expert tensors wrapped as DTensor shards.


def _expert_wrapper(info: DistInfo, model: nn.Module):
    """name, tensor -> what the state dict holds for it: the same global tensor at every layout.

    Without FSDP: dense tensors as they are (replicated), expert stacks as DTensor Shard(0) over
    a 1-D mesh of the world (EP = world). Under FSDP (workbench.train.fsdp) dense tensors are
    already DTensors over the world, saved as they are; an expert stack is FSDP's Shard(1) over
    the "dp" mesh of an EP slice, which is re-described over the 2-D (dp, ep) mesh as
    (Shard(1), Shard(0)) of the global [E, ...] stack. Every wrap is a view of the rank's own
    storage (`from_local(run_check=False)` adds no copy, no collective), so DCP loads in place."""

    layout = getattr(model, "layout", None)
    if layout is not None and layout.fsdp:
        return _fsdp_wrapper(model, layout)
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


def _fsdp_wrapper(model: nn.Module, layout):
    from torch.distributed.tensor import DTensor, Shard


    def wrap(name: str, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            raise TypeError(f"{name} is a plain tensor under FSDP (not sharded: was "
                            "apply_fsdp run on this model?)")
        if not is_expert_param(model, name):
            return t  # FSDP's Shard(0) over the world mesh: a global tensor already
        if t.placements != (Shard(EXPERT_DIM),):
            raise RuntimeError(f"{name} is placed {t.placements} under FSDP, expected "
                               f"Shard({EXPERT_DIM}) over dp")
        local_shape = tuple(t.shape)  # the EP slice [E/ep, ...] (the DTensor's global shape)
        shape = (local_shape[0] * layout.ep, *local_shape[1:])
        return DTensor.from_local(t.to_local(), layout.mesh, [Shard(EXPERT_DIM), Shard(0)],
                                  run_check=False, shape=torch.Size(shape),
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
    layout = getattr(model, "layout", None)
    if layout is not None and layout.fsdp:
        reshard_(model)  # the shards, not parameters a no-grad forward left gathered
    wrap = _expert_wrapper(info, model)
    ensure_optimizer_state(opt)
    sd: dict[str, torch.Tensor] = {}
    index = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        # detach(), not .data: it shares the parameter's version counter, so a DCP load into
        # it counts as a write (what knows values by version, e.g. QAT's amax book, sees it)
        sd[f"model/{name}"] = wrap(name, p.detach())
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
         keep: int, meta: dict, protect: int | None = None) -> Path:
    """Collective: every rank calls it. Returns the final folder. `protect`: a step that
    pruning keeps whatever `keep` says (the checkpoint this run resumed from). A failure (disk
    full, ...) raises CheckpointError on every rank and leaves the older checkpoints as they were."""
    root = checkpoint_root(out)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    rel_tmp, rel_final = f"checkpoints/{tmp.name}", f"checkpoints/{final.name}"
    err = None
    if info.is_main:
        try:
            for rel in (rel_tmp, rel_final):
                if (Path(out) / rel).exists() and not runfolder.owns(out, rel):
                    raise runfolder.RunFolderError(f"{Path(out) / rel} exists and was not "
                                                   "written by this run; move it away")
            if not root.exists():
                runfolder.own(out, "checkpoints")
            runfolder.own(out, rel_tmp)  # named before it exists: a crash leaves nothing unnamed
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash: never complete, safe to discard
                shutil.rmtree(tmp)
            tmp.mkdir()
        except runfolder.RunFolderError as e:
            err = str(e)
        except OSError as e:
            err = _disk_full(e, tmp) or f"cannot create {tmp}: {e}"
    _agree(info, err, tmp)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state_dict(model, opt, sched, step, info), checkpoint_id=str(tmp),
                     process_group=info.group, no_dist=info.group is None)
    except (CheckpointException, OSError) as e:
        full = _disk_full(e, tmp)  # before the half-written folder is removed
        _discard(tmp, info)
        if full is not None:
            raise CheckpointError(f"{full} (the checkpoint of step {step} was not written; the "
                                  "older checkpoints are kept)") from None
        raise CheckpointError(f"cannot write checkpoint: {_dcp_failure(e)}", path=tmp) from None
    barrier(info)
    try:
        # rank 0's listing for all: another node's view of a shared folder may lag
        names = _gather(info, sorted(n for n in os.listdir(tmp) if n != COMPLETE)
                        if info.is_main else None)[0]
        files = _digests(tmp, names, info)
    except (OSError, CheckpointError) as e:
        _discard(tmp, info)
        raise CheckpointError(f"cannot hash the checkpoint's files: {e}", path=tmp) from None
    err = None
    if info.is_main:
        marker = tmp / COMPLETE
        try:
            atomic_write_json(marker, {"step": step, "world_size": info.world, **meta,
                                       "files": files})
            fsync_path(tmp)
            runfolder.own(out, rel_final)
            if final.exists():  # a re-run of the same step after a resume: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_path(root)
            runfolder.disown(out, rel_tmp)
            _prune(root, keep, protect)
        except OSError as e:
            err = _disk_full(e, marker) or f"cannot complete the checkpoint: {e}"
    if err is not None:
        _discard(tmp, info, collective=False)
    _agree(info, err, final)
    return final


def _discard(tmp: Path, info: DistInfo, *, collective: bool = True) -> None:
    """Remove a checkpoint that failed half-written (it would only take space)."""
    if collective:
        barrier(info)
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(root: Path, keep: int, protect: int | None = None) -> None:
    """Keep the newest `keep` checkpoints of this run (and `protect`); remove its older ones and
    its `.tmp-*` leftovers. Folders the run folder's manifest does not name stay, uncounted."""
    out = root.parent
    mine = {f"checkpoints/{p.name}" for p in root.iterdir()} & runfolder.owned(out)
    steps = [(s, p) for s, p in _step_folders(out) if f"checkpoints/{p.name}" in mine]
    for step, path in steps[:-keep]:
        if step != protect:
            runfolder.remove_owned(out, f"checkpoints/{path.name}")
    for p in root.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            runfolder.remove_owned(out, f"checkpoints/{p.name}")


def load(found: Found, model: nn.Module, opt, sched, info: DistInfo) -> int:
    """Collective: restore everything in place from a complete checkpoint; returns its step.
    The metadata is read by the allow-listed reader; every failure is a CheckpointError
    naming the file, raised on every rank."""
    sd = state_dict(model, opt, sched, 0, info)
    same_world = found.meta.get("world_size", -1) == info.world
    if not same_world:  # another EP size: weights and moments reshard, RNG streams do not map
        sd = {k: v for k, v in sd.items() if not k.startswith("rng/")}
    reader = SafeFileSystemReader(found.path)
    err = None
    try:
        md = reader.read_metadata()
        missing = sorted(set(sd) - set(md.state_dict_metadata))
        if missing:
            err = (f"the checkpoint lacks {len(missing)} tensor(s) this model has, e.g. "
                   f"{missing[:3]} (another preset or recipe?)")
    except reader_errors.CheckpointError as e:
        err = (Path(e.path or found.path),
               e.detail + (f" (tensor {e.tensor!r})" if e.tensor else ""))
    _agree(info, err, found.path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(sd, storage_reader=reader, process_group=info.group,
                     no_dist=info.group is None)
    except (CheckpointException, Exception) as e:  # noqa: BLE001 - DCP raises both kinds
        raise CheckpointError(f"cannot load checkpoint: {_dcp_failure(e)}",
                              path=found.path) from None
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
        raise CheckpointError(f"folder says step {found.step}, state says {step}",
                              path=found.path)
    if dist.is_initialized() and info.group is not None:
        barrier(info)
    return step


def resume(out: str | Path, model: nn.Module, opt, sched, info: DistInfo, *,
           log: Callable[[str], None] | None = None) -> Found | None:
    """Collective: load the newest checkpoint in `out` that verifies and loads; None if `out`
    has no complete checkpoint. Each one skipped is reported through `log` (rank 0's print by
    default) with the reason; if none loads, CheckpointError lists every reason."""
    if log is None:
        def log(msg: str) -> None:
            if info.is_main:
                print(msg, flush=True)

    skipped: list[str] = []
    cands = candidates(out)
    for c in cands:
        if isinstance(c, CheckpointError):
            reason = str(c)
        else:
            try:
                if not verify(c, info):
                    log(f"[train] {c.path}: COMPLETE records no digests (older trainer); "
                        "its files are not verified")
                load(c, model, opt, sched, info)
            except CheckpointError as e:
                reason = str(e)
            else:
                if skipped:
                    log(f"[train] fell back to {c.path} (step {c.step}): "
                        f"{len(skipped)} newer checkpoint(s) unusable")
                return c
        skipped.append(reason)
        log(f"[train] skipping an unusable checkpoint: {reason}")
    if cands:
        raise CheckpointError("no checkpoint could be resumed from (" + "; ".join(skipped) + ")",
                              path=checkpoint_root(out))
    return None
