"""Same-shape expert weights of a checkpoint read as stacks ``[E, ...]``, staged on a device.

A stack is E records of one signature (stored codec, profile, shape) read together: the stored
grid's codes and scales undecoded (``Stack.grid``, a ``QuantizedTensor`` ``[E, N, K]``), or the
BF16 values of weights stored without a grid ``workbench.formats`` models (``Stack.dense``).
Every reader gives ``stack_grids`` of ``grid.stored_grid`` per member (or the stacked
``materialize()``) bit for bit; they differ in how the bytes get there:

- ``safetensors``: ``stored_grid`` per member through safetensors' mmap, ``torch.stack``, a
  copy into a pinned buffer on CUDA;
- ``preadv``: one ``[E, ...]`` buffer per part (pinned on CUDA), each member's bytes read into
  its slice by ``ShardIndex.read_into`` (one ``os.preadv``, GIL released), the member reads
  spread over a thread pool; strided rows (gpt-oss's interleaved gate/up) are read and copied;
- ``window`` (``windows.py``): each shard read front to back in large spans, the stacks cut out
  of a span; the records a span cannot hold go through preadv.

Which reader runs, how large a stack is and how far reads run ahead is the caller's
``ReadPlan``; ``stream.py`` runs a plan over a list of records. Nothing here decodes: the
analysis decodes a stack where it computes. To CUDA, a stack goes through a pinned host buffer
and an async copy on the reading thread's own stream (``Stager``), so the compute stream never
waits on I/O.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from workbench.formats import QuantizedTensor

from .grid import grid_selection, library_global, stored_grid
from .index import selection
from .layouts import FMT_OF_CODEC

READERS = ("window", "preadv", "safetensors")
# threads reading the members of one stack (preadv): the ``ahead`` loads alone keep too few
# reads in flight to fill a fast disk or the page cache's copy bandwidth
READ_THREADS = max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class ReadPlan:
    """How stacks are read: the reader, elements per stack, threads loading stacks, stacks read
    ahead (at most ``ahead + 1`` alive, which bounds host and device memory), the window
    reader's span in bytes, and the threads reading one stack's members (preadv)."""

    reader: str
    batch_elements: int
    workers: int
    ahead: int
    window_bytes: int
    read_threads: int = READ_THREADS

    def __post_init__(self):
        if self.reader not in READERS:
            raise ValueError(f"reader must be one of {', '.join(READERS)}, got {self.reader!r}")
        if min(self.batch_elements, self.workers, self.ahead, self.window_bytes,
               self.read_threads) < 1:
            raise ValueError(f"batch_elements, workers, ahead, window_bytes and read_threads "
                             f"must be >= 1, got {self}")


@dataclass
class Stack:
    """One stack of records on the device: the stored grid (None for weights stored dense or in
    a codec ``workbench.formats`` does not model), the members' host grids (views of the host
    buffers; None when the bytes went to a GPU in one piece) and the BF16 values when the
    weights were read dense (None when only grids were asked for)."""

    grid: QuantizedTensor | None
    host_grids: list[QuantizedTensor] | None
    dense: torch.Tensor | None


def grid_codec(ck, rec) -> bool:
    """Whether ``rec`` is stored as a grid ``workbench.formats`` models (codes + scales)."""
    return ck.spec(rec.name).codec in FMT_OF_CODEC


def signature(ck, rec) -> tuple:
    """What records are stacked by: (stored codec, profile, shape)."""
    spec = ck.spec(rec.name)
    return (spec.codec, spec.profile, tuple(rec.shape))


def plan_batches(keys: list, sizes: list[int], limit: int) -> list[list[int]]:
    """Indices grouped by key (first-seen order), each group cut into runs of at most ``limit``
    elements (at least one member each)."""
    groups: dict = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    out = []
    for members in groups.values():
        run, size = [], 0
        for i in members:
            if run and size + sizes[i] > limit:
                out.append(run)
                run, size = [], 0
            run.append(i)
            size += sizes[i]
        out.append(run)
    return out


def per_expert(xs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-member NVFP4 globals (scalars, or None for formats without one) as the ``[E, 1, 1]``
    tensor a stacked grid carries."""
    return None if xs[0] is None else torch.stack([x.reshape(()) for x in xs]).reshape(-1, 1, 1)


def stack_grids(grids: list[QuantizedTensor]) -> QuantizedTensor:
    """Stored grids of one format, profile and shape as one ``[E, ...]`` grid (NVFP4 globals
    become ``[E, 1, 1]``, one per expert, which the codecs accept)."""
    g0 = grids[0]
    if any((g.fmt, g.profile, g.shape) != (g0.fmt, g0.profile, g0.shape) for g in grids):
        raise ValueError("stack_grids needs grids of one format, profile and shape")
    return QuantizedTensor(g0.fmt, g0.profile, torch.stack([g.data for g in grids]),
                           torch.stack([g.scale for g in grids]),
                           per_expert([g.global_scale for g in grids]), (len(grids), *g0.shape),
                           per_expert([g.library_global for g in grids]))


class Stager:
    """Host tensors to ``device``. To CUDA: a pinned host buffer (the caching host allocator
    reuses it), then an async copy on the calling thread's own stream, waited for on that
    thread; the result is marked as used on the compute stream. One per read pass: each reader
    thread gets its stream on first use."""

    def __init__(self, device: torch.device):
        self.device = device
        self._streams = threading.local()

    def _stream(self) -> torch.cuda.Stream:
        s = getattr(self._streams, "s", None)
        if s is None:
            s = self._streams.s = torch.cuda.Stream(self.device)
        return s

    def h2d(self, pinned: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor on the CUDA device."""
        stream = self._stream()
        with torch.cuda.stream(stream):
            out = pinned.to(self.device, non_blocking=True)
        stream.synchronize()
        # allocated on the reader's stream, used on the compute stream: tell the allocator
        out.record_stream(torch.cuda.default_stream(self.device))
        return out

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t.to(self.device)
        pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        pinned.copy_(t)
        return self.h2d(pinned)

    def stack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``torch.stack(parts)`` on the device (stacked straight into the pinned buffer)."""
        if self.device.type != "cuda":
            return torch.stack(parts).to(self.device)
        pinned = torch.empty((len(parts), *parts[0].shape), dtype=parts[0].dtype,
                             pin_memory=True)
        torch.stack(parts, out=pinned)
        return self.h2d(pinned)

    def grid(self, q: QuantizedTensor) -> QuantizedTensor:
        def mv(t):
            return None if t is None else self.stage(t)

        return replace(q, data=mv(q.data), scale=mv(q.scale), global_scale=mv(q.global_scale),
                       library_global=mv(q.library_global))


def nvfp4_globals(ck, specs: list) -> list[tuple]:
    """Each member's (library global, decode global) for NVFP4, else (None, None)."""
    if FMT_OF_CODEC[specs[0].codec] != "nvfp4":
        return [(None, None)] * len(specs)
    return [library_global(ck, s) for s in specs]


def assemble(ck, specs: list, recs: list, data: torch.Tensor, scale: torch.Tensor,
             stager: Stager, globals_: list[tuple] | None = None) -> Stack:
    """The stack of members whose stored parts are stacked ``[E, ...]`` as stored:
    ``stored_grid``'s per-member steps on the whole stack. Parts on the host go to a CUDA
    device in one async copy each; the host grids are views of the host parts (None when the
    parts are already on a GPU)."""
    s0 = specs[0]
    if s0.blocks4d:  # gpt-oss [.., N, K/32, 16] -> [.., N, K/2]
        data = data.reshape(*data.shape[:-2], -1)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    fmt = FMT_OF_CODEC[s0.codec]
    globals_ = nvfp4_globals(ck, specs) if globals_ is None else globals_
    shape = tuple(recs[0].shape)
    host = None
    if data.device.type == "cpu":
        host = [QuantizedTensor(fmt, s.profile, data[i], scale[i], gs, shape, lib)
                for i, (s, (lib, gs)) in enumerate(zip(specs, globals_))]
    gs = per_expert([g for _, g in globals_])  # as stack_grids stacks them
    lib = per_expert([g for g, _ in globals_])
    if stager.device.type == "cuda" and data.device.type == "cpu":  # one async copy a buffer
        data, scale = stager.h2d(data), stager.h2d(scale)
    stack = QuantizedTensor(fmt, s0.profile, data, scale, gs, (len(recs), *shape), lib)
    # the [E, 1, 1] globals are tiny
    return Stack(replace(stack, global_scale=None if gs is None else stager.stage(gs),
                         library_global=None if lib is None else stager.stage(lib)), host, None)


def read_grid_stack(ck, recs: list, stager: Stager,
                    pool: ThreadPoolExecutor | None = None) -> Stack | None:
    """The stack of grid records ``recs``, each member's codes and scales read straight into its
    slice of one ``[E, ...]`` buffer per part (pinned for CUDA), the reads spread over ``pool``
    (serial without one). None when the members' stored parts do not stack (dtypes or selected
    shapes differ): the caller reads them per member."""
    specs = [ck.spec(r.name) for r in recs]
    s0 = specs[0]
    if any((s.codec, s.profile, s.blocks4d) != (s0.codec, s0.profile, s0.blocks4d)
           for s in specs):
        return None
    index = [grid_selection(ck, r) for r in recs]
    bufs, jobs = {}, []
    for role in ("data", "scale"):
        names = [s.part(role) for s in specs]
        entries = [ck.index.entry(n) for n in names]
        got = {(e.dtype, selection(e.shape, ix)[0]) for e, ix in zip(entries, index)}
        if len(got) != 1:
            return None
        ((dtype, shape),) = got
        buf = torch.empty((len(recs), *shape), dtype=dtype,
                          pin_memory=stager.device.type == "cuda")
        bufs[role] = buf
        jobs += [(n, ix, buf[i]) for i, (n, ix) in enumerate(zip(names, index))]
    if pool is not None and len(jobs) > 2:
        # list(): waits for all, re-raising the first error (CorruptShardError names the shard)
        list(pool.map(lambda j: ck.index.read_into(*j), jobs))
    else:
        for j in jobs:
            ck.index.read_into(*j)
    return assemble(ck, specs, recs, bufs["data"], bufs["scale"], stager)


def load_stack(ck, recs: list, stager: Stager, reader: str, *, dense: bool = True,
               pool: ThreadPoolExecutor | None = None) -> Stack:
    """Records ``recs`` (one signature) read and staged as one stack with ``reader`` (the
    window reader serves here the records no window takes: preadv). With ``dense=False`` a
    signature stored without a grid gives an empty stack, nothing read."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}, got {reader!r}")
    if grid_codec(ck, recs[0]):
        got = read_grid_stack(ck, recs, stager, pool) if reader != "safetensors" else None
        if got is not None:
            return got
        grids = [stored_grid(ck, r) for r in recs]
        return Stack(stager.grid(stack_grids(grids)), grids, None)
    if not dense:
        return Stack(None, None, None)
    return Stack(None, None, stager.stack([ck.view_of(r).materialize() for r in recs]))
