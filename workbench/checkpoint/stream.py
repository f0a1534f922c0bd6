"""Stacks of a list of records, read ahead on threads while the caller computes on the last.

``stream_stacks`` runs a ``ReadPlan`` over records: it forms the stacks (records of one key, at
most ``batch_elements`` elements; under the window reader, within a span of a shard), loads
``ahead`` of them on a thread pool and yields them in order, so disk reads, host-to-device
copies and the caller's math on the current stack overlap. Question-2-like work reads two
checkpoints in step: one ``Source`` per checkpoint, the same positions in each; under the window
reader one of them (``span_source``, the larger: a BF16 reference) is read in windows and the
others' stacks of each window are read alongside it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .stacks import ReadPlan, Stack, Stager, load_stack, plan_batches
from .windows import Window, load_window, side_stacks, window_plan, window_stack


@dataclass(frozen=True)
class Source:
    """Records of one checkpoint, one per position. ``dense``: weights stored without a grid
    ``workbench.formats`` models are read too (BF16 as stored, or decoded); else such stacks
    come back empty and are not read."""

    ck: object
    recs: list
    dense: bool = True


def stream_stacks(sources: list[Source], keys: list, plan: ReadPlan, device: torch.device, *,
                  span_source: int = 0, desc: str = "", progress: bool = False
                  ) -> Iterator[tuple[list[int], tuple[Stack, ...]]]:
    """``(positions, one stack per source)`` for every stack of the records, each position in
    exactly one. Positions with equal ``keys`` may share a stack; under the window reader the
    stacks come in file order, else in ``plan_batches`` order. A read error (a shard truncated
    since it was indexed) is raised here, from the thread that met it."""
    first = sources[0]
    sizes = [r.shape[0] * r.shape[1] for r in first.recs]
    rest = list(range(len(first.recs)))
    units: list = []
    parts: dict[int, tuple] = {}
    span = sources[span_source]
    if plan.reader == "window":
        units, rest, parts = window_plan(span.ck, span.recs, keys, plan.batch_elements,
                                         plan.window_bytes, span.dense)
    units += [[rest[j] for j in b] for b in
              plan_batches([keys[i] for i in rest], [sizes[i] for i in rest],
                           plan.batch_elements)]
    stager = Stager(device)
    others = [k for k in range(len(sources)) if k != span_source]
    with ThreadPoolExecutor(plan.read_threads, thread_name_prefix="workbench-read") as pool:

        def load(u):
            if not isinstance(u, Window):
                return [load_stack(s.ck, [s.recs[i] for i in u], stager, plan.reader,
                                   dense=s.dense, pool=pool) for s in sources]
            buf, glob = load_window(span.ck, u, span.recs, parts, stager)
            return buf, glob, [side_stacks(sources[k].ck, sources[k].recs, u.batches, stager,
                                           plan.window_bytes, plan.reader, pool) for k in others]

        # windows are read one after another, front to back (a second reader would interleave
        # two sequential streams); the per-batch loads spread their members over the pool
        workers = 1 if any(isinstance(u, Window) for u in units) else plan.workers
        for u, loaded in read_ahead(units, load, workers=workers, ahead=plan.ahead, desc=desc,
                                    total=len(first.recs), progress=progress):
            if not isinstance(u, Window):
                yield u, tuple(loaded)
            else:
                buf, glob, side = loaded
                for j, b in enumerate(u.batches):
                    stacks = [s[j] for s in side]
                    stacks.insert(span_source, window_stack(
                        span.ck, u, buf, glob, b, [span.recs[i] for i in b], parts, stager))
                    yield b, tuple(stacks)
                buf = side = stacks = None
            # at most ``ahead + 1`` units alive: this one goes before the next is waited for
            loaded = None


def read_ahead(units: list, load: Callable, *, workers: int, ahead: int, desc: str, total: int,
               progress: bool) -> Iterable:
    """``(unit, load(unit))`` for each unit in order, the loads running ``ahead`` units ahead
    on ``workers`` threads; a tqdm bar counts ``len(unit)`` per unit the caller is done with."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="weight", disable=not progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        it = iter(units)
        for u in it:
            pending.append((u, pool.submit(load, u)))
            if len(pending) >= ahead:
                break
        while pending:
            u, fut = pending.popleft()
            loaded = fut.result()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(load, nxt)))
            yield u, loaded
            bar.update(len(u))
            del loaded
    bar.close()
