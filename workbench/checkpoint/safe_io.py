"""Opening files of an untrusted checkpoint folder: only regular files, only inside the folder,
only up to a size cap, and JSON parsed so that every failure is a `CheckpointError`.

The folder may come from anyone (a shared file system, a download), so a name in it may be a
symlink to `/etc/shadow`, a FIFO (an `open` for reading blocks until a writer appears), or a
link to `/dev/zero` (a read never ends). Each file is therefore opened non-blocking, checked
with `fstat` on the open descriptor (so the file checked is the file read), and read only up
to its cap.

The checkpoint *root* is the folder itself, resolved; for a Hugging Face hub cache snapshot
(`<repo>/snapshots/<rev>/`, next to `<repo>/blobs/`) it is the repository folder `<repo>`,
because every file of a snapshot is a link into that repository's `blobs/`. Resolved paths
must stay inside the root, so a `blobs` link to `/` gives nothing outside the repository.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import ConfigError, MissingFileError, UnsafePathError

# config.json / hf_quant_config.json are a few kB; the cap only has to stop a hostile file
CONFIG_CAP = 16 * 1024 * 1024
# an index names every tensor: ~500k entries of ~100 bytes for the largest MoE checkpoints
INDEX_CAP = 512 * 1024 * 1024


def checkpoint_root(folder: Path) -> Path:
    """The folder every file of the checkpoint must resolve into (see the module docstring)."""
    real = Path(folder).resolve()
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def short(value: Any, limit: int = 80) -> str:
    """repr() cut to `limit` characters: error messages stay one readable line whatever the
    file holds (a 10^5-element list, a 4000-digit integer)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # int too long to print, nesting too deep
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def resolve_inside(path: Path, root: Path, *, source: Path | None = None,
                   tensor: str | None = None) -> Path:
    """`path` resolved, which must exist and lie inside `root` (error names `source` or path)."""
    where = source if source is not None else path
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise MissingFileError("is a symlink to a file that does not exist", path=path,
                                   tensor=tensor) from None
        raise MissingFileError("does not exist", path=path, tensor=tensor) from None
    except (OSError, RuntimeError) as e:  # ELOOP, permission denied on a parent
        raise UnsafePathError(f"cannot resolve {path.name!r}: {e}", path=where,
                              tensor=tensor) from e
    if not real.is_relative_to(root):
        raise UnsafePathError(f"{path.name!r} resolves to {real}, outside the checkpoint folder "
                              f"{root}", path=where, tensor=tensor)
    return real


def open_regular(path: Path, root: Path, *, source: Path | None = None,
                 tensor: str | None = None) -> tuple[int, int]:
    """(fd, size) of a regular file inside `root`; the caller closes fd. Never blocks: the
    file is opened O_NONBLOCK (a FIFO opens at once) and refused unless fstat says regular."""
    real = resolve_inside(path, root, source=source, tensor=tensor)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise MissingFileError(f"cannot open: {e.strerror or e}", path=path, tensor=tensor) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if
                    stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                    else "not a regular file")
            raise UnsafePathError(f"is {kind} ({real}), not a regular file", path=path,
                                  tensor=tensor)
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: Path, root: Path, cap: int, *, what: str = "file") -> bytes:
    """All bytes of a regular file inside `root`, refusing files over `cap` bytes."""
    fd, size = open_regular(path, root)
    try:
        if size > cap:
            raise ConfigError(f"{what} is {size} bytes, over the {cap}-byte limit", path=path)
        chunks, left = [], cap + 1  # +1: a file that grew since fstat still stops at the cap
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror or e}", path=path) from e
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise ConfigError(f"{what} grew past the {cap}-byte limit while being read", path=path)
    return data


def parse_json(raw: bytes, path: Path) -> Any:
    """JSON document of `raw`; every way it can fail is a ConfigError naming `path`."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text: {e}", path=path) from e
    except RecursionError:
        raise ConfigError("malformed JSON: nested too deeply", path=path) from None
    except ValueError as e:  # JSONDecodeError, and int() of a number over 4300 digits
        raise ConfigError(f"malformed JSON: {short(str(e), 200)}", path=path) from None


def read_json(path: Path, root: Path, cap: int = CONFIG_CAP) -> Any:
    return parse_json(read_capped(path, root, cap, what="JSON file"), path)


def present(path: Path) -> bool:
    """The name exists (a dangling symlink counts: reading it is an error, not a default)."""
    return os.path.lexists(path)

