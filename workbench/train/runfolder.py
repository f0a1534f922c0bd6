"""Run folders: what a run owns in its folder, and one writer at a time.

A run folder (the trainer's `--out`, a submitted job's folder) holds, besides what the run writes:

    workbench-run.json   the manifest: every entry the workbench created there (relative paths:
                         `config.json`, `checkpoints`, `checkpoints/step_00000010`, `export`, ...)
    workbench-run.lock   the lock file: `flock`ed by the one live writer for its whole life; it
                         records who that is (host, pid, process start, role, since when)

Ownership. A run writes only into a folder that is empty (or new) or already a run folder of
ours (it has a manifest), and only over entries the manifest names: a folder of someone else's
files (a model folder given as `--out`, a folder of notes) is refused before anything is written.
Pruning, export replacement and temporary clean-up remove only entries the manifest names, and an
entry is named in the manifest *before* it is created, so a crash never leaves an entry of ours
that the manifest does not name. A folder written by a workbench that predates manifests is
adopted on `--resume` only when it holds nothing but what a run writes and a complete checkpoint.

Locking. `fcntl.flock` on the lock file, taken without waiting: a second writer is refused at
once with the holder's record. The kernel drops a flock when its process dies, so a record left
behind by a killed run is stale; the next writer reports it and takes over. Where `flock` is not
supported (some network file systems return ENOLCK) the record alone decides: a holder on this
host is checked by pid and process start time; a holder on another host cannot be checked and
is reported as stale. On file systems whose flock is local to a node (Lustre mounted with
`localflock`), two writers on two nodes are not detected; on one node they are. The lock file is
never deleted (deleting a flock'd file lets two processes lock two different files); a clean
release empties it.

Standard library only: the launcher (torch-free) claims and locks folders too.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Self

from workbench._io import atomic_write_json, new_file_mode, writing

MANIFEST = "workbench-run.json"
LOCK = "workbench-run.lock"
FORMAT = "workbench.run/1"
MAX_RECORD_BYTES = 1 << 20
# A submission holds the lock for the moment it takes to queue a job; a trainer that starts
# meanwhile (a local job starts at once) waits for it this long rather than being refused.
SUBMIT_WAIT_S = 120.0
# `_io.atomic_open`'s temporary files (".NAME.XXXXXX.tmp"): a writer killed mid-write leaves one.
_ATOMIC_TMP = re.compile(r"^\..+\.[A-Za-z0-9_]{6,}\.tmp$")
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

# What the trainer writes at the top of its run folder (`--out`), and what the launcher adds
# (`eval`: the evaluation a submission chains after training, `workbench.eval.launch`).
TRAINER_ENTRIES = ("config.json", "metrics.jsonl", "result.json", "data.json", "wandb_run_id",
                   "wandb", "checkpoints", "export", ".tmp-export", ".old-export",
                   "expert_stats.parquet")
LAUNCH_ENTRIES = ("launch.json", "job_result.json", "submitit", "attempts", "eval")
RUN_ENTRIES = TRAINER_ENTRIES + LAUNCH_ENTRIES
_CHECKPOINT_ENTRY = re.compile(r"^(\.tmp-)?step_\d{8}$")


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (not ours, busy, damaged); one line naming it."""


class RunFolderBusy(RunFolderError):
    """Another live process writes into the run folder."""


# ---------------------------------------------------------------------------------------------
# The manifest.


def _rel(name: str) -> str:
    """A manifest entry: a relative POSIX path inside the folder (no '..', no absolute path)."""
    p = PurePosixPath(name)
    if (not name or p.is_absolute() or ".." in p.parts or str(p) != name or name == "."
            or "\\" in name):
        raise RunFolderError(f"{name!r} is not a path inside a run folder")
    return name


@dataclass
class Manifest:
    folder: Path
    owned: set[str] = field(default_factory=set)

    @classmethod
    def load(cls, folder: str | Path) -> Manifest | None:
        """The folder's manifest; None when it has none; RunFolderError when it is damaged."""
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.exists() and not path.is_symlink():
            return None
        try:
            if path.is_symlink() or not path.is_file():
                raise ValueError("not a regular file")
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            obj = json.loads(path.read_bytes().decode("utf-8"))
            if not isinstance(obj, dict) or obj.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} manifest")
            owned = obj.get("owned")
            if not isinstance(owned, list) or not all(isinstance(x, str) for x in owned):
                raise ValueError("'owned' must be a list of paths")
            return cls(folder, {_rel(x) for x in owned})
        except (OSError, ValueError, RecursionError) as e:  # RunFolderError is a ValueError
            raise RunFolderError(f"{path}: the run folder's manifest is damaged ({e}); what in "
                                 f"{folder} belongs to the run is unknown: restore the file or "
                                 "choose a new folder") from None

    def save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / MANIFEST, {"format": FORMAT,
                                                   "owned": sorted(self.owned)})

    def owns(self, name: str) -> bool:
        return _rel(name) in self.owned


def owned(folder: str | Path) -> frozenset[str]:
    """The entries the folder's manifest names (empty without one)."""
    m = Manifest.load(folder)
    return frozenset() if m is None else frozenset(m.owned)


def owns(folder: str | Path, name: str) -> bool:
    m = Manifest.load(folder)
    return m is not None and m.owns(name)


def own(folder: str | Path, *names: str) -> None:
    """Name `names` in the folder's manifest (made if missing) before they are created."""
    m = Manifest.load(folder) or Manifest(Path(folder))
    new = {_rel(n) for n in names} - m.owned
    if new:
        m.owned |= new
        m.save()


def disown(folder: str | Path, *names: str) -> None:
    """Drop `names` (and what lies under them) from the manifest, after they are removed."""
    m = Manifest.load(folder)
    if m is None:
        return
    drop = {_rel(n) for n in names}
    keep = {x for x in m.owned if x not in drop and not any(x.startswith(d + "/") for d in drop)}
    if keep != m.owned:
        m.owned = keep
        m.save()


def remove_owned(folder: str | Path, name: str) -> bool:
    """Remove `folder/name` if the manifest names it (then drop it from the manifest); returns
    whether it was ours. Anything else is left exactly as it is."""
    folder = Path(folder)
    if not owns(folder, name):
        return False
    path = folder / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    disown(folder, name)
    return True


# ---------------------------------------------------------------------------------------------
# Claiming a folder for a run.


def _entries(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n not in (MANIFEST, LOCK))


def _sample(names: list[str], n: int = 4) -> str:
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _is_legacy_run(folder: Path) -> bool:
    """A run folder written before manifests: nothing but what a run writes, and at least one
    complete checkpoint (a `checkpoints/step_*/COMPLETE` marker)."""
    allowed = set(RUN_ENTRIES)
    if not all(e in allowed or _ATOMIC_TMP.match(e) for e in _entries(folder)):
        return False
    return any((folder / "checkpoints").glob("step_*/COMPLETE"))


def check_claimable(folder: str | Path, names: Iterable[str], *, adopt_legacy: bool = False,
                    flag: str = "--out") -> str:
    """Refuse, writing nothing, a folder this run may not write into: a file; a folder that is
    neither empty nor a run folder of ours; a run folder where one of `names` (what the run will
    write) exists but is not ours. Returns what the folder is: "new" (absent or empty), "ours"
    (a manifest), or "legacy" (a run of an older workbench, adopted when `adopt_legacy`)."""
    folder = Path(folder)
    names = list(names)
    if folder.is_symlink() and not folder.exists():
        raise RunFolderError(f"{flag} {folder} is a broken symbolic link")
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{flag} {folder} is a file, not a folder")
    if not folder.exists():
        return "new"
    manifest = Manifest.load(folder)
    if manifest is None:
        entries = _entries(folder)
        if not entries:
            return "new"
        if adopt_legacy and _is_legacy_run(folder):
            return "legacy"
        raise RunFolderError(
            f"{flag} {folder} holds files that are not a workbench run's ({_sample(entries)}); "
            "a run writes only into a new or empty folder or into a run folder of its own: "
            f"choose another {flag}")
    foreign = [n for n in names if (folder / n).exists() and not manifest.owns(n)]
    if foreign:
        raise RunFolderError(
            f"{flag} {folder} is a run folder, but {_sample(foreign)} in it "
            f"{'was' if len(foreign) == 1 else 'were'} not written by the workbench; move "
            f"{'it' if len(foreign) == 1 else 'them'} away or choose another {flag}")
    return "ours"


def claim(folder: str | Path, names: Iterable[str], *, legacy: bool = False) -> Manifest:
    """Name `names` (what the run writes at the top of the folder) in the manifest; for a
    `legacy` run also what it already holds (its entries, its checkpoint folders). Call under
    the lock, after `check_claimable`."""
    folder = Path(folder)
    m = Manifest.load(folder) or Manifest(folder)
    m.owned |= {_rel(n) for n in names}
    if legacy:
        m.owned |= {e for e in _entries(folder) if e in RUN_ENTRIES}
        root = folder / "checkpoints"
        if root.is_dir():
            m.owned |= {f"checkpoints/{p.name}" for p in root.iterdir()
                        if _CHECKPOINT_ENTRY.match(p.name) and p.is_dir() and not p.is_symlink()}
    m.save()
    return m


# ---------------------------------------------------------------------------------------------
# The lock.


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_token(pid: int) -> str | None:
    """Identifies one process for its whole life: boot id + start time (clock ticks since boot).
    A pid is reused by the kernel; this pair is not. None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{_boot_id()}:{stat.rsplit(')', 1)[1].split()[19]}"


def _alive_here(holder: dict) -> bool:
    """The holder runs on this host and is still the very process that wrote the record."""
    pid, token = holder.get("pid"), holder.get("token")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    now = process_token(pid)
    return now is not None and (token is None or now == token)


def describe(holder: dict | None) -> str:
    if not holder:
        return "another process (it has not written its record yet)"
    what = {"trainer": "a trainer", "submit": "a submission"}.get(holder.get("role"), "a process")
    extra = f", {holder['what']}" if holder.get("what") else ""
    return (f"{what} (pid {holder.get('pid')} on {holder.get('host')}, since "
            f"{holder.get('since')}{extra})")


def _read_holder(fd: int) -> dict | None:
    try:
        data = os.pread(fd, MAX_RECORD_BYTES, 0)
        obj = json.loads(data.decode("utf-8")) if data.strip() else None
    except (OSError, ValueError, RecursionError):
        return {"pid": None, "host": "?", "since": "?"}  # unreadable: still somebody's
    return obj if isinstance(obj, dict) else None


@dataclass
class RunLock:
    """The held lock of one run folder; `release()` (or leaving the `with`) gives it back.
    `stale`: the record of a previous holder that died without releasing, if there was one."""

    folder: Path
    fd: int | None
    stale: dict | None = None
    flock: bool = True  # False where the file system refused flock (the record decides)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)  # released cleanly: the next holder finds no stale record
        except OSError:
            pass
        os.close(self.fd)  # drops the flock
        self.fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(folder: str | Path, *, role: str, what: str | None = None,
            wait_for_submit_s: float = 0.0) -> RunLock:
    """Take the folder's lock (creating the folder and the lock file if needed) or raise
    RunFolderBusy naming the holder. A holder that is a submission (`role` "submit") is waited
    for up to `wait_for_submit_s`: it holds the lock only while it queues the job."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    with writing(path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), new_file_mode())
    use_flock = True
    deadline = time.monotonic() + wait_for_submit_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _read_holder(fd)
                if (holder or {}).get("role") == "submit" and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                raise RunFolderBusy(f"{folder} is in use by {describe(holder)}: one writer per "
                                    "run folder; wait for it to end or choose another "
                                    "folder") from None
            except OSError as e:
                if e.errno not in _UNSUPPORTED:
                    raise
                use_flock = False
                break
        previous = _read_holder(fd)
        if previous and (previous.get("pid") != os.getpid()
                         or previous.get("host") != socket.gethostname()) \
                and _alive_here(previous):
            # flock succeeded but the recorded holder lives: this file system's flock is a no-op
            raise RunFolderBusy(f"{folder} is in use by {describe(previous)}: one writer per run "
                                "folder; wait for it to end or choose another folder")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "token": process_token(os.getpid()),
              "role": role, "since": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
        if what:
            me["what"] = what
        data = json.dumps(me).encode()
        with writing(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(folder, fd, previous or None, use_flock)

