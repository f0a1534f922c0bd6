"""Which path computes an analysis table, and why: a plan a caller can build, print and pass.

``plan(question, ck, recipes_or_reference, ...)`` returns an ``AnalysisPlan``, immutable: the
path (``reference``, ``batched`` or ``fused``), the stack reader and how stacks are read
(``checkpoint.stacks.ReadPlan``), and per (stored format, recipe) the passes a stack tries in
order (``Route``), each choice with its reason. Every table function takes ``plan=``; without
one it builds the plan itself from its arguments (``path="auto"`` by default) and logs it. The
plan that ran comes back on the tables (``ErrorTables.plan``).

The paths:
- ``reference``: ``tables.py`` + ``metrics.py``, one weight at a time. The spec.
- ``batched``: ``fast.py`` + ``batched.py``: same-shape weights stacked ``[E, N, K]`` and run
  through the same codecs and metric predicates, many experts per op, on the device the
  tables are computed on (CUDA when present).
- ``fused``: ``batched``, plus the compiled CPU passes where the routes say: the closed forms
  (``fused.py``, ``fused_fp8.py``, ``fused_nvfp4.py``: a stored grid under a recipe of its own
  format) and the traced codecs of ``compiled.py`` (the other pairs where they measured faster,
  ``compiled.FASTER``; every pair with ``compiled="all"``). A stack whose values a pass cannot
  serve (NaN scales, bytes outside a closed form's range) falls to the next pass, the reason
  said once per session.

What "auto" decides: ``batched`` on CUDA; on CPU ``fused`` for jobs of at least
``COMPILE_ELEMENTS`` elements (a first compile costs seconds, which a large job repays) and
``batched`` below, unless the caller's ``Session`` has run this job's graphs already (every unit
of ``job_units`` recorded by an earlier fused call: nothing left to compile, so ``fused`` at any
size) and no compile has failed in it. The reader: ``window`` on CUDA, ``safetensors`` on CPU
(see ``READER_WHY``); a checkpoint whose shards are not all local files (``ck.is_local``, a
remote folder read by byte ranges) takes ``preadv`` for "auto" and "window": its ranged reads
run in parallel, where a window would fetch the bytes between the tensors asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

import torch

from workbench.checkpoint.layouts import FMT_OF_CODEC
from workbench.checkpoint.select import as_selection
from workbench.checkpoint.stacks import READERS, ReadPlan, plan_batches, signature
from workbench.formats import Recipe, parse_recipe

from . import fused
from .compiled import FASTER, recipe_reason
from .session import Session

PATHS = ("auto", "reference", "batched", "fused")
COMPILED = ("measured", "all")
QUESTIONS = MappingProxyType({"candidate_errors": "candidate recipes",
                              "reference_errors": "stored vs reference",
                              "stored_vs_recipes": "stored grid vs recipes"})
KINDS = ("routed", "shared", "dense")
COMPILE_ELEMENTS = 1 << 28
CPU_BATCH_ELEMENTS = 1 << 21  # 2M elements (4 MB BF16, ~1.3 Qwen3 experts): the codecs keep
# ~10 fp32-sized temporaries alive, so this bounds memory; on CPU larger stacks buy nothing
CUDA_BATCH_ELEMENTS = 1 << 28  # 256M elements: a whole layer's experts per launch on a GPU
CUDA_WINDOW_BYTES = 512 << 20  # the window reader's span: ~1.5 Qwen3-30B-A3B MXFP4 layers
CPU_WINDOW_BYTES = 16 << 20  # on CPU (only when asked for): bounds memory as the stacks do
# What measured better per device (docs/benchmarks.md has the runs): on a GPU host the window
# reader reads close to the plain read with half the host CPU of preadv; on a 2-core CPU host
# the math sets the pace, no reader measured faster throughout, and the older reader holds the
# least memory.
READER_WHY = MappingProxyType({
    "cuda": "auto on cuda: each shard read front to back in large spans",
    "cpu": "auto on cpu: the math sets the pace there; the least memory"})
REMOTE_WHY = ("shards not all local: ranged reads in parallel (a window would fetch the bytes "
              "between the tensors asked for)")
CLOSED, COMPILED_PASS, BATCHED = "closed form", "compiled", "batched"


@dataclass(frozen=True)
class Route:
    """How the stacks of one (stored format, recipe) pair are computed: ``passes`` tried in
    order per stack (``closed form``, ``compiled``, ``batched``), and why the others are not.
    ``stored`` is None for weights with no grid (BF16, or a codec read dense); ``recipe`` None
    for question 2. No passes: nothing to compute (question 3 on weights stored dense)."""

    stored: str | None
    recipe: str | None
    passes: tuple[str, ...]
    why: str = ""

    def __str__(self) -> str:
        what = (f"{self.stored} grids" if self.stored else "dense weights") + \
            ("" if self.recipe is None else f" -> {self.recipe}")
        how = ", then ".join(self.passes) if self.passes else "no rows"
        return f"{what}: {how}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class AnalysisPlan:
    """One table call's choices and their reasons (see the module docstring). Build it with
    ``plan``; ``str(plan)`` prints it; pass it as ``plan=`` to the table function of its
    question, on the checkpoint it was made for."""

    question: str  # a key of QUESTIONS: the table function's name
    device: torch.device
    path: str  # reference | batched | fused
    why: str
    reads: ReadPlan | None  # None on the reference path
    reader_why: str
    routes: tuple[Route, ...]
    recipes: tuple[str, ...]
    weights: int
    elements: int  # weight elements x recipes: what the size threshold compares
    units: frozenset  # job_units: what a session records after a fused call
    compiled: str = "measured"
    workers: int | None = None  # the reference path's threads (None: its default)

    def __post_init__(self):
        if self.question not in QUESTIONS:
            raise ValueError(f"question must be one of {', '.join(QUESTIONS)}, got "
                             f"{self.question!r}")
        if self.path not in PATHS[1:]:
            raise ValueError(f"a plan's path is one of {', '.join(PATHS[1:])}, got {self.path!r}")
        if self.compiled not in COMPILED:
            raise ValueError(f"compiled must be one of {', '.join(COMPILED)}, got "
                             f"{self.compiled!r}")
        if (self.reads is None) != (self.path == "reference"):
            raise ValueError("the batched and fused paths need reads (a ReadPlan), the "
                             "reference path none")

    def passes(self, stored: str | None, recipe: str | None) -> tuple[str, ...]:
        """The passes a stack of ``stored`` grids (None: no grid) tries under ``recipe``."""
        for r in self.routes:
            if (r.stored, r.recipe) == (stored, recipe):
                return r.passes
        raise KeyError(f"the plan has no route for {stored or 'dense'} -> {recipe}: it was "
                       "made for another job")

    def summary(self) -> str:
        """The first line: what runs and why."""
        return f"{QUESTIONS[self.question]}: {self.path} path on {self.device.type} ({self.why})"

    def __str__(self) -> str:
        lines = [self.summary()]
        n = f"{self.weights} weights, {self.elements:,} elements" + (
            f" ({len(self.recipes)} recipe{'s' * (len(self.recipes) != 1)})"
            if self.recipes else "")
        if self.reads is None:
            lines.append(f"  {n}; one weight at a time")
        else:
            r = self.reads
            lines.append(f"  {n}; {r.reader} reader ({self.reader_why}): stacks of at most "
                         f"{r.batch_elements / 2**20:g}M elements, {r.ahead} read ahead on "
                         f"{r.workers} threads" + (f", {r.window_bytes >> 20} MiB windows"
                                                   if r.reader == "window" else ""))
            lines += [f"  {route}" for route in self.routes]
        return "\n".join(lines)


# -- what a call works on ----------------------------------------------------------------------


def records(ck, kinds: Iterable[str], select=None) -> list:
    """The records a question covers: of ``kinds``, kept by ``select`` (a
    ``workbench.checkpoint.select.Selection``; None: all), which must keep something."""
    kinds, sel = tuple(kinds), as_selection(select)
    recs = [r for r in ck.expert_records() if r.kind in kinds]
    sel.check(recs, str(ck.path))
    return sel.filter(recs)


def reference_records(ck, reference, items: list) -> list:
    """The records of ``reference`` matching ``items`` (by kind, layer, expert, proj); a
    ValueError naming the reference and the first weights it lacks."""
    # the reference's keys once: a lookup per record by itself scans the records
    have = {(x.kind, x.layer, x.expert, x.proj): x for x in reference.expert_records()}
    missing = [r.key for r in items if (r.kind, r.layer, r.expert, r.proj) not in have]
    if missing:
        raise ValueError(f"reference checkpoint {reference.path} lacks {len(missing)} weights of "
                         f"{ck.path}, e.g. {missing[:3]}")
    return [have[(r.kind, r.layer, r.expert, r.proj)] for r in items]


@dataclass(frozen=True)
class Job:
    """A table call's work: the records (and question 2's matching reference records), the
    parsed recipes, each record's stacking key and stored format."""

    question: str
    items: list
    refs: list | None
    recipes: tuple[Recipe, ...]
    keys: list
    stored: list  # per item: the stored grid's format, None for weights with no grid

    @property
    def sizes(self) -> list[int]:
        return [r.shape[0] * r.shape[1] for r in self.items]

    @property
    def elements(self) -> int:
        return sum(self.sizes) * max(1, len(self.recipes))


def job(question: str, ck, other, kinds: Iterable[str] = KINDS, select=None) -> Job:
    """The work of ``question`` on ``ck``; ``other``: the recipes (questions 1 and 3) or the
    BF16 reference checkpoint (question 2); ``select``: the layers / experts kept."""
    if question not in QUESTIONS:
        raise ValueError(f"question must be one of {', '.join(QUESTIONS)}, got {question!r}")
    items = records(ck, kinds, select)
    refs, recipes = None, ()
    keys = [signature(ck, r) for r in items]
    if question == "reference_errors":
        refs = reference_records(ck, other, items)
        keys = [(*k, signature(other, q)) for k, q in zip(keys, refs)]
    else:
        recipes = tuple(parse_recipe(r) for r in other)
    stored = [FMT_OF_CODEC.get(ck.spec(r.name).codec) for r in items]
    return Job(question, items, refs, recipes, keys, stored)


def job_units(question: str, device: torch.device, signatures: list, sizes: list[int],
              recipes=()) -> frozenset:
    """What a session knows a job by, as the graphs its fused call compiles are keyed:
    (question, device type, stored codec + profile + shape, whether it comes as a stack of one
    expert, recipe) per stack and recipe. The stack of one counts because dynamo specialises a
    dim of size 1: a graph first called on one expert is compiled again for two.
    ``signatures``: per weight, what the paths stack it by (for question 2 paired with its
    reference's); stacks as ``plan_batches`` forms them with the device's default stack size
    (a plan with other reads, or the window reader, forms its own, so there a warm job may
    still meet a new stack size)."""
    stacks = plan_batches(signatures, sizes, _default_batch(device))
    kinds = {(signatures[b[0]], len(b) == 1) for b in stacks}
    return frozenset((question, device.type, sig, single, None if r is None else str(r))
                     for sig, single in kinds for r in (list(recipes) or [None]))


def _default_batch(device: torch.device) -> int:
    return CUDA_BATCH_ELEMENTS if device.type == "cuda" else CPU_BATCH_ELEMENTS


def read_plan(device: torch.device, reader: str = "auto", workers: int | None = None,
              local: bool = True) -> tuple[ReadPlan, str]:
    """(the reads on ``device`` with ``reader``, "auto" resolved per device; why that reader).
    Shards that are not all local (``local`` False) are read with ``preadv``."""
    if reader not in ("auto", *READERS):
        raise ValueError(f"reader must be one of auto, {', '.join(READERS)}, got {reader!r}")
    cuda = device.type == "cuda"
    why = "asked for"
    if not local and reader in ("auto", "window"):
        reader, why = "preadv", REMOTE_WHY
    elif reader == "auto":
        reader, why = ("window" if cuda else "safetensors"), READER_WHY["cuda" if cuda else "cpu"]
    cpus = os.cpu_count() or 2
    if cuda:
        return ReadPlan(reader, CUDA_BATCH_ELEMENTS, workers or max(2, min(8, cpus)), 2,
                        CUDA_WINDOW_BYTES), why
    return ReadPlan(reader, CPU_BATCH_ELEMENTS, workers or max(1, min(2, cpus)), 2,
                    CPU_WINDOW_BYTES), why


# -- the decisions -------------------------------------------------------------------------------


def _path(path: str, device: torch.device, elements: int, units: frozenset, session: Session
          ) -> tuple[str, str]:
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
    if path != "auto":
        return path, "asked for"
    if device.type == "cuda":
        return "batched", "default on CUDA: expert stacks per launch"
    if elements >= COMPILE_ELEMENTS:
        return "fused", (f"default on CPU for {elements / 1e6:.0f}M elements: the compile "
                         "pays for itself")
    below = f"default on CPU below {COMPILE_ELEMENTS >> 20}M elements"
    if session.warm(units):
        why = session.broken_reason()
        if why is None:
            return "fused", f"{below} in a warm session: its fused calls compiled this job's graphs"
        return "batched", f"{below}: compiling failed earlier in this session ({why})"
    return "batched", f"{below}: no compile"


def _route(question: str, stored: str | None, recipe: Recipe | None, device: torch.device,
           session: Session, mode: str, path: str) -> Route:
    """The passes of one (stored format, recipe) pair on ``path`` (batched or fused)."""
    name = None if recipe is None else str(recipe)
    if question == "stored_vs_recipes" and stored is None:
        return Route(None, name, (), "stored dense: no grid to compare with")
    if path == "batched":
        return Route(stored, name, (BATCHED,))
    if device.type != "cpu":
        return Route(stored, name, (BATCHED,), f"{device.type} tensors: the batched path "
                     "runs there")
    passes, why = [], []
    if recipe is not None and stored is not None:  # a closed form: a grid in its own format
        bad = fused.static_reason(recipe, device)
        if bad is None and recipe.fmt != stored:
            bad = f"a {stored} grid under a {recipe.fmt} recipe"
        if bad is None and "fused" in session.broken:
            bad = f"compiling failed earlier in this session ({session.broken['fused']})"
        if bad is None:
            passes.append(CLOSED)
        elif recipe.fmt == stored:  # the closed form's own pair: say why not
            why.append(f"no closed form: {bad}")
    if question != "reference_errors" or stored is not None:
        kind = "reference" if recipe is None else "recipe"
        bad = None if recipe is None else recipe_reason(recipe)
        if bad is None and mode == "measured" and \
                (kind, stored, None if recipe is None else recipe.fmt) not in FASTER:
            bad = "measured faster batched (compiled.FASTER)"
        if bad is None and "compiled" in session.broken:
            bad = f"compiling failed earlier in this session ({session.broken['compiled']})"
        if bad is None:
            passes.append(COMPILED_PASS)
        else:
            why.append(f"not compiled: {bad}")
    return Route(stored, name, (*passes, BATCHED), "; ".join(why))


def plan(question: str, ck, other, *, kinds: Iterable[str] = KINDS, select=None,
         device: str | None = None, path: str = "auto", reader: str = "auto",
         workers: int | None = None, compiled: str = "measured",
         session: Session | None = None) -> AnalysisPlan:
    """The plan of table function ``question`` ("candidate_errors", "reference_errors",
    "stored_vs_recipes") on ``ck`` with ``other`` (the recipes, or question 2's BF16 reference
    checkpoint), over the layers / experts ``select`` keeps (a ``Selection``; None: all).
    ``path``: auto | reference | batched | fused; ``reader``: auto | window |
    preadv | safetensors; ``compiled``: "measured" (the traced codecs only where they measured
    faster) or "all"; ``session``: whose compiled graphs "auto" may count on (None: a fresh
    one's view, as a new process). ``device``: default CUDA when present."""
    return plan_job(job(question, ck, other, kinds, select), ck, other, device=device, path=path,
                    reader=reader, workers=workers, compiled=compiled, session=session)


def plan_job(j: Job, ck, other, *, device: str | torch.device | None = None,
             path: str = "auto", reader: str = "auto", workers: int | None = None,
             compiled: str = "measured", session: Session | None = None) -> AnalysisPlan:
    """``plan`` for a ``job`` already made (the table functions make it once)."""
    dev = torch.device(device) if device is not None else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    session = Session() if session is None else session
    local = ck.is_local and (j.question != "reference_errors" or other.is_local)
    reads, reader_why = read_plan(dev, reader, workers, local)
    units = job_units(j.question, dev, j.keys, j.sizes, j.recipes)
    chosen, why = _path(path, dev, j.elements, units, session)
    pairs = list(dict.fromkeys((s, r) for s in j.stored for r in (j.recipes or (None,))))
    if chosen == "reference":
        routes: tuple[Route, ...] = ()
        reads, reader_why = None, ""
    else:
        routes = tuple(_route(j.question, s, r, dev, session, compiled, chosen)
                       for s, r in pairs)
    return AnalysisPlan(j.question, dev, chosen, why, reads, reader_why, routes,
                        tuple(str(r) for r in j.recipes), len(j.items), j.elements, units,
                        compiled, workers)


def check(p: AnalysisPlan, j: Job) -> None:
    """A plan passed to a table call must be the plan of that call's job: its question, its
    recipes, as many weights and elements, the same units (else a ValueError saying what
    differs). A plan made for a checkpoint of the same structure is a plan for this one."""
    if p.question != j.question:
        raise ValueError(f"the plan is for {p.question}, not {j.question}")
    recipes = tuple(str(r) for r in j.recipes)
    if p.recipes != recipes:
        raise ValueError(f"the plan is for recipes {list(p.recipes)}, not {list(recipes)}")
    if (p.weights, p.elements) != (len(j.items), j.elements) or \
            p.units != job_units(j.question, p.device, j.keys, j.sizes, j.recipes):
        raise ValueError("the plan was made for other weights (another checkpoint or kinds): "
                         "make it with analysis.plan for this call")
