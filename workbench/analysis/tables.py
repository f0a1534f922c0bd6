"""Per-expert error tables from a checkpoint: one tidy DataFrame per question.

1. ``candidate_errors(ck, recipes)``: a BF16 (or any) checkpoint under candidate recipes.
2. ``reference_errors(ck, reference)``: a packed checkpoint against a BF16 reference checkpoint.
3. ``stored_vs_recipes(ck, recipes)``: the stored grid against re-quantizing its decoded weights.

Each returns ``ErrorTables(experts, scales)``: ``experts`` has one row per layer x expert x
projection x recipe with ``kind`` in routed/shared/dense (never mixed), ``scales`` the long
scale-exponent histogram. Work streams one weight at a time through a small thread pool (torch
kernels release the GIL, so I/O of the next weights overlaps the math of this one and every
core is used); at most ``inflight`` weights are alive, which bounds memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.formats import Recipe, dequantize, parse_recipe, quantize

from .metrics import e8m0_exponents, error_metrics, grid_mismatch, scale_exponents

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

    def save(self, folder: str | os.PathLike) -> Path:
        """Write ``experts.csv`` and ``scales.csv`` (and parquet copies when pyarrow is present)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for name, df in (("experts", self.experts), ("scales", self.scales)):
            tmp = out / f".{name}.csv.tmp"
            df.to_csv(tmp, index=False)
            os.replace(tmp, out / f"{name}.csv")
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike) -> ErrorTables:
        pd = _pd()
        folder = Path(folder)
        return cls(pd.read_csv(folder / "experts.csv"), pd.read_csv(folder / "scales.csv"))


def _device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _quantize_2d(w: torch.Tensor, recipe: Recipe):
    # one expert projection is one tensor: NVFP4's per-tensor scale is per expert
    return quantize(w, recipe, pad=True)


def _stream(items: list, work: Callable, desc: str, workers: int | None, inflight: int,
            progress: bool, then: Callable | None = None, batch: Callable | None = None,
            batch_limit: int = 0) -> Iterable:
    """``work(item)`` for each item on a thread pool, results in order; at most ``inflight`` alive.

    With ``then``, the pool only loads (``work``) and ``then([(item, loaded), ...])`` runs here on
    batches whose ``batch(loaded)`` sizes reach ``batch_limit``, yielding one result per item:
    compiled kernels use every core themselves and hold the GIL while they run, so the loads of
    the next batch overlap them."""
    from tqdm.auto import tqdm

    workers = workers or max(1, min(4, os.cpu_count() or 1))
    bar = tqdm(total=len(items), desc=desc, unit="weight", disable=not progress)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending, ready, size = [], [], 0
        for pos, item in enumerate(items):
            pending.append((item, pool.submit(work, item)))
            last = pos == len(items) - 1
            while pending and (len(pending) >= inflight or last):
                done, fut = pending.pop(0)
                if then is None:
                    yield fut.result()
                    bar.update()
                    continue
                ready.append((done, fut.result()))
                size += batch(ready[-1][1])
                if size >= batch_limit or not pending:
                    for res in then(ready):
                        yield res
                        bar.update()
                    ready, size = [], 0
    bar.close()


def _records(ck, kinds):
    return [r for r in ck.expert_records() if r.kind in kinds]


def _rows(rec, recipe: str, metrics: dict, q, byte_counts=None) -> tuple[dict, list[dict]]:
    base = {"layer": rec.layer, "expert": rec.expert, "proj": rec.proj, "kind": rec.kind,
            "recipe": recipe}
    row = {**base, **metrics, "numel": rec.shape[0] * rec.shape[1]}
    hist = []
    if byte_counts is not None:  # the fused path counted E8M0 bytes: same rows as below
        present = byte_counts.nonzero().flatten()
        hist = [{**base, "exponent": int(e), "count": int(c)}
                for e, c in zip(e8m0_exponents(present), byte_counts[present])]
    elif q is not None:
        exps, counts = torch.unique(scale_exponents(q).flatten(), return_counts=True)
        hist = [{**base, "exponent": int(e), "count": int(c)} for e, c in zip(exps, counts)]
    return row, hist


def _collect(results, pd) -> ErrorTables:
    rows, hist = [], []
    for r, h in results:
        rows.extend(r)
        hist.extend(h)
    experts = pd.DataFrame(rows)
    if not experts.empty:
        experts = experts.sort_values(KEY_COLS, kind="stable").reset_index(drop=True)
    scales = pd.DataFrame(hist, columns=[*KEY_COLS, "exponent", "count"])
    return ErrorTables(experts, scales)


def candidate_errors(ck, recipes: Iterable[str | Recipe], *, kinds=("routed", "shared", "dense"),
                     device: str | None = None, workers: int | None = None, inflight: int = 4,
                     progress: bool = True) -> ErrorTables:
    """Question 1: each weight (decoded to BF16 if stored packed) under each candidate recipe."""
    pd = _pd()
    recs = [parse_recipe(r) for r in recipes]
    dev = _device(device)

    def work(rec):
        w = ck.view_of(rec).materialize().to(dev)
        rows, hist = [], []
        for r in recs:
            q = _quantize_2d(w, r)
            row, h = _rows(rec, str(r), error_metrics(w, dequantize(q, torch.float32), q), q)
            rows.append(row)
            hist.extend(h)
        return rows, hist

    return _collect(_stream(_records(ck, kinds), work, "candidate recipes", workers, inflight,
                            progress), pd)


def _stored_label(ck, rec) -> str:
    r = ck.recipe_of(rec.name)
    return f"stored:{r}" if r is not None else "stored:bf16"


def reference_errors(ck, reference, *, kinds=("routed", "shared", "dense"),
                     device: str | None = None, workers: int | None = None, inflight: int = 4,
                     progress: bool = True) -> ErrorTables:
    """Question 2: the checkpoint's stored weights against the same weights in ``reference``.

    Records are matched by (kind, layer, expert, proj), so the two may use different layouts.
    """
    from workbench.checkpoint.grid import stored_grid

    pd = _pd()
    dev = _device(device)
    missing = [r.key for r in _records(ck, kinds)
               if (r.kind, r.layer, r.expert, r.proj) not in
               {(x.kind, x.layer, x.expert, x.proj) for x in reference.expert_records()}]
    if missing:
        raise ValueError(f"reference checkpoint {reference.path} lacks {len(missing)} weights of "
                         f"{ck.path}, e.g. {missing[:3]}")

    def work(rec):
        ref = reference.view_of(reference.record(rec.layer, rec.expert, rec.proj, rec.kind))
        w = ref.materialize().to(dev)
        deq = ck.view_of(rec).materialize().to(dev)
        if w.shape != deq.shape:
            raise ValueError(f"{rec.key}: shape {tuple(deq.shape)} in {ck.path} but "
                             f"{tuple(w.shape)} in the reference")
        q = stored_grid(ck, rec)
        q = None if q is None else _to(q, dev)
        row, h = _rows(rec, _stored_label(ck, rec), error_metrics(w, deq, q), q)
        return [row], h

    return _collect(_stream(_records(ck, kinds), work, "stored vs reference", workers, inflight,
                            progress), pd)


def stored_vs_recipes(ck, recipes: Iterable[str | Recipe], *, kinds=("routed", "shared", "dense"),
                      device: str | None = None, workers: int | None = None, inflight: int = 4,
                      progress: bool = True) -> ErrorTables:
    """Question 3: re-quantize each stored packed weight's decoded values with each recipe.

    Rows carry the error of the re-quantized weights against the decoded stored weights (zero
    when the recipe reproduces the stored grid) plus ``scale_mismatch_frac`` and
    ``code_mismatch_frac`` against the stored grid. Dense-stored weights are skipped.
    """
    from workbench.checkpoint.grid import stored_grid

    pd = _pd()
    recs = [parse_recipe(r) for r in recipes]
    dev = _device(device)
    items = _records(ck, kinds)
    mx4 = sum(r.shape[0] * r.shape[1] for r in items
              if getattr(ck.recipe_of(r.name), "fmt", None) == "mxfp4")
    fused_ok = {r: mx4 > 0 and _fused_reason(r, dev, mx4) is None for r in recs}

    def load(rec):
        stored = stored_grid(ck, rec)
        return None if stored is None else _to(stored, dev)

    def reference(rec, stored, r, w):
        q = _quantize_2d(w, r)
        m = error_metrics(w, dequantize(q, torch.float32), q)
        if r.fmt == stored.fmt and q.scale.shape == stored.scale.shape:
            m.update(grid_mismatch(stored, q))
        return _rows(rec, str(r), m, q)

    def compute(batch):
        """Rows of a batch of loaded weights: fused where it applies, else the reference."""
        rows, hist = [[] for _ in batch], [[] for _ in batch]
        decoded = {}  # decoded once per weight, only when some recipe needs the reference
        for r in recs:
            fused = _fused_results([(i, s) for i, (_, s) in enumerate(batch) if s is not None],
                                   r) if fused_ok[r] else {}
            for i, (rec, stored) in enumerate(batch):
                if stored is None:
                    continue
                if i in fused:
                    row, h = _rows(rec, str(r), fused[i].metrics, None, fused[i].byte_counts)
                else:
                    if i not in decoded:
                        decoded[i] = ck.view_of(rec).materialize().to(dev)
                    row, h = reference(rec, stored, r, decoded[i])
                rows[i].append(row)
                hist[i].extend(h)
        return list(zip(rows, hist))

    if any(fused_ok.values()):  # loads overlap the compiled passes, which run here
        from .fused import BATCH_BLOCKS

        results = _stream(items, load, "stored grid vs recipes", workers, inflight, progress,
                          then=compute, batch=lambda s: 0 if s is None else s.scale.numel(),
                          batch_limit=BATCH_BLOCKS)
    else:
        results = _stream(items, lambda rec: compute([(rec, load(rec))])[0],
                          "stored grid vs recipes", workers, inflight, progress)
    return _collect(results, pd)


def _fused_reason(recipe: Recipe, dev: torch.device, elements: int) -> str | None:
    from . import fused

    why = fused.static_reason(recipe, dev, elements)
    fused.log_choice(str(recipe), why)
    return why


def _fused_results(grids: list, recipe: Recipe) -> dict:
    """{position: FusedResult} for the grids the fused path takes (reasons for the others are
    logged once); one compiled call per stored profile."""
    from . import fused

    by_profile: dict[str, list] = {}
    for i, g in grids:
        why = fused.grid_reason(g)
        if why is None:
            by_profile.setdefault(g.profile, []).append((i, g))
        else:
            fused.log_choice(str(recipe), why)
    out = {}
    for members in by_profile.values():
        res = fused.stored_vs_recipe([g for _, g in members], recipe)
        if res is not None:
            out.update({i: x for (i, _), x in zip(members, res)})
    return out


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
    from workbench.checkpoint.grid import stored_grid

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
