"""Per-expert error tables from a checkpoint: one tidy DataFrame per question.

1. ``candidate_errors(ck, recipes)``: a BF16 (or any) checkpoint under candidate recipes.
2. ``reference_errors(ck, reference)``: a packed checkpoint against a BF16 reference checkpoint.
3. ``stored_vs_recipes(ck, recipes)``: the stored grid against re-quantizing its decoded weights.

Each returns ``ErrorTables(experts, scales, plan)``: ``experts`` has one row per layer x expert x
projection x recipe with ``kind`` in routed/shared/dense (never mixed), ``scales`` the long
scale-exponent histogram, ``plan`` the ``plans.AnalysisPlan`` that ran. ``nonfinite`` counts the
NaN/Inf values among a row's inputs (the weights as stored, decoded, and the reference's): a row
whose sums met one has NaN metrics, and is then re-read and counted here, on every path alike.
``select`` (a ``workbench.checkpoint.select.Selection``) restricts a question to some layers /
experts: only their bytes are read. Each function takes ``plan`` (from ``plans.plan``), or builds
one from ``path`` ("auto" by default), ``device`` and ``workers``, and logs it; ``session`` (a
``Session``) carries compiled graphs from call to call.
This module is the reference path, which streams one weight at a time through a small thread
pool (torch kernels release the GIL, so I/O of the next weights overlaps the math of this one);
at most ``inflight`` weights are alive. The batched and fused paths are ``fast.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench._io import atomic_open
from workbench.checkpoint.grid import stored_grid
from workbench.formats import Recipe, dequantize, parse_recipe, quantize

from . import fast, plans
from .metrics import (
    count_nonfinite,
    error_metrics,
    grid_mismatch,
    nonfinite_rows,
    scale_exponents,
)
from .plans import AnalysisPlan
from .session import Session

_log = logging.getLogger(__name__)

KEY_COLS = ["layer", "expert", "proj", "kind", "recipe"]


def _pd():
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("workbench.analysis needs pandas: pip install 'workbench[analysis]'") from e
    return pd


@dataclass
class ErrorTables:
    experts: object  # pandas.DataFrame
    scales: object  # pandas.DataFrame: layer, expert, proj, kind, recipe, exponent, count
    plan: AnalysisPlan | None = None  # the plan that computed them (None: loaded from disk)

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``experts.csv`` and ``scales.csv`` (and parquet copies when pyarrow is present)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for name, df in (("experts", self.experts), ("scales", self.scales)):
            with atomic_open(out / f"{name}.csv") as f:
                df.to_csv(f, index=False)
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike) -> ErrorTables:
        pd = _pd()
        folder = Path(folder)
        return cls(pd.read_csv(folder / "experts.csv"), pd.read_csv(folder / "scales.csv"))


def _quantize_2d(w: torch.Tensor, recipe: Recipe):
    # one expert projection is one tensor: NVFP4's per-tensor scale is per expert
    return quantize(w, recipe, pad=True)


def _stream(items: list, work: Callable, desc: str, workers: int | None, inflight: int,
            progress: bool) -> Iterable:
    """``work(item)`` for each item on a thread pool, results in order; at most ``inflight`` alive."""
    from tqdm.auto import tqdm

    workers = workers or max(1, min(4, os.cpu_count() or 1))
    bar = tqdm(total=len(items), desc=desc, unit="weight", disable=not progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending = []
        for pos, item in enumerate(items):
            pending.append(pool.submit(work, item))
            last = pos == len(items) - 1
            while pending and (len(pending) >= inflight or last):
                yield pending.pop(0).result()
                bar.update()
    bar.close()


def _rows(rec, recipe: str, metrics: dict, q) -> tuple[dict, list[dict]]:
    base = {"layer": rec.layer, "expert": rec.expert, "proj": rec.proj, "kind": rec.kind,
            "recipe": recipe}
    row = {**base, **metrics, "numel": rec.shape[0] * rec.shape[1]}
    hist = []
    if q is not None:
        exps, counts = torch.unique(scale_exponents(q).flatten(), return_counts=True)
        hist = [{**base, "exponent": int(e), "count": int(c)} for e, c in zip(exps, counts)]
    return row, hist


def _collect(results, pd, plan: AnalysisPlan) -> ErrorTables:
    rows, hist = [], []
    for r, h in results:
        rows.extend(r)
        hist.extend(h)
    experts = pd.DataFrame(rows)
    if not experts.empty:
        experts = experts.sort_values(KEY_COLS, kind="stable").reset_index(drop=True)
    scales = pd.DataFrame(hist, columns=[*KEY_COLS, "exponent", "count"])
    return ErrorTables(experts, scales, plan)


def _with_nonfinite(t: ErrorTables, items, count: Callable) -> ErrorTables:
    """Add ``nonfinite``: ``count(record)`` for each weight whose rows met a NaN or Inf
    (``metrics.nonfinite_rows``, the same on every path), 0 for the others."""
    df = t.experts
    df["nonfinite"] = 0
    if df.empty:
        return t
    by_key = {(r.layer, r.expert, r.proj, r.kind): r for r in items}
    flagged = df.loc[nonfinite_rows(df), ["layer", "expert", "proj", "kind"]].drop_duplicates()
    for k in flagged.itertuples(index=False):
        sel = (df.layer == k.layer) & (df.expert == k.expert) & (df.proj == k.proj) & \
            (df.kind == k.kind)
        df.loc[sel, "nonfinite"] = count(by_key[(k.layer, k.expert, k.proj, k.kind)])
    return t


def _plan(question: str, ck, other, kinds, select, plan: AnalysisPlan | None, session: Session,
          *, path: str, device: str | None, workers: int | None):
    """(the job, the plan it runs with): ``plan`` checked against the job, or one built from
    the arguments; logged once per session."""
    j = plans.job(question, ck, other, kinds, select)
    if plan is None:
        plan = plans.plan_job(j, ck, other, device=device, path=path, workers=workers,
                              session=session)
    elif path != "auto" or device is not None or workers is not None:
        raise ValueError("pass either plan= or path/device/workers, not both: the plan holds "
                         "them")
    else:
        plans.check(plan, j)
    session.say(_log, str(plan))
    return j, plan


def _fast(plan: AnalysisPlan, session: Session, work: Callable):
    """``work()``, a batched or fused table call; after a fused one on CPU that ran graphs its
    job's units are recorded as warm in ``session``."""
    before = session.calls
    out = work()
    if plan.path == "fused" and plan.device.type == "cpu":
        session.note_job(plan.units, before)
    return out


def candidate_errors(ck, recipes: Iterable[str | Recipe], *, kinds=("routed", "shared", "dense"),
                     device: str | None = None, workers: int | None = None, inflight: int = 4,
                     progress: bool = True, path: str = "auto", select=None,
                     plan: AnalysisPlan | None = None,
                     session: Session | None = None) -> ErrorTables:
    """Question 1: each weight (decoded to BF16 if stored packed) under each candidate recipe.

    ``path`` picks reference / batched / fused ("auto": see ``plans``), or ``plan`` says all;
    every path gives the reference's table (float sums to summation order). ``select`` (a
    ``Selection``) restricts the question to some layers / experts."""
    pd = _pd()
    session = Session() if session is None else session
    j, plan = _plan("candidate_errors", ck, list(recipes), kinds, select, plan, session,
                    path=path, device=device, workers=workers)
    recs, dev, items = j.recipes, plan.device, j.items

    def count(rec):
        return count_nonfinite(ck.view_of(rec).materialize())

    if plan.path != "reference":
        return _with_nonfinite(_collect(_fast(plan, session, lambda: fast.candidate_results(
            plan, session, ck, j, progress)), pd, plan), items, count)

    def work(rec):
        w = ck.view_of(rec).materialize().to(dev)
        rows, hist = [], []
        for r in recs:
            q = _quantize_2d(w, r)
            row, h = _rows(rec, str(r), error_metrics(w, dequantize(q, torch.float32), q), q)
            rows.append(row)
            hist.extend(h)
        return rows, hist

    return _with_nonfinite(_collect(_stream(items, work, "candidate recipes", plan.workers,
                                            inflight, progress), pd, plan), items, count)


def _stored_label(ck, rec) -> str:
    r = ck.recipe_of(rec.name)
    return f"stored:{r}" if r is not None else "stored:bf16"


def reference_errors(ck, reference, *, kinds=("routed", "shared", "dense"),
                     device: str | None = None, workers: int | None = None, inflight: int = 4,
                     progress: bool = True, path: str = "auto", select=None,
                     plan: AnalysisPlan | None = None,
                     session: Session | None = None) -> ErrorTables:
    """Question 2: the checkpoint's stored weights against the same weights in ``reference``.

    Records are matched by (kind, layer, expert, proj), so the two may use different layouts.
    """
    pd = _pd()
    session = Session() if session is None else session
    j, plan = _plan("reference_errors", ck, reference, kinds, select, plan, session, path=path,
                    device=device, workers=workers)
    dev, items = plan.device, j.items
    refs = dict(zip((r.key for r in items), j.refs))

    def count(rec):
        return count_nonfinite(ck.view_of(rec).materialize(),
                               reference.view_of(refs[rec.key]).materialize())

    if plan.path != "reference":
        return _with_nonfinite(_collect(_fast(plan, session, lambda: fast.reference_results(
            plan, session, ck, reference, j, lambda rec: _stored_label(ck, rec), progress)),
            pd, plan), items, count)

    def work(rec):
        w = reference.view_of(refs[rec.key]).materialize().to(dev)
        deq = ck.view_of(rec).materialize().to(dev)
        if w.shape != deq.shape:
            raise ValueError(f"{rec.key}: shape {tuple(deq.shape)} in {ck.path} but "
                             f"{tuple(w.shape)} in the reference")
        q = stored_grid(ck, rec)
        q = None if q is None else _to(q, dev)
        row, h = _rows(rec, _stored_label(ck, rec), error_metrics(w, deq, q), q)
        return [row], h

    return _with_nonfinite(_collect(_stream(items, work, "stored vs reference", plan.workers,
                                            inflight, progress), pd, plan), items, count)


def stored_vs_recipes(ck, recipes: Iterable[str | Recipe], *, kinds=("routed", "shared", "dense"),
                      device: str | None = None, workers: int | None = None, inflight: int = 4,
                      progress: bool = True, path: str = "auto", select=None,
                      plan: AnalysisPlan | None = None,
                      session: Session | None = None) -> ErrorTables:
    """Question 3: re-quantize each stored packed weight's decoded values with each recipe.

    Rows carry the error of the re-quantized weights against the decoded stored weights (zero
    when the recipe reproduces the stored grid) plus ``scale_mismatch_frac`` and
    ``code_mismatch_frac`` against the stored grid. Dense-stored weights are skipped.
    """
    pd = _pd()
    session = Session() if session is None else session
    j, plan = _plan("stored_vs_recipes", ck, list(recipes), kinds, select, plan, session,
                    path=path, device=device, workers=workers)
    recs, dev, items = j.recipes, plan.device, j.items

    def count(rec):
        return count_nonfinite(ck.view_of(rec).materialize())

    if plan.path != "reference":
        return _with_nonfinite(_collect(_fast(plan, session, lambda: fast.stored_results(
            plan, session, ck, j, progress)), pd, plan), items, count)

    def work(rec):
        stored = stored_grid(ck, rec)
        if stored is None:
            return [], []
        stored = _to(stored, dev)
        w = ck.view_of(rec).materialize().to(dev)
        rows, hist = [], []
        for r in recs:
            q = _quantize_2d(w, r)
            m = error_metrics(w, dequantize(q, torch.float32), q)
            if r.fmt == stored.fmt and q.scale.shape == stored.scale.shape:
                m.update(grid_mismatch(stored, q))
            row, h = _rows(rec, str(r), m, q)
            rows.append(row)
            hist.extend(h)
        return rows, hist

    return _with_nonfinite(_collect(_stream(items, work, "stored grid vs recipes", plan.workers,
                                            inflight, progress), pd, plan), items, count)


def _to(q, dev):
    from dataclasses import replace

    gs = None if q.global_scale is None else q.global_scale.to(dev)
    return replace(q, data=q.data.to(dev), scale=q.scale.to(dev), global_scale=gs)


@dataclass
class ExpertDetail:
    """One expert weight under one recipe: what the expert-picker plots show."""

    label: str
    recipe: str
    weight: torch.Tensor  # reference BF16 [out, in]
    deq: torch.Tensor  # decoded under the recipe (or the stored grid)
    exponents: torch.Tensor  # block-scale exponents
    metrics: dict


def expert_detail(ck, layer: int, expert: int, proj: str, recipe: str | Recipe | None = None,
                  kind: str = "routed") -> ExpertDetail:
    """Decode one expert projection and quantize it with ``recipe`` (None: the stored grid)."""
    rec = ck.record(layer, expert, proj, kind)
    w = ck.view_of(rec).materialize()
    if recipe is None:
        q = stored_grid(ck, rec)
        if q is None:
            raise ValueError(f"{rec.key} is stored dense: pass a recipe to quantize it")
        deq, label = w, _stored_label(ck, rec)
    else:
        r = parse_recipe(recipe)
        q = _quantize_2d(w, r)
        deq, label = dequantize(q, torch.float32), str(r)
    return ExpertDetail(f"L{layer} E{expert} {proj}", label, w, deq, scale_exponents(q),
                        error_metrics(w, deq, q))
