"""The token cache: one verified entry per (format, tokenizer, EOS, options, sources).

An entry is `CACHE/<key>/tokens.bin` (raw little-endian uint32) plus `header.json`, where
`key` is the first 32 hex digits of `inputs_sha256`, the sha256 of everything that decides the
tokens (format version, tokenization options, tokenizer digest, EOS id, each source's sha256).
The header carries `inputs_sha256` and `tokens_sha256` (the sha256 of `tokens.bin`), so an
entry is checked against both what it claims to be and what it holds.

Verification on use (`open_entry`): the header must parse and name the same inputs; the token
file must have the size the header gives; its content must hash to `tokens_sha256`. Hashing a
large cache at every start costs seconds per GB, so the header also records a *seal*: the token
file's (device, inode, size, mtime, ctime) when it was written or last verified. While the seal
holds, the content hash is not recomputed: any write to the file through the file system
changes its ctime, which no unprivileged process can set back. A broken seal (a write, a copy,
a restore) means one full hash, then a fresh seal. What the seal does not cover is damage below
the file system (media errors) and root; what keeps other users out is the folder's owner and
mode (`private_dir`), not the hash.

A damaged entry is rebuilt, with one line saying which and why. Entries are written into a
temporary folder and renamed into place, so a crash never leaves half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workbench._io import atomic_write_json

FORMAT_VERSION = 2
DTYPE = np.dtype("<u4")
TOKENS = "tokens.bin"
HEADER = "header.json"
_HEADER_MAX_BYTES = 1 << 20


class CacheError(ValueError):
    """The cache folder cannot be trusted or used (owner, permissions); the message names it."""


@dataclass(frozen=True)
class TokenFile:
    folder: Path
    tokens: int
    records: int
    header: dict

    def memmap(self) -> np.ndarray:
        if self.tokens == 0:
            return np.zeros(0, dtype=DTYPE)
        return np.memmap(self.folder / TOKENS, dtype=DTYPE, mode="r", shape=(self.tokens,))


def inputs_digest(inputs: dict[str, Any]) -> str:
    """sha256 of the JSON of everything that decides an entry's tokens."""
    return hashlib.sha256(json.dumps({"v": FORMAT_VERSION, **inputs}, sort_keys=True)
                          .encode()).hexdigest()


def entry_folder(cache: Path, digest: str) -> Path:
    return cache / digest[:32]


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _seal(path: Path) -> dict[str, int]:
    st = os.stat(path)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_private(path: Path, what: str) -> None:
    """`path` (followed through links) must be a folder owned by this user and writable by
    nobody else: entries in it are trusted by their hash only against accidents, not against
    whoever else can write there."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"{what} {path} is not a folder")
    if st.st_uid != os.geteuid():
        raise CacheError(f"{what} {path} belongs to another user (uid {st.st_uid}); another "
                         "user could plant tokens there: pass --token-cache DIR of your own")
    if _writable_by_others(st):
        raise CacheError(f"{what} {path} is writable by group or others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); another user could plant tokens "
                         f"there: chmod 700 it, or pass --token-cache DIR of your own")


def private_dir(path: Path, what: str) -> Path:
    """Create `path` (mode 0700) if missing, then `check_private` it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:  # another run made it meanwhile: checked below like any
            pass
        else:
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    check_private(path, what)
    return path


def _read_header(folder: Path) -> dict:
    p = folder / HEADER
    with open(p, "rb") as f:
        raw = f.read(_HEADER_MAX_BYTES + 1)
    if len(raw) > _HEADER_MAX_BYTES:
        raise ValueError(f"{HEADER} is larger than {_HEADER_MAX_BYTES} bytes")
    h = json.loads(raw)
    if not isinstance(h, dict):
        raise ValueError(f"{HEADER} is not a JSON object")  # noqa: TRY004 - caught as damage
    for k in ("tokens", "records"):
        if not isinstance(h.get(k), int) or isinstance(h.get(k), bool) or h[k] < 0:
            raise ValueError(f"{HEADER}: {k!r} is not a count")
    missing = [k for k in ("inputs_sha256", "tokens_sha256") if not isinstance(h.get(k), str)]
    if missing:
        raise ValueError(f"{HEADER}: no {missing[0]!r}")
    return h


def open_entry(folder: Path, digest: str) -> TokenFile | str | None:
    """The verified entry in `folder`; None when there is none; else why it is damaged."""
    if not folder.exists():
        return None
    try:
        # Inside a private cache folder only this user can write; an entry owned by another
        # was planted before the folder was made private.
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return "the entry is not a folder of this user"
        h = _read_header(folder)
    except (OSError, ValueError) as e:  # missing, unreadable, not JSON, wrong fields
        return f"header: {e}"
    if h.get("version") != FORMAT_VERSION or h["inputs_sha256"] != digest:
        return "the header names other inputs than its key"
    path = folder / TOKENS
    try:
        fst = os.lstat(path)
        if not stat.S_ISREG(fst.st_mode) or fst.st_uid != os.geteuid():
            return f"{TOKENS} is not a file of this user"
        if fst.st_size != h["tokens"] * DTYPE.itemsize:
            return f"{TOKENS} has {fst.st_size} bytes, the header {h['tokens']} tokens"
        if h.get("seal") != _seal(path):
            if sha256_file(path) != h["tokens_sha256"]:
                return f"{TOKENS} does not hash to the header's tokens_sha256"
            _reseal(folder, h)
    except OSError as e:
        return f"{TOKENS}: {e}"
    return TokenFile(folder, h["tokens"], h["records"], h)


def _reseal(folder: Path, h: dict) -> None:
    """Record the verified file's new stat, so the next start does not hash it again (a
    read-only cache keeps hashing at each start)."""
    try:
        atomic_write_json(folder / HEADER, {**h, "seal": _seal(folder / TOKENS)})
    except OSError:
        pass


def new_entry(cache: Path, folder: Path) -> Path:
    """An empty temporary folder to write an entry into, beside where it will live."""
    tmp = cache / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    return tmp


def seal_entry(tmp: Path, header: dict) -> None:
    """Finish an entry written in `tmp`: the content digest, the seal and the header."""
    path = tmp / TOKENS
    atomic_write_json(tmp / HEADER, {**header, "version": FORMAT_VERSION,
                                     "tokens_sha256": sha256_file(path), "seal": _seal(path)})


def commit_entry(tmp: Path, folder: Path, damaged: bool) -> None:
    """Rename the finished `tmp` to `folder`, moving a damaged entry aside first. Another run
    that committed the same inputs meanwhile wins; the caller verifies what is there."""
    if damaged and folder.exists():
        aside = folder.with_name(f".damaged-{folder.name}-{os.getpid()}")
        try:
            os.rename(folder, aside)
        except OSError:
            pass  # another run moved it first
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not folder.is_dir():
            raise
