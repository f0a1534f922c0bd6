"""The window reader: each shard read front to back in large spans, stacks cut out of a span.

The per-batch readers (``stacks.py``) fetch each stack's members wherever they lie, so a pass
over stacks grouped by shape skips through every shard twice (gate/up stacks, then down stacks)
with many ~1 MB reads in flight. The window reader reads each shard front to back in large
requests (``ShardIndex.read_span``), as a plain read does, one span ("window") at a time on one
reader thread, copies the span to the device in one piece, and cuts the stacks out of it there:
the members' bytes are views of the span, stacked by one device copy. Stacks are formed inside
a window (same key, parts of one dtype and shape), so a pass reads the files once, in order.

A window grows while the next record begins within ``WINDOW_GAP`` bytes of its end (the bytes
between are read, not sought over, and counted as ``gap_bytes``). Records a window cannot hold
go to the per-batch readers: strided rows (gpt-oss's interleaved gate/up), codes and scales in
two shards, a dense weight that is not plain BF16, a record larger than the window.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from .grid import grid_selection
from .index import selection
from .layouts import FMT_OF_CODEC
from .stacks import Stack, Stager, assemble, load_stack, nvfp4_globals, plan_batches

WINDOW_GAP = 8 << 20  # bytes of other tensors a window reads through rather than seek over
WINDOW_ALIGN = 64  # a window starts on this byte boundary, so every part's view is aligned


@dataclass(frozen=True)
class Part:
    """One stored part (codes or scales) of one record: a contiguous run of its shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # the selected shape, as ``selection`` gives it
    begin: int  # absolute byte offset in the shard
    nbytes: int


def window_parts(ck, rec, dense: bool = False) -> tuple | None:
    """``(shard, parts)`` of a record whose stored parts are each one contiguous,
    element-aligned run of one shard: ``(data, scale)`` of a stored grid, or with ``dense``
    ``(data,)`` of a weight stored as plain BF16 ``[.., N, K]`` (what ``materialize`` returns
    without a cast or transpose). None for any other record: the per-batch readers take it."""
    spec = ck.spec(rec.name)
    if spec.codec in FMT_OF_CODEC:
        roles = ("data", "scale")
    elif dense and spec.codec is None and spec.stored_dtype == torch.bfloat16 and \
            not spec.transposed and not spec.interleaved:
        roles = ("data",)
    else:
        return None
    ix = grid_selection(ck, rec)
    parts, files = [], set()
    for role in roles:
        name = spec.part(role)
        e = ck.index.entry(name)
        if len(e.shape) < 2:
            return None
        shape, first, count = selection(e.shape, ix)
        size = e.dtype.itemsize
        if first is None or (e.begin + first * size) % size:
            return None
        parts.append(Part(name, e.dtype, shape, e.begin + first * size, count * size))
        files.add(e.file)
    if len(files) != 1 or (len(roles) == 1 and (parts[0].dtype != torch.bfloat16 or
                                                 parts[0].shape != tuple(rec.shape))):
        return None
    return files.pop(), tuple(parts)


@dataclass
class Window:
    """A span ``[begin, end)`` of one shard read front to back, the items (positions) whose
    parts lie in it, and those items cut into stacks."""

    file: Path
    begin: int
    end: int
    items: list[int]
    batches: list[list[int]]

    def __len__(self) -> int:  # the progress bar counts weights
        return len(self.items)


def plan_windows(spans: list, keys: list, sizes: list[int], limit: int, window_bytes: int,
                 gap: int = WINDOW_GAP, file_rank: dict | None = None
                 ) -> tuple[list[Window], list[int]]:
    """``(windows, rest)``. ``spans[i]`` is item i's ``(file, begin, end)`` or None. Items are
    taken in file order (shards by ``file_rank``, else by first appearance, then by offset);
    a window grows while its span stays within ``window_bytes`` and the next item begins at most
    ``gap`` bytes after the window's end. Inside a window the items are cut into stacks as
    ``plan_batches`` cuts them (same key, at most ``limit`` elements). ``rest``: the items
    without a span or with one larger than ``window_bytes``, in their order."""
    rank = dict(file_rank or {})
    for sp in spans:
        if sp is not None and sp[0] not in rank:
            rank[sp[0]] = len(rank)
    rest = [i for i, sp in enumerate(spans)
            if sp is None or sp[2] - (sp[1] - sp[1] % WINDOW_ALIGN) > window_bytes]
    left = set(rest)
    order = sorted((i for i in range(len(spans)) if i not in left),
                   key=lambda i: (rank[spans[i][0]], spans[i][1], spans[i][2], i))
    windows: list[Window] = []
    cur: Window | None = None
    for i in order:
        f, lo, hi = spans[i]
        if cur is not None and f == cur.file and lo <= cur.end + gap and \
                max(cur.end, hi) - cur.begin <= window_bytes:
            cur.end = max(cur.end, hi)
            cur.items.append(i)
            continue
        cur = Window(f, lo - lo % WINDOW_ALIGN, hi, [i], [])
        windows.append(cur)
    for w in windows:
        w.batches = [[w.items[j] for j in b] for b in
                     plan_batches([keys[i] for i in w.items], [sizes[i] for i in w.items], limit)]
    return windows, rest


def window_plan(ck, recs: list, keys: list, limit: int, window_bytes: int, dense: bool = False):
    """``(windows, rest, parts)`` for records ``recs`` of ``ck`` (stacked by ``keys``, at most
    ``limit`` elements a stack): ``plan_windows`` over those ``window_parts`` takes, ``rest``
    (positions) for the per-batch readers, and the windowed records' parts by position. Stacks
    cut from one window must stack, so the parts' dtypes and shapes join the key."""
    sizes = [r.shape[0] * r.shape[1] for r in recs]
    got = [window_parts(ck, r, dense) for r in recs]
    parts = {i: g[1] for i, g in enumerate(got) if g is not None}
    spans = [None if g is None else
             (g[0], min(p.begin for p in g[1]), max(p.begin + p.nbytes for p in g[1]))
             for g in got]
    keys = [None if g is None else
            (k, tuple((p.dtype, p.shape) for p in g[1]), ck.spec(r.name).blocks4d)
            for r, g, k in zip(recs, got, keys)]
    windows, rest = plan_windows(spans, keys, sizes, limit, window_bytes,
                                 file_rank={f: k for k, f in enumerate(ck.index.files)})
    return windows, rest, parts


def load_window(ck, w: Window, recs: list, parts: dict, stager: Stager):
    """``(span, globals)``: window ``w``'s bytes read front to back into one buffer (pinned,
    then one async copy, for CUDA) and each member's NVFP4 globals by item position (``recs``:
    the records of all items)."""
    cuda = stager.device.type == "cuda"
    host = torch.empty(w.end - w.begin, dtype=torch.uint8, pin_memory=cuda)
    ck.index.read_span(w.file, w.begin, host,
                       [(p.name, p.nbytes) for i in w.items for p in parts[i]])
    glob = {i: nvfp4_globals(ck, [ck.spec(recs[i].name)])[0]
            for i in w.items if len(parts[i]) == 2}
    return (stager.h2d(host) if cuda else host), glob


def window_stack(ck, w: Window, buf: torch.Tensor, glob: dict, batch: list[int], recs: list,
                 parts: dict, stager: Stager) -> Stack:
    """The stack of ``batch`` (item positions; ``recs`` their records) cut out of window
    ``w``'s span ``buf``: each member's parts are views of the span, stacked by one copy (a
    batch is all grids or all BF16: the parts join the key)."""
    def stacked(k: int) -> torch.Tensor:
        views = []
        for i in batch:
            p = parts[i][k]
            lo = p.begin - w.begin
            views.append(buf[lo:lo + p.nbytes].view(p.dtype).view(p.shape))
        return torch.stack(views)

    if len(parts[batch[0]]) == 1:  # plain BF16: what ``materialize`` gives, stacked
        return Stack(None, None, stacked(0))
    specs = [ck.spec(r.name) for r in recs]
    return assemble(ck, specs, recs, stacked(0), stacked(1), stager,
                    [glob[i] for i in batch])


def side_stacks(ck, items: list, batches: list[list[int]], stager: Stager, window_bytes: int,
                reader: str, pool: ThreadPoolExecutor | None = None) -> list[Stack]:
    """The stacks of ``batches`` (positions in ``items``, records of ``ck``), read as one span
    when their grids lie close together in one shard (at least half the span is theirs: a
    stretch of one layer, as the window they accompany is; at most ``window_bytes``), else per
    batch (``load_stack`` with ``reader``)."""
    flat = [i for b in batches for i in b]
    got = [window_parts(ck, items[i]) for i in flat]
    parts = {i: g[1] for i, g in zip(flat, got) if g is not None}

    def stacks(b):  # the members' parts stack (the caller's key may hold only our signature)
        return len({(tuple((p.dtype, p.shape) for p in parts[i]), ck.spec(items[i].name).blocks4d)
                    for i in b}) == 1

    if len(parts) == len(flat) and len({g[0] for g in got}) == 1 and all(map(stacks, batches)):
        lo = min(p.begin for g in got for p in g[1])
        lo -= lo % WINDOW_ALIGN
        hi = max(p.begin + p.nbytes for g in got for p in g[1])
        if hi - lo <= min(window_bytes, 2 * sum(p.nbytes for g in got for p in g[1])):
            w = Window(got[0][0], lo, hi, flat, batches)
            buf, glob = load_window(ck, w, items, parts, stager)
            return [window_stack(ck, w, buf, glob, b, [items[i] for i in b], parts, stager)
                    for b in batches]
    return [load_stack(ck, [items[i] for i in b], stager, reader, pool=pool) for b in batches]
