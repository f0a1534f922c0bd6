"""The batched and fused paths of the three table questions: many experts per op, as a plan says.

Records are grouped by what they are (stored codec, profile, shape) into stacks that
``checkpoint.stream.stream_stacks`` reads ahead and stages on the device, as the plan's
``ReadPlan`` says; here each stack is computed while the next ones are read. Per stack and
recipe the plan's route (``plans.Route``) gives the passes to try in order: a closed form
(``fused.py``: a stored grid re-quantized in its own format), the traced codecs
(``compiled.py``), the batched codecs and metric predicates (``batched.py``). A pass that cannot
serve a stack's values (non-finite weights, bytes outside a closed form's range) or whose
compile failed hands the stack to the next one, the reason said once per session. Only a few
numbers per expert leave the device.

Results are returned per record in record order, so the tables (rows and scale histograms) are
built exactly as the reference builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import replace

import torch

from workbench.checkpoint.stacks import Stack
from workbench.checkpoint.stream import Source, stream_stacks
from workbench.formats import QuantizedTensor, Recipe, dequantize

from . import batched, compiled, fused
from .fused_common import say
from .plans import CLOSED, COMPILED_PASS, QUESTIONS, AnalysisPlan, Job
from .session import Session

_MISMATCH = ("scale_mismatch_frac", "code_mismatch_frac")


def weights(stack: Stack) -> torch.Tensor:
    """BF16 ``[E, N, K]``: what ``view.materialize()`` gives for each member."""
    return stack.dense if stack.grid is None else batched.decode_stack(stack.grid)


def _base(rec, recipe: str) -> dict:
    return {"layer": rec.layer, "expert": rec.expert, "proj": rec.proj, "kind": rec.kind,
            "recipe": recipe}


def _row(rec, recipe: str, metrics: dict) -> dict:
    return {**_base(rec, recipe), **metrics, "numel": rec.shape[0] * rec.shape[1]}


def _hist(rec, recipe: str, pairs) -> list[dict]:
    base = _base(rec, recipe)
    return [{**base, "exponent": int(e), "count": int(c)} for e, c in pairs]


def _run(plan: AnalysisPlan, sources: list[Source], keys: list, per_batch: Callable,
         progress: bool, span_source: int = 0) -> list:
    """Per record, in record order: ``per_batch(positions, *stacks)``'s (rows, hist) for it."""
    results: dict[int, tuple] = {}
    with closing(stream_stacks(sources, keys, plan.reads, plan.device, span_source=span_source,
                               desc=QUESTIONS[plan.question], progress=progress)) as stacks:
        for batch, got in stacks:
            for i, res in zip(batch, per_batch(batch, *got)):
                results[i] = res
    return [results[i] for i in range(len(sources[0].recs))]


def _recipe_rows(w, recipe: Recipe, stored: QuantizedTensor | None) -> tuple[list, list]:
    """Rows' metrics and histograms of stack ``w`` quantized with ``recipe``; with the stored
    grid's mismatch columns when it has the same format and block layout."""
    q = batched.quantize_stack(w, recipe)
    ms = batched.stack_metrics(w, dequantize(q, torch.float32), q)
    if stored is not None and recipe.fmt == stored.fmt and q.scale.shape == stored.scale.shape:
        for m, mm in zip(ms, batched.stack_mismatch(stored, q)):
            m.update(mm)
    return ms, batched.stack_histograms(q)


def _compiled_recipe(session: Session, w, stored, recipe: Recipe, what: str,
                     compare: bool = True):
    """(metrics, histograms) of the stack from the compiled pass, or None (reason said)."""
    if "compiled" in session.broken:
        return None
    why = compiled.finite_reason(w, stored)
    if why is not None:
        compiled.say(session, what, why)
        return None
    rows = compiled.recipe_rows(session, w, stored, recipe, compare)
    if rows is None:
        return None
    return [r.metrics for r in rows], [r.hist for r in rows]


def _closed_form_all(session: Session, stack: Stack, recipe: Recipe):
    """(metrics, histograms) of every member from a closed form, or None when one member
    needs another pass (the stack then goes to the next pass whole)."""
    grids = stack.host_grids
    if "fused" in session.broken or len({g.profile for g in grids}) != 1 or \
            any(fused.grid_reason(g, recipe) is not None for g in grids):
        return None
    res = fused.stored_vs_recipe(session, grids, recipe)
    if res is None or any(x is None for x in res):
        return None
    return [x.metrics for x in res], [x.histogram() for x in res]


def candidate_results(plan: AnalysisPlan, session: Session, ck, j: Job, progress: bool):
    """Question 1: each weight (decoded if stored as a grid) under each recipe. On a grid the
    closed forms are question 3 without the mismatch columns; the compiled pass decodes the
    grid inside its graph."""
    what = "candidate recipes"

    def per_batch(batch, stack):
        recs = [j.items[i] for i in batch]
        stored = None if stack.grid is None else stack.grid.fmt
        w = None
        out = [([], []) for _ in recs]
        for r in j.recipes:
            passes = plan.passes(stored, str(r))
            got = None
            if CLOSED in passes:
                got = _closed_form_all(session, stack, r)
            if got is None and COMPILED_PASS in passes:
                got = _compiled_recipe(session, stack.dense, None, r, what) \
                    if stack.grid is None else \
                    _compiled_recipe(session, None, stack.grid, r, what)
            if got is not None:  # without the mismatch columns, as the reference
                ms = [{k: v for k, v in m.items() if k not in _MISMATCH} for m in got[0]]
                hs = got[1]
            else:
                w = weights(stack) if w is None else w
                ms, hs = _recipe_rows(w, r, None)
            for (rows, hist), rec, m, h in zip(out, recs, ms, hs):
                rows.append(_row(rec, str(r), m))
                hist.extend(_hist(rec, str(r), h))
        return out

    return _run(plan, [Source(ck, j.items, dense=True)], j.keys, per_batch, progress)


def reference_results(plan: AnalysisPlan, session: Session, ck, reference, j: Job,
                      label: Callable, progress: bool):
    """Question 2: the stored weights against the BF16 reference's, stack by stack. The
    reference (the larger side) is read in windows under the window reader, the stored grids of
    each window's stacks alongside."""
    what = "stored vs reference"

    def per_batch(batch, mine, ref):
        recs = [j.items[i] for i in batch]
        w = weights(ref)
        shape = mine.grid.shape if mine.grid is not None else tuple(mine.dense.shape)
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"{recs[0].key}: shape {tuple(shape[1:])} in {ck.path} but "
                             f"{tuple(w.shape[1:])} in the reference")
        ms = None
        if mine.grid is not None and COMPILED_PASS in plan.passes(mine.grid.fmt, None) and \
                "compiled" not in session.broken:
            why = compiled.finite_reason(w, mine.grid)
            if why is None:  # the stored grid is decoded inside the compiled pass
                ms = compiled.reference_rows(session, w, mine.grid)
            else:
                compiled.say(session, what, why)
        if ms is None:
            ms = batched.stack_metrics(w, weights(mine), mine.grid)
        hs = batched.stack_histograms(mine.grid) if mine.grid is not None else [[]] * len(recs)
        return [([_row(rec, label(rec), m)], _hist(rec, label(rec), h))
                for rec, m, h in zip(recs, ms, hs)]

    return _run(plan, [Source(ck, j.items), Source(reference, j.refs)], j.keys, per_batch,
                progress, span_source=1)


def stored_results(plan: AnalysisPlan, session: Session, ck, j: Job, progress: bool):
    """Question 3: each stored grid re-quantized with each recipe. Per recipe the members a
    closed form serves, then the compiled pass on the rest, then the batched codecs."""
    what = "stored grid vs recipes"

    def per_batch(batch, stack):
        recs = [j.items[i] for i in batch]
        stored = stack.grid
        if stored is None:  # stored dense: no grid to compare with (as the reference)
            return [([], []) for _ in recs]
        out = [([], []) for _ in recs]
        w = None
        for r in j.recipes:
            passes = plan.passes(stored.fmt, str(r))
            ms, hs = [None] * len(recs), [None] * len(recs)
            picked = _closed_members(session, stack.host_grids, r) \
                if CLOSED in passes and "fused" not in session.broken else []
            res = fused.stored_vs_recipe(session, [stack.host_grids[i] for i in picked], r) \
                if picked else None
            if res is None:
                picked = []
            for i, x in zip(picked, res or ()):
                if x is not None:  # None: refused after reading (reason said), see below
                    ms[i], hs[i] = x.metrics, x.histogram()
            rest = [i for i in range(len(recs)) if ms[i] is None]
            if rest and COMPILED_PASS in passes:
                sub = stored if len(rest) == len(recs) else \
                    _take(stored, torch.tensor(rest, device=stored.data.device))
                got = _compiled_recipe(session, None, sub, r, what)
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

    # grids only: weights stored dense are not read
    return _run(plan, [Source(ck, j.items, dense=False)], j.keys, per_batch, progress)


def _closed_members(session: Session, grids: list[QuantizedTensor], recipe: Recipe
                    ) -> list[int]:
    """Positions of the host grids a closed form can take (the others' reasons said)."""
    ok = []
    for i, g in enumerate(grids):
        why = fused.grid_reason(g, recipe)
        if why is None:
            ok.append(i)
        else:
            say(session, str(recipe), why)
    return ok


def _take(q: QuantizedTensor, idx: torch.Tensor) -> QuantizedTensor:
    """Members ``idx`` of a stacked grid."""
    def sel(t):
        return None if t is None else t[idx]

    return replace(q, data=q.data[idx], scale=q.scale[idx], global_scale=sel(q.global_scale),
                   library_global=sel(q.library_global), shape=(len(idx), *q.shape[1:]))
