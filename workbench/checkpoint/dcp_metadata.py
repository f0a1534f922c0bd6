"""Reading a DCP checkpoint's `.metadata` without running code from it.

`torch.distributed.checkpoint` stores its metadata as a plain pickle, and `FileSystemReader`
loads it with `pickle.load`: a crafted `.metadata` runs arbitrary code as whoever resumes from
the folder (run folders sit on shared cluster file systems). This module reads it with a
restricted unpickler instead:

- globals: only the metadata dataclasses torch 2.13's DCP writes (`Metadata`,
  `TensorStorageMetadata`, `BytesStorageMetadata`, `ChunkStorageMetadata`, `TensorProperties`,
  `StorageMeta`, `MetadataIndex`, `filesystem._StorageInfo`, the `_MEM_FORMAT_ENCODING` enum),
  `torch.Size`, torch dtypes, `torch.serialization._get_layout` (how a layout pickles) and
  `pathlib`'s POSIX paths (`StorageMeta.checkpoint_id`); any other global is refused;
- calls (`REDUCE`): only `torch.Size`, `_get_layout`, the enum and the path classes, with plain
  data as arguments; objects (`NEWOBJ` + `BUILD`): only the dataclasses, built from a dict of
  their own field names (or `TensorProperties`' 5-tuple), never `BUILD` on a class object
  (which would set attributes on the class itself for the rest of the process);
- the pure-Python unpickler is used because the C one cannot restrict `BUILD`; metadata is
  small (kilobytes for the test models, tens of MB for the largest) so its speed is no concern.

Then `validate_metadata` checks the object graph (types, sizes, chunk bounds) and every storage
entry: a plain file name inside the checkpoint folder, a regular file, the byte range inside
it. `SafeFileSystemReader` is the `FileSystemReader` to hand to `dcp.load`: it reads metadata
this way, refuses `BytesStorageMetadata` entries unless asked (DCP's default planner
`torch.load(weights_only=False)`s such entries: a second route to code execution), and names
the file in any read error.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
from dataclasses import fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import _get_layout

from .errors import CheckpointError

METADATA_FILE = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # far above any real checkpoint's; a bound on what a file can cost

_DATACLASSES = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
                TensorProperties, StorageMeta, MetadataIndex, _StorageInfo)
_PATHS = tuple({pathlib.PosixPath, pathlib.PurePosixPath})
_CALLABLES = (torch.Size, _get_layout, _MEM_FORMAT_ENCODING, *_PATHS)
_GLOBALS: dict[tuple[str, str], Any] = {
    (c.__module__, c.__qualname__): c for c in (*_DATACLASSES, _MEM_FORMAT_ENCODING, *_PATHS)}
_GLOBALS[("torch", "Size")] = torch.Size
_GLOBALS[("torch.serialization", "_get_layout")] = _get_layout
for _p in _PATHS:  # pickled as "pathlib.PosixPath" whatever module defines the class
    _GLOBALS[("pathlib", _p.__name__)] = _p
for _name, _v in vars(torch).items():
    if isinstance(_v, torch.dtype):
        _GLOBALS[("torch", _name)] = _v
_FIELDS = {c: {f.name for f in fields(c)} for c in _DATACLASSES}
_PLAIN = (str, bytes, int, float, bool, type(None))


class UnsafeMetadataError(CheckpointError):
    """`.metadata` holds something other than DCP's own metadata types (refused unread)."""


class _Refused(pickle.UnpicklingError):
    pass


def _plain(x: Any, depth: int = 0) -> bool:
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, (tuple, list)) and depth < 4:
        return all(_plain(v, depth + 1) for v in x)
    return False


class _AllowListUnpickler(pickle._Unpickler):
    """`pickle._Unpickler` with an allow-list of globals and restricted REDUCE/NEWOBJ/BUILD."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        obj = _GLOBALS.get((module, name))
        if obj is None:
            raise _Refused(f"global {module}.{name} is not a DCP metadata type")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("persistent ids are not used by DCP metadata")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is c for c in _CALLABLES) or not isinstance(args, tuple) \
                or not _plain(args):
            raise _Refused(f"call of {func!r} with {type(args).__name__} arguments")
        self.stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in _DATACLASSES) or args != ():
            raise _Refused(f"object of {cls!r}")
        self.append(cls.__new__(cls))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in _DATACLASSES) or args != () or kwargs != {}:
            raise _Refused(f"object of {cls!r}")
        self.append(cls.__new__(cls))

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if not any(cls is c for c in _DATACLASSES):  # also refuses a class object as `inst`
            raise _Refused(f"state set on {cls.__name__}")
        if cls is TensorProperties:
            if not (isinstance(state, tuple) and len(state) == 5):
                raise _Refused("TensorProperties state is not its 5-tuple")
            inst.__setstate__(state)
            return
        if not (isinstance(state, dict) and set(state) <= _FIELDS[cls]):
            raise _Refused(f"{cls.__name__} state with keys outside its fields")
        inst.__dict__.update(state)

    def _refuse(self) -> None:
        raise _Refused("opcode not used by DCP metadata")

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse
    del _op


def _open_regular(path: Path, max_bytes: int):
    """Open `path` for reading only if it is a regular file (not a symlink, FIFO or device)
    of at most `max_bytes`; returns (file, size)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointError("file is missing", path=path) from None
    except OSError as e:
        raise CheckpointError(f"cannot open ({e.strerror or e}; a symlink is refused)",
                              path=path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError("not a regular file", path=path)
    if st.st_size > max_bytes:
        os.close(fd)
        raise CheckpointError(f"{st.st_size} bytes, more than the {max_bytes} allowed", path=path)
    return os.fdopen(fd, "rb"), st.st_size


def load_metadata(folder: str | os.PathLike, *, allow_bytes: bool = True,
                  max_bytes: int = MAX_METADATA_BYTES) -> Metadata:
    """The checkpoint `folder`'s DCP `Metadata`, read with the allow-listed unpickler and checked
    by `validate_metadata`. Raises `CheckpointError` (`UnsafeMetadataError` for refused
    content) naming the file."""
    folder = Path(folder)
    path = folder / METADATA_FILE
    f, _ = _open_regular(path, max_bytes)
    with f:
        data = f.read()
    try:
        md = _AllowListUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeMetadataError(f"refused, not unpickled further: {e}", path=path) from None
    except Exception as e:  # noqa: BLE001 - any parse failure of a damaged file
        raise CheckpointError(f"not a DCP metadata pickle ({type(e).__name__}: {e})",
                              path=path) from None
    validate_metadata(md, folder, allow_bytes=allow_bytes)
    return md


def _is_size(x: Any) -> bool:
    return isinstance(x, torch.Size) and all(isinstance(v, int) and v >= 0 for v in x)


def validate_metadata(md: Any, folder: str | os.PathLike, *, allow_bytes: bool = True) -> None:
    """Check an unpickled metadata object: its types, every tensor's chunks inside its size and
    backed by a storage entry, every storage entry a byte range of a regular file directly
    inside `folder`."""
    folder = Path(folder)
    path = folder / METADATA_FILE

    def bad(msg: str, tensor: str | None = None):
        return CheckpointError(msg, path=path, tensor=tensor)

    if not isinstance(md, Metadata):
        raise bad(f"holds a {type(md).__name__}, not a DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict (not written by DCP's FileSystemWriter)")
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        raise bad("planner_data is not a dict")
    for fqn, tmd in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(tmd, BytesStorageMetadata):
            if not allow_bytes:
                # DCP's planner torch.load()s these with weights_only=False: code, not data.
                raise bad("a pickled-object entry; this checkpoint holds only tensors",
                          tensor=fqn)
            if MetadataIndex(fqn) not in storage:
                raise bad("no storage entry", tensor=fqn)
            continue
        if not isinstance(tmd, TensorStorageMetadata):
            raise bad(f"entry of type {type(tmd).__name__}", tensor=fqn)
        props = tmd.properties
        if not (isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)):
            raise bad("tensor properties without a dtype", tensor=fqn)
        if not _is_size(tmd.size) or not isinstance(tmd.chunks, list):
            raise bad("size is not a torch.Size / chunks not a list", tensor=fqn)
        for ch in tmd.chunks:
            if not (isinstance(ch, ChunkStorageMetadata) and _is_size(ch.offsets)
                    and _is_size(ch.sizes) and len(ch.offsets) == len(ch.sizes) == len(tmd.size)
                    and all(o + n <= s for o, n, s in zip(ch.offsets, ch.sizes, tmd.size))):
                raise bad(f"chunk {ch!r} does not lie inside size {tuple(tmd.size)}", tensor=fqn)
            if MetadataIndex(fqn, ch.offsets) not in storage:
                raise bad(f"chunk at {tuple(ch.offsets)} has no storage entry", tensor=fqn)
    file_sizes: dict[str, int] = {}
    for key, info in storage.items():
        if not (isinstance(key, MetadataIndex) and isinstance(key.fqn, str)):
            raise bad(f"storage key {key!r} is not a MetadataIndex")
        if not isinstance(info, _StorageInfo):
            raise bad(f"storage entry of type {type(info).__name__}", tensor=key.fqn)
        rel = info.relative_path
        if not (isinstance(rel, str) and rel and rel not in (".", "..") and "/" not in rel
                and "\\" not in rel and "\0" not in rel):
            raise bad(f"storage file {rel!r} is not a plain file name inside the folder",
                      tensor=key.fqn)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (info.offset, info.length)):
            raise bad(f"offset/length {info.offset!r}/{info.length!r}", tensor=key.fqn)
        td = getattr(info, "transform_descriptors", None)
        if td is not None and not (isinstance(td, (list, tuple))
                                   and all(isinstance(t, str) for t in td)):
            raise bad("transform descriptors are not strings", tensor=key.fqn)
        if rel not in file_sizes:
            try:
                st = os.lstat(folder / rel)
            except FileNotFoundError:
                raise CheckpointError("file is missing (named by .metadata)",
                                      path=folder / rel) from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("not a regular file (named by .metadata)",
                                      path=folder / rel)
            file_sizes[rel] = st.st_size
        if info.offset + info.length > file_sizes[rel]:
            raise CheckpointError(
                f"truncated: entry {key.fqn!r} ends at byte {info.offset + info.length}, the "
                f"file has {file_sizes[rel]}", path=folder / rel, tensor=key.fqn)


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` that reads `.metadata` with `load_metadata` (no arbitrary unpickling),
    never falls back to rank-local `__N.metadata` files, and names the file in read errors.
    `allow_bytes=False` (the trainer's checkpoints hold only tensors) refuses pickled-object
    entries."""

    def __init__(self, path: str | os.PathLike, *, allow_bytes: bool = False) -> None:
        super().__init__(path)
        self.allow_bytes = allow_bytes
        self._md: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP retries with rank-local metadata after a failed global read; this reader
            # serves only the global file, whose error the caller sees instead.
            raise CheckpointError("rank-local metadata is not read", path=self.path)
        if self._md is None:
            self._md = load_metadata(self.path, allow_bytes=self.allow_bytes)
        self._md.storage_meta = self._md.storage_meta or StorageMeta()
        self._md.storage_meta.load_id = self.load_id
        return self._md

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:  # name the file whatever the reader tripped on
            files = sorted({self.storage_data[r.storage_index].relative_path
                            for r in plan.items if r.storage_index in self.storage_data})
            raise CheckpointError(f"cannot read tensor data ({type(e).__name__}: {e})",
                                  path=Path(self.path) / (files[0] if len(files) == 1
                                                          else f"{{{','.join(files)}}}")) from e
