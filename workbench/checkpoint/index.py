"""Lazy sharded safetensors index: tensor name -> (file, dtype, shape, byte range).

Opening parses only each shard's header (8-byte little-endian length + JSON) and checks it
completely -- offsets inside the file, sizes equal dtype x shape, contiguous with no overlap,
file not truncated -- without touching tensor data. Reads go through
`safetensors.safe_open(...).get_slice(name)[...]`, so a request touches only its bytes; every
read is counted in `IndexStats` (tests and benchmarks check the byte count).

`read_into` fills a caller's buffer (a slice of a pinned stack, say): a selection that is one
contiguous byte range (int lead indices, then at most one step-1 slice, then whole trailing
dims) is read with `os.preadv` from a descriptor opened once per shard. preadv releases the
GIL and takes an explicit offset, so reader threads run in parallel on one descriptor; every
read must return its full byte count (a shard truncated after indexing is a
`CorruptShardError`, never garbage). Other selections (strided rows) copy `read`'s result.
The index lock guards only the handle and descriptor caches and the stats, never a copy.

A remote checkpoint (``ShardIndex(remote=RemoteFolder)``, see remote.py) goes through the same
header checks (`check_header`: the header bytes come by range, the size from the server) and
the same reads: `read_into` and `read_span` fill their buffers from range requests instead of
preadv, and `read` takes one range per selection (`_read_ranged`). Shards already on local disk
(a partial cache snapshot) are read locally, each file by the path its entries carry.

Safety: shard names from `model.safetensors.index.json` must be plain relative file names
(no absolute path, no `..`, no `.`), and every shard must be a regular file resolving inside the
checkpoint root (`safe_io.checkpoint_root`: the folder, or for a Hugging Face hub cache snapshot
`.../<repo>/snapshots/<rev>/` the repository folder `<repo>` holding its `blobs/`). Shards are
opened non-blocking and checked with fstat, so a FIFO or a device is refused instead of read.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from .errors import (
    CheckpointError,
    ConfigError,
    CorruptShardError,
    MissingFileError,
    MissingTensorError,
    UnsafePathError,
    ValidationError,
)
from .remote import RemotePath
from .safe_io import (
    INDEX_CAP,
    checkpoint_root,
    open_regular,
    parse_json,
    present,
    read_capped,
    resolve_inside,
)

# safetensors dtype string -> (torch dtype, bits per element)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 8), "U8": (torch.uint8, 8), "I8": (torch.int8, 8),
    "U16": (torch.uint16, 16), "I16": (torch.int16, 16), "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16), "U32": (torch.uint32, 32), "I32": (torch.int32, 32),
    "F32": (torch.float32, 32), "U64": (torch.uint64, 64), "I64": (torch.int64, 64),
    "F64": (torch.float64, 64), "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E5M2": (torch.float8_e5m2, 8), "F8_E8M0": (torch.float8_e8m0fnu, 8),
}
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
INDEX_FILE = "model.safetensors.index.json"
# expert-parallel rank in a per-rank file name: model-ep3.safetensors, ep_rank_03.safetensors
EP_FILE = re.compile(r"(?:^|[^a-z0-9])ep(?:_?rank)?[_-]?(\d+)")
SINGLE_FILE = "model.safetensors"


class TensorEntry(NamedTuple):
    # a NamedTuple, not a dataclass: a Kimi-K3-sized index holds ~500k of these
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    stored_name: str | None = None  # the name inside the file, when `name` is qualified

    @property
    def key(self) -> str:
        return self.stored_name or self.name

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class IndexStats:
    """Bytes requested through `ShardIndex.read` and `read_into` (the sizes of the slices
    asked for; a `read_into` that falls back to `read` is counted once)."""

    bytes_read: int = 0
    requests: int = 0
    per_tensor: dict[str, int] = field(default_factory=dict)
    gap_bytes: int = 0  # read by `read_span` between the tensors asked for (not in bytes_read)

    def reset(self) -> None:
        self.bytes_read, self.requests, self.gap_bytes = 0, 0, 0
        self.per_tensor.clear()


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n > 0:
        b = os.read(fd, min(n, 1 << 24))
        if not b:
            break
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def selection(shape: tuple[int, ...], index: tuple) -> tuple[tuple[int, ...], int | None, int]:
    """What `tensor[index]` selects, without reading: (result shape, first element when the
    selection is one contiguous run of the row-major tensor else None, element count).

    `index` holds ints and slices, one per leading dimension (as `ShardIndex.read`). It is
    contiguous when it is ints (in range), then at most one step-1 slice, then slices covering
    their whole dimensions: e.g. `(expert, rows)` of a stacked `[E, N, K]` tensor."""
    if len(index) > len(shape):
        raise IndexError(f"{len(index)} indices for a {len(shape)}-d tensor")
    out: list[int] = []
    first, contiguous = 0, True
    opened = False  # a slice of several elements seen: every later dimension must be whole
    for dim, ix in zip(shape, index):
        if isinstance(ix, slice):
            lo, hi, step = ix.indices(dim)
            n = len(range(lo, hi, step))
            out.append(n)
            if (n > 1 and step != 1) or (opened and n != dim):
                contiguous = False
            opened = opened or n > 1
            first = first * dim + (lo if n else 0)
        elif isinstance(ix, int) and not isinstance(ix, bool):
            i = ix + dim if ix < 0 else ix
            if not 0 <= i < dim:
                raise IndexError(f"index {ix} out of range for a dimension of {dim}")
            if opened:  # an int after a slice: one row of each slab, not one run
                contiguous = False
            first = first * dim + i
        else:
            raise TypeError(f"index entries are ints and slices, got {ix!r:.40}")
    rest = shape[len(index):]
    count = 1
    for d in (*out, *rest):
        count *= d
    for d in rest:
        first *= d
    return (*out, *rest), (first if contiguous else None), count


def parse_header(path: Path, root: Path | None = None, *, remote=None
                 ) -> dict[str, TensorEntry]:
    """Read and fully check one shard's header; never reads tensor data. The shard must be a
    regular file inside `root` (default: its own folder), or a file of the `RemoteFolder`
    ``remote``, whose header bytes are fetched by range and checked by the same code."""
    if remote is not None:
        size, head = remote.open_shard(path)
        return check_header(path, size, head, lambda n: remote.read(path, 8, 8 + n, data=False))
    root = checkpoint_root(path.parent) if root is None else root
    fd, size = open_regular(path, root)
    try:
        return check_header(path, size, _read_exact(fd, 8), lambda n: _read_exact(fd, n))
    except OSError as e:
        raise MissingFileError(f"cannot read shard: {e}", path=path) from e
    finally:
        os.close(fd)


def check_header(path, size: int, head: bytes, read: Callable[[int], bytes]
                 ) -> dict[str, TensorEntry]:
    """The entries of a shard of ``size`` bytes whose first bytes are ``head``; ``read(n)``
    gives the ``n`` header bytes after them. Every offset is checked against ``size``."""
    if len(head) < 8:
        raise CorruptShardError(f"shard is {size} bytes: too short for a safetensors "
                                "header (empty or truncated file)", path=path)
    (n,) = struct.unpack("<Q", head[:8])
    if n == 0 or n > MAX_HEADER or 8 + n > size:
        raise CorruptShardError(f"header length {n} does not fit a {size}-byte file "
                                "(corrupt header or truncated file)", path=path)
    raw = read(n)
    if len(raw) < n:
        raise CorruptShardError(f"header of {n} bytes, file ended after {len(raw)}", path=path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError: JSONDecodeError, or an integer over Python's 4300-digit limit
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CorruptShardError(f"header is not valid JSON: {what}", path=path) from None
    if not isinstance(header, dict):
        raise CorruptShardError("header is not a JSON object", path=path)
    data_start, data_size = 8 + n, size - 8 - n
    entries: dict[str, TensorEntry] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        # one pass of cheap checks per tensor: a Kimi-K3-sized checkpoint has ~500k of them
        try:
            dtype_s, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            dtype, bits = DTYPES[dtype_s]
            count = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError(d)
                count *= d
            if type(b) is not int or type(e) is not int:
                raise ValueError(b, e)
        except (KeyError, TypeError, ValueError) as err:
            what = (f"unsupported dtype {info.get('dtype')!r}" if isinstance(info, dict)
                    and isinstance(info.get("dtype"), str) and info["dtype"] not in DTYPES
                    else f"malformed header entry: {info!r}")
            raise CorruptShardError(what, path=path, tensor=name) from err
        want = count * bits // 8
        if not 0 <= b <= e:
            raise CorruptShardError(f"bad data offsets {[b, e]}", path=path, tensor=name)
        if e > data_size:
            raise CorruptShardError(f"data range [{b}, {e}) ends past the {data_size} data bytes "
                                    "in the file (truncated shard)", path=path, tensor=name)
        if e - b != want:
            raise CorruptShardError(f"{e - b} bytes stored but dtype {dtype_s} x shape {shape} "
                                    f"needs {want}", path=path, tensor=name)
        entries[name] = TensorEntry(name, path, dtype, tuple(shape), data_start + b, data_start + e)
        spans.append((b, e, name))
    spans.sort()
    pos = 0
    for b, e, name in spans:
        # safetensors itself requires the data to be packed back to back: a hole is as wrong
        # as an overlap (bytes nobody owns), and found here, not at the first read
        if b != pos:
            what = "overlaps the previous tensor" if b < pos else \
                f"leaves a hole of {b - pos} bytes after the previous tensor"
            raise CorruptShardError(f"data range [{b}, {e}) {what}", path=path, tensor=name)
        pos = e
    if pos != data_size:
        raise CorruptShardError(f"tensors cover {pos} of {data_size} data bytes (file has "
                                "trailing or missing bytes)", path=path)
    return entries


def safe_shard_path(folder: Path, name: str, *, source: Path, tensor: str | None = None,
                    root: Path | None = None) -> Path:
    """Resolve a shard name from an index, refusing anything that leaves the checkpoint root
    (default `checkpoint_root(folder)`) or is not a plain relative file name."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafePathError(f"invalid shard name {name!r:.80}", path=source, tensor=tensor)
    p = Path(name)
    if not p.parts or name.endswith(("/", "\\", "/.")):  # ".", "./", "sub/": a folder
        raise UnsafePathError(f"shard name {name!r:.80} is not a file name", path=source,
                              tensor=tensor)
    if p.is_absolute() or name.startswith(("/", "\\")) or ".." in p.parts or ":" in p.parts[0]:
        raise UnsafePathError(f"shard name {name!r:.80} is absolute or climbs out of the "
                              "folder", path=source, tensor=tensor)
    root = checkpoint_root(folder) if root is None else root
    full = folder / p
    if not present(full):
        raise MissingFileError(f"shard {name!r} named by the index does not exist", path=full,
                               tensor=tensor)
    resolve_inside(full, root, source=source, tensor=tensor)
    return full


class ShardIndex:
    """All tensors of a checkpoint folder, or of a `remote.RemoteFolder` (``remote=``: the
    same checks and reads, each read a byte range); see the module docstring."""

    def __init__(self, folder: str | os.PathLike | None = None, *, max_open: int = 8,
                 remote=None):
        self.remote = remote
        self.stats = IndexStats()
        self._max_open = max_open
        self._handles: OrderedDict[Path, object] = OrderedDict()
        self._fds: OrderedDict[Path, _Fd] = OrderedDict()
        self._lock = threading.Lock()  # the two caches and the stats; never held over a copy
        self.entries: dict[str, TensorEntry] = {}
        self.files: list[Path] = []
        self._ends: dict[Path, int] | None = None  # per shard, where its last tensor ends
        if remote is not None:
            # a hybrid: shards already on local disk are read there, the others by range
            self.folder, self.root = remote.root, remote.local_root
        else:
            self.folder = Path(folder)
            if not self.folder.is_dir():
                raise MissingFileError("checkpoint folder does not exist", path=self.folder)
            self.root = checkpoint_root(self.folder)
        self._build()

    def relname(self, path) -> str:
        """The name of shard ``path`` relative to the checkpoint folder (as an index writes
        it)."""
        if isinstance(path, RemotePath):
            return path.url[len(self.folder.url) + 1:]
        base = self.remote.local if self.remote is not None else self.folder
        return Path(path).relative_to(base).as_posix()

    @property
    def is_local(self) -> bool:
        """Every byte is read from local files (else by range from a server)."""
        return self.remote is None

    # -- the folder's files, local or remote -------------------------------------------------
    def _shard(self, name, *, source, tensor: str | None = None):
        """The checked path of a shard the index (or the folder) names."""
        if self.remote is None:
            return safe_shard_path(self.folder, name, source=source, tensor=tensor,
                                   root=self.root)
        path = self.remote.path(name, source=source, tensor=tensor)  # the remote name rules
        if self.remote.local_file(name) is not None:
            return safe_shard_path(self.remote.local, name, source=source, tensor=tensor,
                                   root=self.root)
        return path

    def _header(self, path) -> dict[str, TensorEntry]:
        return parse_header(path, self.root,
                            remote=self.remote if isinstance(path, RemotePath) else None)

    def _headers(self, paths: list) -> list:
        """Each shard's entries, or the CheckpointError it raised; a remote folder's headers
        are fetched a few at a time (each is two round trips)."""
        def one(p):
            try:
                return self._header(p)
            except CheckpointError as e:
                return e

        if self.remote is None or len(paths) < 2:
            return [one(p) for p in paths]
        with ThreadPoolExecutor(max_workers=min(16, len(paths))) as pool:
            return list(pool.map(one, paths))

    def _build(self) -> None:
        idx = self.folder / INDEX_FILE
        if self.remote is not None:
            doc, found = self.remote.read_json(INDEX_FILE, INDEX_CAP, what="index")
            if found:
                return self._build_from_doc(doc, idx)
            try:
                return self._add_file(self._shard(SINGLE_FILE, source=self.folder))
            except MissingFileError:
                names = self.remote.list_names()
            if names is None:
                raise MissingFileError(f"no {INDEX_FILE} or {SINGLE_FILE} (and this server "
                                       "cannot list its files)", path=self.folder) from None
            files = [n for n in names if n.endswith(".safetensors") and "/" not in n]
        elif present(idx):
            return self._build_from_doc(
                parse_json(read_capped(idx, self.root, INDEX_CAP, what="index"), idx), idx)
        elif present(self.folder / SINGLE_FILE):
            return self._add_file(self._shard(SINGLE_FILE, source=self.folder))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        # e.g. per-rank Megatron exports `model-ep0.safetensors`, ...: take them all
        if not files:
            raise MissingFileError(f"no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors file",
                                   path=self.folder)
        for name in files:
            m = EP_FILE.search(Path(name).stem.lower())
            self._add_file(self._shard(name, source=self.folder),
                           ep_rank=int(m.group(1)) if m else None)

    def _build_from_doc(self, doc, idx) -> None:
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict) or not wmap:
            raise ConfigError("index has no non-empty 'weight_map' object", path=idx)
        problems: list[CheckpointError] = []
        shards: dict[str, object] = {}  # file name -> its path, or the error naming it
        first: dict[str, str] = {}  # file name -> the first tensor the index maps there
        for tname, fname in wmap.items():
            if not isinstance(fname, str):
                problems.append(UnsafePathError(f"weight_map value {fname!r:.80} is not a file "
                                                "name", path=idx, tensor=tname))
                continue
            if fname not in shards:
                first[fname] = tname
                try:
                    shards[fname] = self._shard(fname, source=idx, tensor=tname)
                except CheckpointError as e:
                    shards[fname] = e
        ok = [f for f, p in shards.items() if not isinstance(p, CheckpointError)]
        headers: dict[str, dict[str, TensorEntry] | None] = dict.fromkeys(shards)
        for fname, got in zip(ok, self._headers([shards[f] for f in ok])):
            if isinstance(got, CheckpointError):
                shards[fname] = got
            else:
                headers[fname] = got
                self.files.append(shards[fname])
        for fname, p in shards.items():  # check every shard, then report all problems together
            if isinstance(p, CheckpointError):
                if p.tensor is None:  # name a tensor the index sends to this shard
                    p = type(p)(f"{p.detail} (the index maps {first[fname]!r} here)",
                                path=p.path, tensor=first[fname])
                problems.append(p)
        for tname, fname in wmap.items():
            if not isinstance(fname, str) or headers[fname] is None:
                continue
            entry = headers[fname].get(tname)
            if entry is None:
                problems.append(CorruptShardError(
                    f"index maps {tname!r} to this shard but its header has no such tensor",
                    path=self.folder / fname, tensor=tname))
                continue
            self.entries[tname] = entry
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ValidationError(problems, path=idx)

    def _add_file(self, path: Path, ep_rank: int | None = None) -> None:
        for name, entry in self._header(path).items():
            if ep_rank is not None and ".experts." in name:
                # per-rank files reuse local expert names: keep them apart (see experts.py)
                name = f"{name}@ep{ep_rank}"
                entry = TensorEntry(name, entry.file, entry.dtype, entry.shape, entry.begin,
                                    entry.end, stored_name=entry.name)
            elif ep_rank is not None and name in self.entries:
                prev = self.entries[name]
                if (prev.dtype, prev.shape) != (entry.dtype, entry.shape):
                    raise ConfigError(f"replicated tensor differs from its copy in "
                                      f"{prev.file.name}", path=path, tensor=name)
                continue
            if name in self.entries:
                raise ConfigError(f"tensor stored twice: also in {self.entries[name].file.name}",
                                  path=path, tensor=name)
            self.entries[name] = entry
        self.files.append(path)

    # -- lookup -----------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise MissingTensorError("no such tensor in the checkpoint", path=self.folder,
                                     tensor=name) from None

    # -- reading ----------------------------------------------------------------------------
    def _handle(self, path: Path):
        """The cached safetensors handle of a shard; the caller holds the lock."""
        from safetensors import safe_open

        h = self._handles.get(path)
        if h is None:
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CorruptShardError(f"safetensors cannot open the shard: {e}",
                                        path=path) from e
            self._handles[path] = h
            while len(self._handles) > self._max_open:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(path)
        return h

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self.stats.bytes_read += n
            self.stats.requests += 1
            self.stats.per_tensor[name] = self.stats.per_tensor.get(name, 0) + n

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """`tensor[index]` read through get_slice: only the selected bytes are touched.

        `index` holds ints and slices (steps allowed), one per leading dimension.
        """
        e = self.entry(name)
        if isinstance(e.file, RemotePath):
            out = self._read_ranged(e, name, index)
            self._count(name, out.numel() * out.element_size())
            return out
        with self._lock:
            h = self._handle(e.file)
        # the copy runs unlocked: safetensors' handle methods take `&self`, get_slice clones an
        # Arc of the storage, the mmap'd storage is read-only (its mmap=False mode locks its
        # own file mutex), and the reference held here keeps the handle alive when another
        # thread evicts it from the cache
        try:
            # whole-tensor reads (scalars, global scales) need no slice
            out = h.get_slice(e.key)[index] if index else h.get_tensor(e.key)
        except Exception as err:
            raise CorruptShardError(f"reading {index!r} failed: {err}", path=e.file,
                                    tensor=name) from err
        self._count(name, out.numel() * out.element_size())
        return out

    def read_into(self, name: str, index: tuple, out: torch.Tensor) -> torch.Tensor:
        """`out[...] = tensor[index]`, returning `out`: a contiguous CPU tensor of the entry's
        dtype and exactly the selected shape (a slice of a pinned stack buffer, say).

        A contiguous selection (see `selection`) is read straight from the file with preadv,
        unlocked; any other is `read` and copied. A shard that ends early, or stopped being a
        regular file, raises `CorruptShardError` naming the file and the tensor."""
        e = self.entry(name)
        try:
            shape, first, count = selection(e.shape, index)
        except (IndexError, TypeError) as err:
            raise ValueError(f"{name}: bad index {index!r:.80} for shape {e.shape}: "
                             f"{err}") from None
        if out.dtype != e.dtype or tuple(out.shape) != shape or out.device.type != "cpu" \
                or not out.is_contiguous():
            raise ValueError(f"{name}: read_into needs a contiguous CPU {e.dtype} tensor of "
                             f"shape {shape}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}{'' if out.is_contiguous() else ' (strided)'}")
        if first is None or (not _PREADV and not isinstance(e.file, RemotePath)):
            out.copy_(self.read(name, index))
            return out
        nbytes = count * e.dtype.itemsize
        if nbytes:
            buf = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            self._fill(e.file, buf, e.begin + first * e.dtype.itemsize, e, name, index)
        self._count(name, nbytes)
        return out

    def _fill(self, path, buf: memoryview, offset: int, e: TensorEntry, name: str,
              index: tuple) -> None:
        """``buf`` <- the bytes of shard ``path`` from ``offset``: preadv on the shard's cached
        descriptor, or range reads of the remote folder; complete, or an error naming the
        file and the tensor."""
        if isinstance(path, RemotePath):
            self.remote.pread(path, buf, offset, tensor=name)
            return
        fd = self._acquire_fd(path, name)
        try:
            _pread_full(fd.fd, buf, offset, e, name, index)
        finally:
            self._release_fd(fd)

    def _read_ranged(self, e: TensorEntry, name: str, index: tuple) -> torch.Tensor:
        """``tensor[index]`` from one byte range: the leading ints fix a slab, the next entry
        (a slice) is read from its first to its last index with every trailing dimension
        whole (a contiguous run), and the rest of the index applies to that block. For the
        views' selections (an expert, a span of rows) the block is exactly the selection."""
        try:
            shape, _, _ = selection(e.shape, index)
        except (IndexError, TypeError) as err:
            raise ValueError(f"{name}: bad index {index!r:.80} for shape {e.shape}: "
                             f"{err}") from None
        lead = 0
        k = 0
        while k < len(index) and not isinstance(index[k], slice):
            i = index[k]
            lead = lead * e.shape[k] + (i + e.shape[k] if i < 0 else i)
            k += 1
        if k == len(e.shape):  # one element
            lo, hi, rest = 0, 1, ()
            inner: tuple[int, ...] = ()
            lead_dim = 1
        else:
            lead_dim = e.shape[k]
            inner = e.shape[k + 1:]
            if k < len(index):
                r = range(*index[k].indices(lead_dim))
                if r.step < 1:
                    raise ValueError(f"{name}: slices need a positive step, got {index[k]}")
                if not len(r):
                    return torch.empty(shape, dtype=e.dtype)
                lo, hi = r.start, r[-1] + 1
                rest = (slice(r.start - lo, hi - lo, r.step), *index[k + 1:])
            else:
                lo, hi, rest = 0, lead_dim, ()
        row = 1
        for d in inner:
            row *= d
        block = torch.empty((hi - lo, *inner) if k < len(e.shape) else (), dtype=e.dtype)
        if block.numel():
            first = (lead * lead_dim + lo) * row
            buf = memoryview(block.reshape(-1).view(torch.uint8).numpy()).cast("B")
            self._fill(e.file, buf, e.begin + first * e.dtype.itemsize, e, name, index)
        out = block[rest] if rest else block
        return out.contiguous().reshape(shape)

    def read_span(self, path: Path, begin: int, out: torch.Tensor,
                  tensors: list[tuple[str, int]]) -> torch.Tensor:
        """Bytes ``[begin, begin + len(out))`` of shard ``path`` into the contiguous CPU uint8
        tensor ``out``, front to back in ``SPAN_CHUNK`` requests: one sequential pass through a
        region that holds many tensors, as a plain read of the file goes (the analysis reads a
        layer's experts this way, then takes each tensor's bytes from the buffer).

        ``path`` must be a shard of this index and the span must end within the bytes its
        entries cover (ValueError otherwise: a caller's bug, not the file's). ``tensors`` are
        the (name, bytes) asked for inside the span, counted as ``read_into`` counts them; the
        bytes between them go to ``stats.gap_bytes``. A shard that ends early raises
        `CorruptShardError` naming it."""
        n = out.numel()
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() \
                or out.dim() != 1:
            raise ValueError(f"read_span needs a 1-d contiguous CPU uint8 tensor, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        end = self._data_end(path)
        if begin < 0 or begin + n > end:
            raise ValueError(f"{path.name}: span [{begin}, {begin + n}) outside the tensor data "
                             f"[0, {end})")
        name = tensors[0][0] if tensors else "<span>"
        if n:
            buf = memoryview(out.numpy()).cast("B")
            span = TensorEntry(name, path, torch.uint8, (n,), begin, begin + n)
            for lo in range(0, n, SPAN_CHUNK):
                self._fill(path, buf[lo:lo + SPAN_CHUNK], begin + lo, span, name,
                           (slice(lo, min(n, lo + SPAN_CHUNK)),))
        asked = 0
        for t, k in tensors:
            self._count(t, k)
            asked += k
        with self._lock:
            self.stats.gap_bytes += max(0, n - asked)
        return out

    def _data_end(self, path: Path) -> int:
        """Where the last tensor of shard ``path`` ends (ValueError when ``path`` is not one of
        this index's shards)."""
        with self._lock:
            if self._ends is None:
                ends: dict[Path, int] = {}
                for e in self.entries.values():
                    if e.end > ends.get(e.file, 0):
                        ends[e.file] = e.end
                self._ends = ends
            if path not in self._ends:
                raise ValueError(f"{path}: not a shard of this checkpoint's index")
            return self._ends[path]

    def _acquire_fd(self, path: Path, name: str) -> _Fd:
        """The shard's cached read-only descriptor, its user count raised. Opened through
        `open_regular` (inside the root, fstat says regular) on first use; evicted ones are
        closed only once no reader uses them, so a descriptor number is never reused under a
        reader's feet."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                n, _ = open_regular(path, self.root, tensor=name)
                fd = self._fds[path] = _Fd(n)
                while len(self._fds) > self._max_open:
                    _, old = self._fds.popitem(last=False)
                    old.retire()
            else:
                self._fds.move_to_end(path)
            fd.users += 1
            return fd

    def _release_fd(self, fd: _Fd) -> None:
        with self._lock:
            fd.users -= 1
            if fd.retired:
                fd.retire()

    def close(self) -> None:
        with self._lock:
            self._handles.clear()
            while self._fds:
                _, fd = self._fds.popitem()
                fd.retire()
        if self.remote is not None:
            self.remote.close()


SPAN_CHUNK = 16 << 20  # read_span's request size: what a plain sequential read of a file uses
_PREADV = hasattr(os, "preadv")  # not on Windows: read_into copies `read` there


class _Fd:
    """An open shard descriptor and how many readers use it (guarded by the index lock)."""

    __slots__ = ("fd", "retired", "users")

    def __init__(self, fd: int):
        self.fd, self.users, self.retired = fd, 0, False

    def retire(self) -> None:
        """Out of the cache: close now if unused, else when the last reader releases it."""
        self.retired = True
        if self.users == 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _pread_full(fd: int, buf: memoryview, offset: int, e: TensorEntry, name: str,
                index: tuple) -> None:
    """Fill `buf` from `offset` of the shard: preadv may return fewer bytes than asked (Linux
    caps one call near 2 GiB), so loop; 0 bytes means the file ended (truncated after the
    index was built), an error, never a spin or a half-filled buffer."""
    done, want = 0, len(buf)
    while done < want:
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as err:
            raise CorruptShardError(f"reading {index!r:.80} (bytes [{offset}, {offset + want}))"
                                    f" failed: {err.strerror or err}", path=e.file,
                                    tensor=name) from err
        if n <= 0:
            raise CorruptShardError(f"file ended at byte {offset + done} while reading "
                                    f"{index!r:.80} (bytes [{offset}, {offset + want})): "
                                    "truncated after the index was built", path=e.file,
                                    tensor=name)
        done += n
