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
compile. ``WORKBENCH_ANALYSIS_PATH`` (auto/reference/batched/fused) overrides "auto" for a
process, e.g. to pin the reference while debugging; an explicit argument always wins. Like
torchao's ``KernelPreference``: one explicit choice, a logged default, no per-function guessing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

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


def choose_path(path: str, device: torch.device, elements: int, question: str) -> PathChoice:
    """The path for one table call of ``elements`` weight elements on ``device``; logged once
    per distinct (question, choice, reason)."""
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
        else:
            choice = PathChoice("batched", device, f"default on CPU below {COMPILE_ELEMENTS >> 20}M "
                                "elements: no compile")
    text = f"{question}: {choice.path} path on {device.type} ({choice.reason})"
    if text not in _LOGGED:
        _LOGGED.add(text)
        _log.info(text)
    return choice
