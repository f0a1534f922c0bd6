"""An analysis session: the compiled CPU graphs one caller has made, and what making them taught.

The compiled passes (``compiled.py`` and the closed forms of ``fused.py``, ``fused_fp8.py``,
``fused_nvfp4.py``) cost seconds to compile once and nothing after; a compile can also fail (no
C++ compiler, an Inductor error), and then every later stack of that family is better served
batched than by failing again. Which graphs exist, which families failed and why, and which
jobs (``plans.job_units``) a fused call has run are learned while working: they live in a
``Session`` the caller owns and passes to each table call (a notebook keeps one; a table call
without one makes its own), never in the process. ``plans.plan`` reads a session to decide
"auto" (a job whose graphs this session has compiled takes ``fused`` at any size; a failed
compile keeps small jobs batched) and says so in the plan's reason.

A session is used by one thread at a time (the table calls' compute runs on the caller's
thread; only reads run on other threads).
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch

FAMILIES = ("fused", "compiled")  # the closed forms, and the traced codecs of compiled.py


class Unavailable(Exception):
    """A graph could not be compiled (or its family failed earlier): take the batched path."""


def torch_compile(fn: Callable, options: dict) -> Callable:
    """The default compiler: full graph, static shapes but the dims ``mark_leading_dynamic``
    marks."""
    return torch.compile(fn, fullgraph=True, dynamic=False, options=options or None)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps its compiled graphs on the code object
    and allows ``recompile_limit`` (8) per code object: closures of one builder share one, and
    so would every session's copy of a graph; one code object per graph: one compile each."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def mark_leading_dynamic(args) -> None:
    """One graph for any number of stacked experts or chunks: the first dim of every argument
    with one is dynamic (dynamo specialises a dim of size 1, so those are left alone)."""
    for a in args:
        if a is not None and a.dim() and a.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(a, 0)


class Session:
    """Compiled graphs per (family, key), each first call's seconds, the families turned off by
    a failed compile (family -> the first reason), the number of graph calls that returned, the
    job units of fused calls that ran graphs and turned nothing off, the log lines already said,
    and the scratch buffers the closed forms fill. ``compiler(fn, options)`` makes a graph callable (``torch_compile``; a test passes
    ``eager`` to run the same graph functions uncompiled)."""

    def __init__(self, compiler: Callable = torch_compile):
        self.compiler = compiler
        self.graphs: dict[tuple, Callable] = {}
        self.seconds: dict[tuple, float] = {}
        self.broken: dict[str, str] = {}
        self.calls = 0
        self.warm_units: set = set()
        self._said: set[str] = set()
        self._scratch: dict = {}

    def __repr__(self) -> str:
        broken = "; ".join(f"{f} off: {why}" for f, why in self.broken.items())
        return (f"Session({len(self.graphs)} graphs, {self.calls} graph calls, "
                f"{len(self.warm_units)} warm units{'; ' + broken if broken else ''})")

    # -- graphs -----------------------------------------------------------------------------
    def run(self, family: str, key, build: Callable, args, *, label, log: logging.Logger,
            options: dict | None = None, dynamic_args=None):
        """``build()`` made into a graph once per (family, key) and called on ``args``, the
        leading dim of ``dynamic_args`` (default: all of ``args``) dynamic. The first call per
        graph is timed and logged. A failure turns ``family`` off for this session (its first
        line kept as the reason) and raises ``Unavailable``, as does any call once ``family``
        is off."""
        if family in self.broken:
            raise Unavailable(self.broken[family])
        k = (family, key)
        fn = self.graphs.get(k)
        if fn is None:
            fn = self.graphs[k] = self.compiler(_own_code(build()), dict(options or {}))
        mark_leading_dynamic(args if dynamic_args is None else dynamic_args)
        if k in self.seconds:
            out = fn(*args)
            self.calls += 1
            return out
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except Exception as e:  # whatever stops compiling, the batched path still works
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            self.broken[family] = f"{type(e).__name__}: {first}"[:300]
            log.warning("%s analysis unavailable, using the batched path: %s", family,
                        self.broken[family])
            raise Unavailable(self.broken[family]) from e
        self.seconds[k] = secs = time.perf_counter() - t0
        self.calls += 1
        log.info("%s analysis pass %s ready in %.1f s", family, label, secs)
        return out

    def broken_reason(self) -> str | None:
        """The first reason a family was turned off in this session (None: none was)."""
        return next(iter(self.broken.values()), None)

    # -- warm jobs --------------------------------------------------------------------------
    def note_job(self, units: frozenset, calls_before: int) -> bool:
        """Record ``units`` as warm after a fused call that started at ``calls == calls_before``:
        only if it called a graph (a fused call served wholly by the batched path compiled
        nothing, so its next call might) and no family is off. Returns whether they were."""
        if self.calls > calls_before and not self.broken:
            self.warm_units.update(units)
            return True
        return False

    def warm(self, units: frozenset) -> bool:
        """Whether every one of ``units`` was recorded by ``note_job``."""
        return bool(units) and units <= self.warm_units

    # -- what a caller hears once -----------------------------------------------------------
    def say(self, log: logging.Logger, text: str) -> None:
        """``text`` logged at INFO, once per session."""
        if text not in self._said:
            self._said.add(text)
            log.info(text)

    def scratch(self, key, rows: int, make: Callable[[int], tuple]) -> tuple:
        """Buffers a pass fills before it reads them, kept per ``key`` and grown as needed
        (fresh ones would cost a page fault per 4 KiB on every call): ``make(rows)``'s tensors,
        each with at least ``rows`` rows."""
        have = self._scratch.get(key)
        if have is None or have[0].shape[0] < rows:
            have = self._scratch[key] = make(rows)
        return have


def eager(fn: Callable, options: dict) -> Callable:
    """A compiler that compiles nothing: the graph function itself (tests: the same arithmetic
    without the compile's cost)."""
    return fn
