"""Which path computes the analysis tables: decided here, once per call, and logged.

- ``reference``: ``tables.py`` + ``metrics.py``, one weight at a time. The spec.
- ``batched``: ``fast.py`` + ``batched.py``: same-shape weights stacked ``[E, N, K]`` and run
  through the same codecs and the same metric predicates, many experts per op; on the device the
  tables are computed on (CUDA when present: reads into pinned buffers, async copies).
- ``fused``: ``batched``, plus the compiled CPU passes where they apply: the closed forms of
  ``fused.py`` (a stored MXFP4, MXFP8 or NVFP4 grid under a recipe of its own format) and
  ``compiled.py`` (every other format pair and question).

``path="auto"`` (the default of every table function, hence of the notebook and
``workbench inspect``) takes ``batched`` on CUDA, and on CPU ``fused`` for jobs of at least
``COMPILE_ELEMENTS`` elements (a first compile costs seconds: 3 s of imports, 4 s from a warm
Inductor disk cache, ~20 s cold, measured on 2 cores) and ``batched`` below, which needs no
compile, unless this process has compiled that job's graphs already: a job whose every unit
(``job_units``: question, stored codec, profile and shape, stacks of one or more, recipe) was
part of a fused call here that ran compiled graphs and turned no family off
(``graphs.note_fused_job``, recorded by ``run``) takes ``fused`` at any size, since it compiles
nothing (MXFP8 grids under an MXFP8 recipe, 151M elements on 2 cores, 2026-12-03: 0.5 s fused
against 5.5 s batched). So a notebook that ran a large job, or asked for ``fused`` once, has
later smaller jobs of the same units fused. A process whose first call was a small "auto" one
compiled nothing and stays batched (the benchmark's second call). Once a compile has failed in
the process (``fused._BROKEN``, ``compiled._BROKEN``) that rule is off and small jobs stay
batched. ``WORKBENCH_ANALYSIS_PATH`` (auto/reference/batched/fused) overrides "auto" for a
process, e.g. to pin the reference while debugging; an explicit argument always wins. Like
torchao's ``KernelPreference``: one explicit choice, a logged default, no per-function guessing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import compiled, fast, fused, graphs

_log = logging.getLogger(__name__)
PATHS = ("auto", "reference", "batched", "fused")
ENV = "WORKBENCH_ANALYSIS_PATH"
COMPILE_ELEMENTS = 1 << 28
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class PathChoice:
    path: str  # reference | batched | fused
    device: torch.device
    reason: str
    job: frozenset | None = None  # job_units of the call, for the warm-process record (run)


def job_units(question: str, device: torch.device, signatures: list, sizes: list[int],
              recipes=()) -> frozenset:
    """What a warm process knows a table call by, as the graphs its fused call compiles are
    keyed: (question, device type, stored codec + profile + shape, whether it comes as a stack
    of one expert, recipe) per stack and recipe. The stack of one counts because dynamo
    specialises a dim of size 1: a graph first called on one expert is compiled again for two.
    ``signatures``: per weight, what the paths stack it by (``fast._signature``; for question 2
    paired with its reference's); stacks as ``fast.plan_batches`` forms them on ``device`` (the
    opt-in window reader forms its own, so there a warm job may still meet a new stack size)."""
    stacks = fast.plan_batches(signatures, sizes, fast.Plan.default(device).batch_elements)
    kinds = {(signatures[b[0]], len(b) == 1) for b in stacks}
    return frozenset((question, device.type, sig, single, None if r is None else str(r))
                     for sig, single in kinds for r in (list(recipes) or [None]))


def broken_reason() -> str | None:
    """The first reason a compiled family was turned off in this process (None: none was)."""
    for family in (fused._BROKEN, compiled._BROKEN):
        if family:
            return family[0]
    return None


def run(choice: PathChoice, work: Callable):
    """``work()``, the table call on ``choice``'s path; after a fused call on CPU its job is
    recorded as warm when it ran compiled graphs and no family was turned off
    (``graphs.note_fused_job``)."""
    before = graphs.GRAPH_CALLS[0]
    out = work()
    if choice.path == "fused" and choice.device.type == "cpu" and choice.job is not None:
        graphs.note_fused_job(choice.job, before, broken_reason())
    return out


def choose_path(path: str, device: torch.device, elements: int, question: str,
                job: frozenset | None = None) -> PathChoice:
    """The path for one table call of ``elements`` weight elements on ``device``; logged once
    per distinct (question, choice, reason). ``job`` (``job_units``): lets "auto" take ``fused``
    below ``COMPILE_ELEMENTS`` when fused calls here have run every unit of it."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path != "auto":
        choice = PathChoice(path, device, "asked for")
    else:
        env = os.environ.get(ENV, "auto")
        if env not in PATHS:
            raise ValueError(f"{ENV} must be one of {', '.join(PATHS)}, got {env!r}")
        if env != "auto":
            choice = PathChoice(env, device, f"{ENV}={env}")
        elif device.type == "cuda":
            choice = PathChoice("batched", device, "default on CUDA: expert stacks per launch")
        elif elements >= COMPILE_ELEMENTS:
            choice = PathChoice("fused", device, f"default on CPU for {elements / 1e6:.0f}M "
                                "elements: the compile pays for itself")
        elif job is not None and graphs.warm(job):
            why = broken_reason()
            choice = PathChoice("fused", device, f"default on CPU below {COMPILE_ELEMENTS >> 20}M "
                                "elements in a warm process: fused calls here compiled this "
                                "job's graphs") if why is None else \
                PathChoice("batched", device, f"default on CPU below {COMPILE_ELEMENTS >> 20}M "
                           f"elements: compiling failed earlier in this process ({why})")
        else:
            choice = PathChoice("batched", device, f"default on CPU below {COMPILE_ELEMENTS >> 20}M "
                                "elements: no compile")
    if job is not None:
        choice = replace(choice, job=job)
    text = f"{question}: {choice.path} path on {device.type} ({choice.reason})"
    if text not in _LOGGED:
        _LOGGED.add(text)
        _log.info(text)
    return choice
