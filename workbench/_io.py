"""Atomic file writes: the one helper every writer of a file that readers may open uses.

A reader (a resumed trainer, a notebook, a watcher polling a job) must see either the previous
complete file or the new complete one, never a prefix, even if the writer is SIGKILLed or the
node loses power. The recipe, in this order:

1. write a temporary file in the *same folder* (a rename is atomic only within one filesystem);
   its name is unique (`mkstemp`), so two processes writing the same path cannot collide, and it
   starts with a dot, so globs for the real files skip it;
2. flush and fsync the temporary file (else the rename can reach the disk before the data, and a
   power loss leaves the new name over an empty file);
3. `os.replace` it over the target (atomic on POSIX);
4. fsync the folder, which makes the rename itself durable.

If the write fails before the rename, the temporary file is removed and the old file is intact.
A write that fails because its file system (or the user's quota) is full raises `NoSpaceError`,
an `OSError` whose message is one line: "no space left on DEVICE while writing PATH".
`read_json` is the reading side for the JSON files of run folders and results: capped, never
blocking, every failure one `JSONFileError` line naming the file. (A checkpoint folder's files go
through `workbench.checkpoint.safe_io`, which also keeps every read inside the folder.)
This module sits below every package (the `_io` layer, docs/architecture.md) and imports only
the standard library, so `workbench.launch` stays torch-free.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["JSON_CAP", "JSONFileError", "NoSpaceError", "atomic_open", "atomic_write_bytes",
           "atomic_write_json", "atomic_write_text", "device_of", "fsync_path", "is_no_space",
           "new_file_mode", "no_space", "publish", "read_json", "writing"]

_FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(OSError):
    """A write failed because the file system holding `path` is full (ENOSPC) or the user's
    quota on it is used up (EDQUOT). `str()` is one line naming the device and the file."""

    def __init__(self, code: int, path: str | Path, device: str):
        what = "no space left" if code == errno.ENOSPC else "disk quota exceeded"
        super().__init__(code, f"{what} on {device} while writing {path}")
        self.path, self.device = str(path), device

    def __str__(self) -> str:
        return self.strerror


def is_no_space(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised from, is a full disk or quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        e = e.__cause__ or e.__context__
    return False


def _full_errno(e: BaseException) -> int:
    while e is not None:
        if isinstance(e, OSError) and e.errno in _FULL:
            return e.errno
        e = e.__cause__ or e.__context__
    return errno.ENOSPC


def _unescape_mount(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash as octal escapes
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def device_of(path: str | Path) -> str:
    """The file system holding `path` (or its nearest existing parent), as a user finds it in
    `df`: "SOURCE (mounted at MOUNT, N MiB free)"; the folder itself where /proc is unreadable."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, source = "", None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or len(rest) < 2:
                    continue
                mount = _unescape_mount(fields[4])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, source = mount, _unescape_mount(rest[1])
    except OSError:
        pass
    try:
        st = os.statvfs(real)
        free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
        room = f", {free / 2**20:.0f} MiB free"
    except OSError:
        room = ""
    if source is None:
        return f"the device holding {real}"
    return f"{source} (mounted at {best}{room})"


def no_space(e: BaseException, path: str | Path) -> NoSpaceError:
    """The one-line error for a write to `path` that failed with ENOSPC/EDQUOT (`e`)."""
    return NoSpaceError(_full_errno(e), path, device_of(path))


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn a full disk or quota while writing `path` into `NoSpaceError` naming it; every other
    error passes unchanged."""
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as e:
        if is_no_space(e):
            raise no_space(e, path) from None
        raise


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process's umask, read without changing it where Linux reports it (os.umask can only
    be read by setting it, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The permissions a plain open(path, "w") gives a new file: 0o666 less the umask. Writers
    that do not create their files themselves (safetensors' `save_file` leaves 0o600) set it
    after, so what we export is as readable as anything else the user writes."""
    return 0o666 & ~_umask()


def _final_mode(path: Path) -> int:
    """What a plain open(path, "w") would leave: the old file's permissions when it exists, else
    0o666 less the umask. `mkstemp` makes its file 0o600, which would hide run folders' configs,
    metrics and exported checkpoints from the other users of a shared cluster file system."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return new_file_mode()


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8"
                ) -> Iterator[IO[Any]]:
    """Open a temporary sibling of `path` for writing; on a clean exit fsync it, rename it over
    `path` and fsync the folder. On an exception nothing is renamed: the old `path` stays as it
    was and the temporary file is removed. `mode` is "w" (text) or "wb"."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    with writing(path):  # a full file system may refuse the new inode itself
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _final_mode(path))
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and not isinstance(e, NoSpaceError) and is_no_space(e):
            raise no_space(e, path) from None
        raise
    fsync_path(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, *, encoding: str = "utf-8") -> Path:
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def atomic_write_json(path: str | Path, obj: Any, *, indent: int | None = 1,
                      sort_keys: bool = False, default: Callable[[Any], Any] | None = None) -> Path:
    """`json.dumps(obj)` plus a final newline, written atomically. The text is built before the
    temporary file is opened, so an object that does not serialise leaves no trace at all."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n"
    return atomic_write_text(path, text)


def publish(tmp: str | Path, path: str | Path) -> Path:
    """Steps 2-4 of the recipe for a file built elsewhere (appended to over several sessions, as a
    resumable download is): fsync ``tmp``, rename it over ``path`` (the same folder) and fsync
    the folder."""
    tmp, path = Path(tmp), Path(path)
    if tmp.parent != path.parent:
        raise ValueError(f"publish renames within one folder: {tmp} -> {path}")
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)
    return path


# config.json, result.json, a COMPLETE marker: a few KiB; the cap only has to stop a hostile file
JSON_CAP = 16 << 20


class JSONFileError(ValueError):
    """A JSON file that cannot be used: unreadable, not a regular file, over its size cap, not
    UTF-8, not JSON, or nested too deeply. `str()` is one line: "PATH: REASON"."""

    def __init__(self, path: str | Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


def read_json(path: str | Path, *, cap: int = JSON_CAP, what: str = "JSON file") -> Any:
    """The JSON document in `path`. The file is opened non-blocking and must be a regular file
    (a FIFO would block a plain open, /dev/zero never ends), is read to at most `cap` bytes, and
    every failure is a `JSONFileError`; `what` names the file in its message."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise JSONFileError(p, f"cannot read {what} ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise JSONFileError(p, f"{what} is not a regular file")
        chunks, left = [], cap + 1  # one byte over the cap tells a file over it
        while left > 0 and (b := os.read(fd, min(left, 1 << 20))):
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise JSONFileError(p, f"cannot read {what} ({e.strerror or e})") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > cap:
        raise JSONFileError(p, f"{what} is larger than {cap} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise JSONFileError(p, f"{what} is not UTF-8 text") from None
    except RecursionError:
        raise JSONFileError(p, f"{what} is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, int() of a number over 4300 digits
        raise JSONFileError(p, f"{what} is not valid JSON ({str(e)[:200]})") from None
