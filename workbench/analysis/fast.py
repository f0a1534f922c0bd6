"""The batched (and fused) paths of the three table questions: many experts per op.

Records are grouped by what they are (stored codec, profile, shape), so same-shape expert
projections of one checkpoint form stacks of at most ``batch_elements`` elements. A reader
loads the stored parts of the next stacks (codes and scales undecoded, or BF16 for weights
stored in a codec ``workbench.formats`` does not model) and stages each stack on the device,
so disk reads, host-to-device copies and the math of the current stack overlap. Three readers
(``WORKBENCH_ANALYSIS_READER``, see ``READER``): ``window`` reads each shard front to back in
large spans on one thread, copies a span to the device in one piece and cuts the stacks out of
it there (the stacks are formed inside a span, so a pass reads the files once, in order);
``preadv`` reads each member straight into its slice of a pinned stack buffer
(``ShardIndex.read_into``, spread over a small pool of read threads); ``safetensors`` is the
older path (``stored_grid`` per member, ``torch.stack``, a copy into the pinned buffer). The
default ``auto`` takes the window reader on CUDA and the older path on CPU, as measured; the
records a window cannot hold (strided rows, parts in two shards) go through preadv. The math
(decode, re-quantize, metrics, histograms) runs on the whole stack on the device
(``batched.py``); only a few numbers per expert come back. At most ``ahead + 1`` batches are alive, which bounds host
and device memory.

Results are returned per record in record order, so the tables (rows and scale histograms) are
built exactly as the reference builds them.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from workbench.checkpoint.grid import grid_selection, library_global, stored_grid
from workbench.checkpoint.index import selection
from workbench.checkpoint.layouts import FMT_OF_CODEC
from workbench.formats import QuantizedTensor, Recipe, dequantize

from . import batched, compiled

CPU_BATCH_ELEMENTS = 1 << 21  # 2M elements (4 MB BF16, ~1.3 Qwen3 experts): the codecs keep
# ~10 fp32-sized temporaries alive, so this bounds memory; on CPU larger stacks buy nothing
CUDA_BATCH_ELEMENTS = 1 << 28  # 256M elements: a whole layer's experts per launch on a GPU

READER_ENV = "WORKBENCH_ANALYSIS_READER"
READERS = ("auto", "window", "preadv", "safetensors")
# read once: the benchmark runs each reader in its own process to compare them. "auto" is what
# measured better per device. On the H200 host (jobs/gpu/analysis_speed.sh, 15 GB checkpoints, readers
# side by side in one run) the window reader gave 0.88-0.90x of the plain read for MXFP4 (warm
# process) where preadv gave 0.64-0.65x, with half the host CPU and equal tables; preadv had
# beaten the older reader there before (0.55 vs 0.47-0.53x, 26 vs 61 CPU-s, 28 vs ~300 MB). On
# the 2-core CPU host the math sets the pace and no measurement favours a reader: whole tables
# ran 4-5x slower with preadv on a loaded host in one session (cause not found), faster for MXFP4
# and slower for the other formats in another (docs/analysis.md), so CPU keeps the older reader.
READER = os.environ.get(READER_ENV, "auto")


def reader_for(dev: torch.device, local: bool = True) -> str:
    """The stack reader used on ``dev``: ``READER``, with "auto" resolved per device. A remote
    checkpoint (``local`` False) takes the range reads of ``preadv`` in parallel, never the
    window reader, which would fetch the bytes between the tensors asked for."""
    if READER not in READERS:
        raise ValueError(f"{READER_ENV}={READER!r}: must be one of {', '.join(READERS)}")
    if not local and READER in ("auto", "window"):
        return "preadv"
    if READER != "auto":
        return READER
    return "window" if dev.type == "cuda" else "safetensors"


# threads reading the members of one batch: the pipeline's ``ahead`` batches alone keep too few
# reads in flight to fill a fast disk or the page cache's copy bandwidth
READ_THREADS = max(2, min(8, os.cpu_count() or 2))


CUDA_WINDOW_BYTES = 512 << 20  # the window reader's span: ~1.5 Qwen3-30B-A3B MXFP4 layers; 3 alive
CPU_WINDOW_BYTES = 16 << 20  # on CPU (only when asked for): bounds memory as the stacks do
WINDOW_GAP = 8 << 20  # bytes of other tensors a window reads through rather than seek over


@dataclass(frozen=True)
class Plan:
    """How the batched path runs: elements per stack, reader threads, batches read ahead, and
    the window reader's span (``window_bytes``)."""

    batch_elements: int
    workers: int
    ahead: int
    window_bytes: int = CUDA_WINDOW_BYTES

    def __post_init__(self):
        if min(self.batch_elements, self.workers, self.ahead, self.window_bytes) < 1:
            raise ValueError(f"batch_elements, workers, ahead and window_bytes must be >= 1, "
                             f"got {self}")

    @classmethod
    def default(cls, device: torch.device, workers: int | None = None) -> Plan:
        if device.type == "cuda":
            return cls(CUDA_BATCH_ELEMENTS, workers or max(2, min(8, os.cpu_count() or 2)), 2)
        return cls(CPU_BATCH_ELEMENTS, workers or max(1, min(2, os.cpu_count() or 1)), 2,
                   CPU_WINDOW_BYTES)


def _grid_codec(ck, rec) -> bool:
    return ck.spec(rec.name).codec in FMT_OF_CODEC


def _signature(ck, rec) -> tuple:
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


# -- staging: host stacks to the device -----------------------------------------------------

_LOCAL = threading.local()


def _reader_stream(dev: torch.device) -> torch.cuda.Stream:
    stream = getattr(_LOCAL, "stream", None)
    if stream is None:
        stream = _LOCAL.stream = torch.cuda.Stream(dev)
    return stream


def _h2d(pinned: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A pinned host tensor on CUDA ``dev``: an async copy on this reader thread's stream,
    waited for here, so the compute stream never waits on I/O."""
    with torch.cuda.stream(_reader_stream(dev)):
        out = pinned.to(dev, non_blocking=True)
    _reader_stream(dev).synchronize()
    # allocated on the reader's stream, used on the compute stream: tell the allocator
    out.record_stream(torch.cuda.default_stream(dev))
    return out


def _stage(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev``. To CUDA: through a pinned buffer (the caching host allocator reuses it)
    on this reader thread's stream (``_h2d``)."""
    if dev.type != "cuda":
        return t.to(dev)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return _h2d(pinned, dev)


def _stack_stage(parts: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    if dev.type != "cuda":
        return torch.stack(parts).to(dev)
    pinned = torch.empty((len(parts), *parts[0].shape), dtype=parts[0].dtype, pin_memory=True)
    torch.stack(parts, out=pinned)
    return _h2d(pinned, dev)


def _stage_grid(q: QuantizedTensor, dev: torch.device) -> QuantizedTensor:
    def mv(t):
        return None if t is None else _stage(t, dev)

    return replace(q, data=mv(q.data), scale=mv(q.scale), global_scale=mv(q.global_scale),
                   library_global=mv(q.library_global))


_POOL_LOCK = threading.Lock()
_POOL: dict[int, ThreadPoolExecutor] = {}


def _read_pool() -> ThreadPoolExecutor:
    """The process's read threads, shared by every reader of the pipeline (their tasks never
    wait on another task, so sharing cannot deadlock). Keyed by process id: a forked child
    inherits the executor but not its threads, and would wait forever on its futures."""
    with _POOL_LOCK:
        pool = _POOL.get(os.getpid())
        if pool is None:
            _POOL.clear()  # a parent's executor: its threads do not exist here
            pool = _POOL[os.getpid()] = ThreadPoolExecutor(READ_THREADS,
                                                           thread_name_prefix="workbench-read")
        return pool


def _read_grid_stack(ck, recs: list, dev: torch.device):
    """``(stack, host grids)``: ``batched.stack_grids([stored_grid(ck, r) for r in recs])``
    bit for bit, with each member's codes and scales read straight into its slice of one
    ``[E, ...]`` buffer per part (pinned when ``dev`` is CUDA), the reads spread over the read
    pool. The host grids are views into the buffers. None when the members' stored parts do
    not stack (dtypes or selected shapes differ): the caller takes the per-member path."""
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
        buf = torch.empty((len(recs), *shape), dtype=dtype, pin_memory=dev.type == "cuda")
        bufs[role] = buf
        jobs += [(n, ix, buf[i]) for i, (n, ix) in enumerate(zip(names, index))]
    if len(jobs) > 2:
        # list(): waits for all, re-raising the first error (CorruptShardError names the shard)
        list(_read_pool().map(lambda j: ck.index.read_into(*j), jobs))
    else:
        for j in jobs:
            ck.index.read_into(*j)
    return _assemble(ck, specs, recs, bufs["data"], bufs["scale"], dev)


def _globals(ck, specs: list) -> list[tuple]:
    """Each member's (library global, decode global) (NVFP4), else (None, None)."""
    if FMT_OF_CODEC[specs[0].codec] != "nvfp4":
        return [(None, None)] * len(specs)
    return [library_global(ck, s) for s in specs]


def _assemble(ck, specs: list, recs: list, data: torch.Tensor, scale: torch.Tensor,
              dev: torch.device, globals_: list[tuple] | None = None):
    """``(stack, host grids)`` from the members' stored parts stacked ``[E, ...]`` as stored:
    ``stored_grid``'s per-member steps on the whole stack. Parts on the host go to a CUDA
    ``dev`` in one async copy each; the host grids are views of the host parts (None when the
    parts are already on a GPU)."""
    s0 = specs[0]
    if s0.blocks4d:  # gpt-oss [.., N, K/32, 16] -> [.., N, K/2]
        data = data.reshape(*data.shape[:-2], -1)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    fmt = FMT_OF_CODEC[s0.codec]
    globals_ = _globals(ck, specs) if globals_ is None else globals_
    shape = tuple(recs[0].shape)
    host = None
    if data.device.type == "cpu":
        host = [QuantizedTensor(fmt, s.profile, data[i], scale[i], gs, shape, lib)
                for i, (s, (lib, gs)) in enumerate(zip(specs, globals_))]
    gs = batched.per_expert([g for _, g in globals_])  # as stack_grids stacks them
    lib = batched.per_expert([g for g, _ in globals_])
    if dev.type == "cuda" and data.device.type == "cpu":  # one async copy per buffer
        data, scale = _h2d(data, dev), _h2d(scale, dev)
    stack = QuantizedTensor(fmt, s0.profile, data, scale, gs, (len(recs), *shape), lib)
    # the [E, 1, 1] globals are tiny
    return replace(stack, global_scale=None if gs is None else _stage(gs, dev),
                   library_global=None if lib is None else _stage(lib, dev)), host


@dataclass
class Loaded:
    """One stack of weights on the device: the stored grid (None for dense / unmodelled codecs),
    the host grids (for the compiled CPU pass) and the BF16 values when they were read dense."""

    grid: QuantizedTensor | None
    host_grids: list[QuantizedTensor] | None
    dense: torch.Tensor | None

    def weights(self) -> torch.Tensor:
        """BF16 ``[E, N, K]``: what ``view.materialize()`` gives for each member."""
        return self.dense if self.grid is None else batched.decode_stack(self.grid)


def load_stack(ck, recs: list, dev: torch.device, *, want_grid_only: bool = False) -> Loaded:
    """Read one batch's records (one signature) and stage them on ``dev`` as a stack. Under
    the window reader this serves the records no window takes (preadv per member)."""
    reader = reader_for(dev, ck.is_local)
    if _grid_codec(ck, recs[0]):
        got = _read_grid_stack(ck, recs, dev) if reader in ("preadv", "window") else None
        if got is not None:
            return Loaded(got[0], got[1], None)
        grids = [stored_grid(ck, r) for r in recs]
        host = batched.stack_grids(grids)
        return Loaded(_stage_grid(host, dev), grids, None)
    if want_grid_only:
        return Loaded(None, None, None)
    return Loaded(None, None, _stack_stage([ck.view_of(r).materialize() for r in recs], dev))


# -- the window reader: one sequential pass over each shard ----------------------------------
#
# The per-batch readers fetch each stack's members wherever they lie, so a pass over stacks
# grouped by shape skips through every shard twice (gate/up stacks, then down stacks) with many
# ~1 MB reads in flight. The window reader reads each shard front to back in large requests,
# as a plain read does, one span ("window") at a time on one reader thread, copies the span to
# the device in one piece, and cuts the stacks out of it there: the members' bytes are views
# of the span, stacked by one device copy.


@dataclass(frozen=True)
class _Part:
    """One stored part (codes or scales) of one record: a contiguous run of its shard."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # the selected shape, as ``selection`` gives it
    begin: int  # absolute byte offset in the shard
    nbytes: int


def _window_parts(ck, rec, dense: bool = False) -> tuple | None:
    """``(shard, parts)`` of a record whose stored parts are each one contiguous,
    element-aligned run of one shard: ``(data, scale)`` of a stored grid, or with ``dense``
    ``(data,)`` of a weight stored as plain BF16 ``[.., N, K]`` (what ``materialize`` returns
    without a cast or transpose). None for any other record (gpt-oss's interleaved gate/up rows,
    transposed or non-BF16 dense weights, parts in two shards): the per-batch readers take it."""
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
        parts.append(_Part(name, e.dtype, shape, e.begin + first * size, count * size))
        files.add(e.file)
    if len(files) != 1 or (len(roles) == 1 and (parts[0].dtype != torch.bfloat16 or
                                                 parts[0].shape != tuple(rec.shape))):
        return None
    return files.pop(), tuple(parts)


WINDOW_ALIGN = 64  # a window starts on this byte boundary, so every part's view is aligned


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


def window_plan(ck, recs: list, keys: list, plan: Plan, dense: bool = False):
    """``(windows, rest, parts)`` for records ``recs`` of ``ck`` (stacked by ``keys``):
    ``plan_windows`` over those ``_window_parts`` takes, ``rest`` (positions) for the per-batch
    readers, and the windowed records' parts by position. Stacks cut from one window must
    stack, so the parts' dtypes and shapes join the key."""
    sizes = [r.shape[0] * r.shape[1] for r in recs]
    got = [_window_parts(ck, r, dense) for r in recs]
    parts = {i: g[1] for i, g in enumerate(got) if g is not None}
    spans = [None if g is None else
             (g[0], min(p.begin for p in g[1]), max(p.begin + p.nbytes for p in g[1]))
             for g in got]
    keys = [None if g is None else
            (k, tuple((p.dtype, p.shape) for p in g[1]), ck.spec(r.name).blocks4d)
            for r, g, k in zip(recs, got, keys)]
    windows, rest = plan_windows(spans, keys, sizes, plan.batch_elements, plan.window_bytes,
                                 file_rank={f: k for k, f in enumerate(ck.index.files)})
    return windows, rest, parts


def _load_window(ck, w: Window, recs: list, parts: dict, dev: torch.device):
    """``(span, globals)``: window ``w``'s bytes read front to back into one buffer (pinned,
    then one async copy, on CUDA) and each member's NVFP4 globals by item position (``recs``:
    the records of all items)."""
    host = torch.empty(w.end - w.begin, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    ck.index.read_span(w.file, w.begin, host,
                       [(p.name, p.nbytes) for i in w.items for p in parts[i]])
    glob = {i: _globals(ck, [ck.spec(recs[i].name)])[0] for i in w.items if len(parts[i]) == 2}
    return (_h2d(host, dev) if dev.type == "cuda" else host), glob


def _window_stack(ck, w: Window, buf: torch.Tensor, glob: dict, batch: list[int], recs: list,
                  parts: dict, dev: torch.device) -> Loaded:
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
        return Loaded(None, None, stacked(0))
    specs = [ck.spec(r.name) for r in recs]
    stack, host = _assemble(ck, specs, recs, stacked(0), stacked(1), dev,
                            [glob[i] for i in batch])
    return Loaded(stack, host, None)


def pipeline(batches: list, load: Callable, compute: Callable, *, workers: int, ahead: int,
             desc: str, total: int, progress: bool) -> Iterable:
    """``compute(batch, load(batch))`` for each batch in order, loads on a pool running ahead."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="weight", disable=not progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        it = iter(batches)
        for b in it:
            pending.append((b, pool.submit(load, b)))
            if len(pending) >= ahead:
                break
        while pending:
            b, fut = pending.popleft()
            loaded = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(load, nxt)))
            yield from compute(b, loaded)
            bar.update(len(b))
            del loaded
    bar.close()


# -- the three questions ----------------------------------------------------------------------


def _base(rec, recipe: str) -> dict:
    return {"layer": rec.layer, "expert": rec.expert, "proj": rec.proj, "kind": rec.kind,
            "recipe": recipe}


def _row(rec, recipe: str, metrics: dict) -> dict:
    return {**_base(rec, recipe), **metrics, "numel": rec.shape[0] * rec.shape[1]}


def _hist(rec, recipe: str, pairs) -> list[dict]:
    base = _base(rec, recipe)
    return [{**base, "exponent": int(e), "count": int(c)} for e, c in pairs]


@dataclass(frozen=True)
class Windowed:
    """What ``_run`` reads in windows: records ``recs`` (one per item) of checkpoint ``ck``,
    BF16 ones too with ``dense``. ``side(batches)``, when given, loads on the reader thread
    what else each of a window's batches (item positions) needs (the other checkpoint's stack,
    for question 2) and ``join(stack, side)`` forms ``per_batch``'s argument from the two."""

    ck: object
    recs: list
    dense: bool = False
    side: Callable | None = None
    join: Callable | None = None


def _run(ck, items: list, keyf, dev, plan: Plan, desc: str, progress: bool, load, per_batch,
         windows: Windowed | None = None):
    """Per record, in record order: (rows, hist) from ``per_batch(recs, loaded)``. With
    ``windows`` and the window reader on ``dev``, the records that lie in contiguous runs are
    read in windows (one reader thread, each shard front to back); ``load`` serves the rest."""
    sizes = [r.shape[0] * r.shape[1] for r in items]
    rest = list(range(len(items)))
    units: list = []
    parts: dict[int, tuple] = {}
    if windows is not None and reader_for(dev, windows.ck.is_local) == "window":
        units, rest, parts = window_plan(windows.ck, windows.recs, [keyf(r) for r in items],
                                         plan, windows.dense)
    units += [[rest[j] for j in b] for b in
              plan_batches([keyf(items[i]) for i in rest], [sizes[i] for i in rest],
                           plan.batch_elements)]
    results: dict[int, tuple] = {}

    def load_unit(u):
        if not isinstance(u, Window):
            return load([items[i] for i in u])
        buf, glob = _load_window(windows.ck, u, windows.recs, parts, dev)
        return buf, glob, None if windows.side is None else windows.side(u.batches)

    def compute(u, loaded):
        if not isinstance(u, Window):
            for i, res in zip(u, per_batch([items[i] for i in u], loaded)):
                results[i] = res
            return ()
        buf, glob, side = loaded
        for k, b in enumerate(u.batches):
            got = _window_stack(windows.ck, u, buf, glob, b, [windows.recs[i] for i in b],
                                parts, dev)
            arg = got if side is None else windows.join(got, side[k])
            for i, res in zip(b, per_batch([items[i] for i in b], arg)):
                results[i] = res
        return ()

    # windows are read one after another, front to back (a second reader would interleave two
    # sequential streams); the per-batch loads spread their members over the read pool
    workers = 1 if any(isinstance(u, Window) for u in units) else plan.workers
    for _ in pipeline(units, load_unit, compute, workers=workers, ahead=plan.ahead, desc=desc,
                      total=len(items), progress=progress):
        pass
    return [results[i] for i in range(len(items))]


def _recipe_rows(w, recipe: Recipe, stored: QuantizedTensor | None) -> tuple[list, list]:
    """Rows' metrics and histograms of stack ``w`` quantized with ``recipe``; with the stored
    grid's mismatch columns when it has the same format and block layout."""
    q = batched.quantize_stack(w, recipe)
    ms = batched.stack_metrics(w, dequantize(q, torch.float32), q)
    if stored is not None and recipe.fmt == stored.fmt and q.scale.shape == stored.scale.shape:
        for m, mm in zip(ms, batched.stack_mismatch(stored, q)):
            m.update(mm)
    return ms, batched.stack_histograms(q)


def _compiled_ok(use_compiled: bool, dev, what: str) -> bool:
    """Whether the compiled CPU passes (``compiled.py``) are tried for this call (logged)."""
    if not use_compiled:
        return False
    why = compiled.static_reason(dev)
    compiled.log_choice(what, why)
    return why is None


def _compiled_recipe(w, stored, recipe: Recipe, what: str, compare: bool = True):
    """(metrics, histograms) of the stack from the compiled pass, or None (reason logged)."""
    if compiled._BROKEN:
        return None
    bad = compiled.recipe_reason(recipe)
    if bad is not None:
        compiled.log_choice(f"{what} ({recipe})", bad)
        return None
    if not compiled.preferred("recipe", None if stored is None else stored.fmt, recipe.fmt):
        compiled.log_choice(f"{what} ({'bf16' if stored is None else stored.fmt} -> "
                            f"{recipe.fmt})", "measured faster batched, compiled.FASTER")
        return None
    why = compiled.finite_reason(w, stored)
    if why is not None:
        compiled.log_choice(what, why)
        return None
    rows = compiled.recipe_rows(w, stored, recipe, compare)
    if rows is None:
        return None
    return [r.metrics for r in rows], [r.hist for r in rows]


_MISMATCH = ("scale_mismatch_frac", "code_mismatch_frac")


def _candidate_from_grid(loaded: Loaded, recipe: Recipe):
    """Question 1 on a stored grid is question 3 without its mismatch columns: the closed-form
    passes (``fused.py``: a grid re-quantized in its own format) where they apply, else the
    compiled pass (the same graphs as ``stored_results``, so one compile serves both)."""
    from . import fused

    grids = loaded.host_grids
    if fused.static_reason(recipe, loaded.grid.data.device) is None and \
            len({g.profile for g in grids}) == 1 and \
            all(fused.grid_reason(g, recipe) is None for g in grids):
        res = fused.stored_vs_recipe(grids, recipe)
        if res is not None and all(x is not None for x in res):
            return [x.metrics for x in res], [x.histogram() for x in res]
    return _compiled_recipe(None, loaded.grid, recipe, "candidate recipes")


def candidate_results(ck, items, recipes: list[Recipe], dev, plan: Plan, progress: bool,
                      use_compiled: bool = False):
    use_compiled = _compiled_ok(use_compiled, dev, "candidate recipes")

    def per_batch(recs, loaded):
        w = None
        out = [([], []) for _ in recs]
        for r in recipes:
            got = None
            if use_compiled:  # the stored grid is decoded inside the compiled pass
                got = _compiled_recipe(loaded.dense, None, r, "candidate recipes") \
                    if loaded.grid is None else \
                    _candidate_from_grid(loaded, r)
            if got is not None:  # without the mismatch columns, as the reference
                ms = [{k: v for k, v in m.items() if k not in _MISMATCH} for m in got[0]]
                hs = got[1]
            else:
                w = loaded.weights() if w is None else w
                ms, hs = _recipe_rows(w, r, None)
            for (rows, hist), rec, m, h in zip(out, recs, ms, hs):
                rows.append(_row(rec, str(r), m))
                hist.extend(_hist(rec, str(r), h))
        return out

    return _run(ck, items, lambda r: _signature(ck, r), dev, plan, "candidate recipes", progress,
                lambda recs: load_stack(ck, recs, dev), per_batch,
                windows=Windowed(ck, items, dense=True))


def reference_results(ck, reference, items, label: Callable, dev, plan: Plan, progress: bool,
                      use_compiled: bool = False):
    use_compiled = _compiled_ok(use_compiled, dev, "stored vs reference")

    def ref_rec(rec):
        return reference.record(rec.layer, rec.expert, rec.proj, rec.kind)

    def load(recs):
        return load_stack(ck, recs, dev), load_stack(reference, [ref_rec(r) for r in recs], dev)

    def per_batch(recs, loaded):
        mine, ref = loaded
        w = ref.weights()
        shape = mine.grid.shape if mine.grid is not None else tuple(mine.dense.shape)
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"{recs[0].key}: shape {tuple(shape[1:])} in {ck.path} but "
                             f"{tuple(w.shape[1:])} in the reference")
        ms = None
        if use_compiled and mine.grid is not None and not compiled._BROKEN:
            # the table lookup first: finite_reason is a full pass over the reference stack
            # (4.4-4.8 ns per element on the 2-core host), wasted where batched is taken anyway
            why = None
            if not compiled.preferred("reference", mine.grid.fmt, None):
                why = f"{mine.grid.fmt} grids: measured faster batched, compiled.FASTER"
            if why is None:
                why = compiled.finite_reason(w, mine.grid)
            if why is None:  # the stored grid is decoded inside the compiled pass
                ms = compiled.reference_rows(w, mine.grid)
            else:
                compiled.log_choice("stored vs reference", why)
        if ms is None:
            ms = batched.stack_metrics(w, mine.weights(), mine.grid)
        hs = batched.stack_histograms(mine.grid) if mine.grid is not None else [[]] * len(recs)
        return [([_row(rec, label(rec), m)], _hist(rec, label(rec), h))
                for rec, m, h in zip(recs, ms, hs)]

    def key(rec):
        return (*_signature(ck, rec), _signature(reference, ref_rec(rec)))

    # the reference (BF16, the larger side) is read in windows; the stored grids of each
    # window's batches are read alongside (_side_stacks)
    win = Windowed(reference, [ref_rec(r) for r in items], dense=True,
                   side=lambda batches: _side_stacks(ck, items, batches, dev,
                                                     plan.window_bytes),
                   join=lambda ref, mine: (mine, ref))
    return _run(ck, items, key, dev, plan, "stored vs reference", progress, load, per_batch,
                windows=win)


def _side_stacks(ck, items: list, batches: list[list[int]], dev: torch.device,
                 window_bytes: int) -> list:
    """The stacks of ``batches`` (positions in ``items``, records of ``ck``), read as one span
    when their parts lie close together in one shard (at least half the span is theirs: a
    stretch of one layer, as the reference's window is; at most ``window_bytes``), else per
    batch (``load_stack``)."""
    flat = [i for b in batches for i in b]
    got = [_window_parts(ck, items[i]) for i in flat]
    parts = {i: g[1] for i, g in zip(flat, got) if g is not None}

    def stacks(b):  # the members' parts stack (the reference's key holds only our signature)
        return len({(tuple((p.dtype, p.shape) for p in parts[i]), ck.spec(items[i].name).blocks4d)
                    for i in b}) == 1

    if len(parts) == len(flat) and len({g[0] for g in got}) == 1 and all(map(stacks, batches)):
        lo = min(p.begin for g in got for p in g[1])
        lo -= lo % WINDOW_ALIGN
        hi = max(p.begin + p.nbytes for g in got for p in g[1])
        if hi - lo <= min(window_bytes, 2 * sum(p.nbytes for g in got for p in g[1])):
            w = Window(got[0][0], lo, hi, flat, batches)
            buf, glob = _load_window(ck, w, items, parts, dev)
            return [_window_stack(ck, w, buf, glob, b, [items[i] for i in b], parts, dev)
                    for b in batches]
    return [load_stack(ck, [items[i] for i in b], dev) for b in batches]


def stored_results(ck, items, recipes: list[Recipe], dev, plan: Plan, progress: bool,
                   use_fused: bool):
    from . import fused

    fused_ok = dict.fromkeys(recipes, False)
    use_compiled = _compiled_ok(use_fused, dev, "stored grid vs recipes")
    if use_fused:
        for r in recipes:
            why = fused.static_reason(r, dev)
            fused.log_choice(str(r), why)
            fused_ok[r] = why is None

    def per_batch(recs, loaded):
        stored = loaded.grid
        if stored is None:  # stored dense: no grid to compare with (as the reference)
            return [([], []) for _ in recs]
        out = [([], []) for _ in recs]
        w = None
        for r in recipes:
            ms, hs = [None] * len(recs), [None] * len(recs)
            # members the compiled pass takes (logged why not for the others), then the rest
            picked = _fused_members(loaded.host_grids, r) if fused_ok[r] and not fused._BROKEN \
                else []
            res = fused.stored_vs_recipe([loaded.host_grids[i] for i in picked], r) \
                if picked else None
            if res is None:
                picked = []
            for i, x in zip(picked, res or ()):
                if x is not None:  # None: refused after reading (reason logged), see below
                    ms[i], hs[i] = x.metrics, x.histogram()
            rest = [i for i in range(len(recs)) if ms[i] is None]
            if rest and use_compiled:
                sub = stored if len(rest) == len(recs) else \
                    _take(stored, torch.tensor(rest, device=stored.data.device))
                got = _compiled_recipe(None, sub, r, "stored grid vs recipes")
                for i, m, h in zip(rest, *(got or ((), ()))):
                    ms[i], hs[i] = m, h
                rest = [i for i in range(len(recs)) if ms[i] is None]
            if rest:
                w = batched.decode_stack(stored) if w is None else w
                sel = None if len(rest) == len(recs) else torch.tensor(rest, device=w.device)
                m2, h2 = _recipe_rows(w if sel is None else w[sel], r,
                                      stored if sel is None else _take(stored, sel))
                for i, m, h in zip(rest, m2, h2):
                    ms[i], hs[i] = m, h
            for (rows, hist), rec, m, h in zip(out, recs, ms, hs):
                rows.append(_row(rec, str(r), m))
                hist.extend(_hist(rec, str(r), h))
        return out

    return _run(ck, items, lambda r: _signature(ck, r), dev, plan, "stored grid vs recipes",
                progress, lambda recs: load_stack(ck, recs, dev, want_grid_only=True), per_batch,
                windows=Windowed(ck, items))  # grids only: dense weights are not read


def _fused_members(grids: list[QuantizedTensor], recipe: Recipe) -> list[int]:
    """Positions of the host grids the compiled pass can take (the others' reasons logged)."""
    from . import fused

    ok = []
    for i, g in enumerate(grids):
        why = fused.grid_reason(g, recipe)
        if why is None:
            ok.append(i)
        else:
            fused.log_choice(str(recipe), why)
    return ok


def _take(q: QuantizedTensor, idx: torch.Tensor) -> QuantizedTensor:
    """Members ``idx`` of a stacked grid."""
    def sel(t):
        return None if t is None else t[idx]

    return replace(q, data=q.data[idx], scale=q.scale[idx], global_scale=sel(q.global_scale),
                   library_global=sel(q.library_global), shape=(len(idx), *q.shape[1:]))
