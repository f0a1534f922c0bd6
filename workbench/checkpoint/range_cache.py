"""A bounded on-disk cache of byte ranges fetched from remote checkpoints.

Each entry is one fetched range, stored as ``<folder>/<k[:2]>/<k>.rng`` where ``k`` is the
SHA-256 of its key (the file's immutable identity and the range). An entry holds a small
header (magic, the key's digest, the length, a BLAKE2b digest of the bytes) and the bytes;
`get` returns bytes only when all of it checks out, so a torn write (a crash, a full disk, two
processes at once), a truncated or edited file is a miss, never data. Writes are a temporary
file renamed into place (atomic, and unsynced: the digest catches what a crash leaves, and the
cache is only a cache). Entries are touched on every hit; past ``max_bytes`` the least recently
used go until the cache is at 80% of its cap. Deleting the folder, or any file in it, at any
time is safe: a missing entry is fetched again.

The default folder is ``$HF_HOME/workbench-ranges`` (``WORKBENCH_RANGE_CACHE`` overrides it,
``off`` disables the cache) and its cap 20 GiB (``WORKBENCH_RANGE_CACHE_GB``).
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

from workbench._io import atomic_open
from workbench.source import hf_home

MAGIC = b"WBRNG1\0\0"
_HEAD = struct.Struct("<8s32sQ16s")  # magic, sha256(key), length, blake2b-128(data)
DEFAULT_GB = 20.0
ENV_FOLDER = "WORKBENCH_RANGE_CACHE"
ENV_GB = "WORKBENCH_RANGE_CACHE_GB"


class RangeCache:
    """See the module docstring. Thread-safe; several processes may share one folder."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.folder = Path(folder)
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes on disk, counted at the first write

    @classmethod
    def default(cls) -> RangeCache | None:
        """The cache the environment asks for (see the module docstring); None when off."""
        where = os.environ.get(ENV_FOLDER, "")
        if where.strip().lower() in ("off", "0", "none", "no"):
            return None
        gb = os.environ.get(ENV_GB)
        try:
            cap = float(gb) if gb else DEFAULT_GB
        except ValueError:
            raise ValueError(f"{ENV_GB}={gb!r} is not a number of GiB") from None
        if not cap >= 0:
            raise ValueError(f"{ENV_GB}={gb!r} must be >= 0")
        return cls(Path(where) if where else hf_home() / "workbench-ranges", int(cap * (1 << 30)))

    # -- entries ------------------------------------------------------------------------------
    def _file(self, key: str) -> tuple[Path, bytes]:
        d = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        h = d.hex()
        return self.folder / h[:2] / f"{h}.rng", d

    def get(self, key: str, length: int | None = None) -> bytes | None:
        """The cached bytes of ``key`` when an intact entry exists (of ``length`` bytes, when
        given)."""
        path, digest = self._file(key)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEAD.size)
                if len(head) != _HEAD.size:
                    return None
                magic, kd, n, bd = _HEAD.unpack(head)
                if magic != MAGIC or kd != digest or (length is not None and n != length) or \
                        os.fstat(f.fileno()).st_size != _HEAD.size + n:
                    return None
                data = f.read(n + 1)
        except OSError:  # missing, unreadable, deleted under us: a miss
            return None
        if len(data) != n or hashlib.blake2b(data, digest_size=16).digest() != bd:
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (best effort: a full or read-only disk only loses the
        entry, never the read that fetched it)."""
        if self.max_bytes == 0 or len(data) + _HEAD.size > self.max_bytes:
            return
        path, digest = self._file(key)
        head = _HEAD.pack(MAGIC, digest, len(data), hashlib.blake2b(data, digest_size=16).digest())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_open(path, "wb") as f:
                f.write(head)
                f.write(data)
        except OSError:
            return
        self._grow(len(data) + _HEAD.size)

    # -- size cap -----------------------------------------------------------------------------
    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry on disk."""
        out = []
        try:
            subs = list(os.scandir(self.folder))
        except OSError:
            return out
        for sub in subs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                for e in os.scandir(sub.path):
                    if e.name.endswith(".rng") and e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        out.append((st.st_mtime, st.st_size, Path(e.path)))
            except OSError:
                continue
        return out

    def size(self) -> int:
        return sum(n for _, n, _ in self.entries())

    def _grow(self, n: int) -> None:
        with self._lock:
            if self._total is None:
                self._total = self.size()
            else:
                self._total += n
            if self._total <= self.max_bytes:
                return
            # other processes write here too: recount from disk before deciding what goes
            entries = sorted(self.entries())
            total = sum(n for _, n, _ in entries)
            goal = int(self.max_bytes * 0.8)
            for _, size, path in entries:
                if total <= goal:
                    break
                if _unlink(path):
                    total -= size
            self._total = total

    def clear(self) -> None:
        for _, _, path in self.entries():
            _unlink(path)
        with self._lock:
            self._total = 0

    def __repr__(self) -> str:
        return f"RangeCache({str(self.folder)!r}, max_bytes={self.max_bytes})"


def _unlink(path) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
