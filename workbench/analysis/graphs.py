"""The one rule the compiled CPU passes share (``compiled.py`` and the closed forms of
``fused.py``, ``fused_fp8.py``, ``fused_nvfp4.py``): compile a graph once per key, time its
first call (trace and compile, or a load from Inductor's disk cache) and log it, and when a
compile fails, record why and turn that family of passes off for the process, so every later
call takes the batched path instead of failing again.

The caches stay module globals of their users (``_COMPILED``, ``COMPILE_SECONDS``,
``_BROKEN``), passed in at each call: tests reset them per module.

One record is process-wide, for ``paths.choose_path``: the units (``paths.job_units``: question,
stored codec, profile, shape, stacks of one or more, recipe) of every fused call in this process
that ran compiled graphs (``GRAPH_CALLS`` grew: each returned, so each had compiled or loaded)
with no family turned off at its end. A job made of such units finds the graphs it needs
compiled, so "auto" may take ``fused`` for it at any size: the first compile, the only reason
for the size threshold, is behind it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

GRAPH_CALLS = [0]  # calls of a compiled graph that returned, in this process (a list: mutable)
_WARM: set = set()  # paths.job_units of fused calls that ran graphs and broke no family


def compiled(cache: dict, key, build: Callable, **options) -> Callable:
    """``torch.compile(build())`` (full graph, static shapes but the dims marked dynamic by
    ``mark_leading_dynamic``), made once per ``key`` in ``cache``."""
    fn = cache.get(key)
    if fn is None:
        fn = cache[key] = torch.compile(build(), fullgraph=True, dynamic=False,
                                        options=options or None)
    return fn


def mark_leading_dynamic(args) -> None:
    """One graph for any number of stacked experts or chunks: the first dim of every argument
    with one is dynamic (dynamo specialises a dim of size 1, so those are left alone)."""
    for a in args:
        if a is not None and a.dim() and a.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(a, 0)


def first_call_timed(fn: Callable, args, key, seconds: dict, broken: list, *, what: str,
                     label, unavailable: type[Exception], log: logging.Logger):
    """``fn(*args)``; the first call per ``key`` timed into ``seconds`` and logged. A failure
    appends its first line to ``broken`` and raises ``unavailable`` (the callers' signal to
    take the batched path)."""
    if key in seconds:
        out = fn(*args)
        GRAPH_CALLS[0] += 1
        return out
    t0 = time.perf_counter()
    try:
        out = fn(*args)
    except Exception as e:  # whatever stops compiling, the batched path still works
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        broken.append(f"{type(e).__name__}: {first}"[:300])
        log.warning("%s unavailable, using the batched path: %s", what, broken[0])
        raise unavailable(broken[0]) from e
    seconds[key] = secs = time.perf_counter() - t0
    GRAPH_CALLS[0] += 1
    log.info("%s pass %s ready in %.1f s (Inductor C++, cached on disk)", what, label, secs)
    return out


def note_fused_job(units: frozenset, calls_before: int, broken: str | None) -> bool:
    """Record ``units`` as warm after a fused call that started at ``GRAPH_CALLS[0] ==
    calls_before``: only if it called a compiled graph (a fused call served wholly by the
    batched path compiled nothing, so its next call might) and no family is off (``broken``,
    the first reason of any, else None). Returns whether they were recorded."""
    if GRAPH_CALLS[0] > calls_before and broken is None:
        _WARM.update(units)
        return True
    return False


def warm(units: frozenset) -> bool:
    """Whether every one of ``units`` was recorded by ``note_fused_job`` in this process."""
    return bool(units) and units <= _WARM
