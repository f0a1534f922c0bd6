"""Figures of a two-checkpoint comparison (``workbench.analysis.compare``'s per-weight table).

The table has one row per expert weight with ``a_<metric>``, ``b_<metric>``, ``delta``
(A - B), ``change_pct`` (100 * delta / B) and ``verdict``. Differences are drawn with a
diverging colour map centred on zero (symmetric limits): blue where A has less error than B,
red where it has more. Like every plot here, these take the table and return a Figure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .experts import PROJ_ORDER, _label, projection_panels
from .runs import _figure_class

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

VALUE_LABELS = {"change_pct": "change of {metric}, A vs B (%)", "delta": "{metric}: A - B"}
VERDICT_COLORS = {"improved": "C0", "same": "0.6", "worse": "C3"}


def symmetric_limit(values) -> float:
    """Half-range of a colour scale centred on 0: the largest finite |value| (1.0 when there is
    none or all are 0, so the norm is never degenerate)."""
    v = np.abs(np.asarray(values, dtype=float))
    v = v[np.isfinite(v)]
    m = float(v.max()) if v.size else 0.0
    return m if m > 0 else 1.0


def plot_compare_heatmap(table: pd.DataFrame, value: str = "change_pct", *, metric: str = "rel_err",
                    a_label: str = "A", b_label: str = "B", kind: str = "routed",
                    figsize: tuple[float, float] | None = None) -> Figure:
    """Layer x expert map of ``value`` (``change_pct`` or ``delta``), one panel per projection,
    one diverging colour scale centred on 0 for all panels."""
    from matplotlib.colors import Normalize

    d = table[table.kind == kind] if kind is not None else table
    if d.empty:
        raise ValueError(f"no {kind} rows in the comparison table")
    projs = tuple(p for p in PROJ_ORDER if p in set(d.proj))
    half = symmetric_limit(d[value])
    norm = Normalize(vmin=-half, vmax=half)  # symmetric, so 0 is the white centre of RdBu
    fig, axes, im = projection_panels(d, value, projs, {"norm": norm, "cmap": "RdBu_r"},
                                      figsize=figsize, min_height=2.8, base_height=1.4)
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.9)
    cbar.set_label(VALUE_LABELS.get(value, value).format(metric=metric) + "\n< 0: A has less error")
    fig.suptitle(f"A = {a_label} vs B = {b_label}: {_label(metric)} per expert ({kind})")
    return fig


def plot_compare_scatter(table: pd.DataFrame, *, metric: str = "rel_err", a_label: str = "A",
                    b_label: str = "B", kind: str = "routed",
                    figsize: tuple[float, float] = (5.5, 5.0)) -> Figure:
    """Each expert weight's error under A against under B, coloured by verdict, with the y = x
    line: points below it are weights where A has less error."""
    d = table[table.kind == kind] if kind is not None else table
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    a, b = f"a_{metric}", f"b_{metric}"
    for verdict, color in VERDICT_COLORS.items():
        g = d[d.verdict == verdict]
        if len(g):
            ax.scatter(g[b], g[a], s=12, color=color, label=f"{verdict} ({len(g)})", alpha=0.8)
    vals = np.concatenate([d[a].to_numpy(float), d[b].to_numpy(float)]) if len(d) else np.zeros(0)
    vals = vals[np.isfinite(vals)]
    if vals.size:
        lo, hi = float(vals.min()), float(vals.max())
        pad = 0.05 * (hi - lo) if hi > lo else max(abs(hi) * 0.05, 1e-12)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="k", lw=0.8, ls="--",
                label="A = B")
        ax.set_xlim(lo - pad, hi + pad)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel(f"B = {b_label}: {_label(metric)}")
    ax.set_ylabel(f"A = {a_label}: {_label(metric)}")
    n_bad = int((d.verdict == "non-finite").sum()) if "verdict" in d else 0
    unplaced = f"\n{n_bad} non-finite weights (NaN/Inf) have no point: see the summary" \
        if n_bad else ""
    ax.set_title(f"{_label(metric)} per expert weight ({kind}){unplaced}", fontsize="medium")
    ax.legend(loc="best", fontsize="small")
    return fig


def plot_compare_extremes(table: pd.DataFrame, *, n: int = 8, value: str = "change_pct",
                     metric: str = "rel_err", a_label: str = "A", b_label: str = "B",
                     kind: str = "routed", figsize: tuple[float, float] = (8.0, 4.5)) -> Figure:
    """The ``n`` weights A improved most and the ``n`` it made worst, as bars of ``value`` on
    an axis centred on 0."""
    d = table[table.kind == kind] if kind is not None else table
    d = d[np.isfinite(d[value].to_numpy(float))]
    best = d.nsmallest(n, value)
    best = best[best[value] < 0]  # only weights A actually improved / worsened
    worst = d.nlargest(n, value)
    worst = worst[worst[value] > 0].sort_values(value)
    rows = list(best.itertuples()) + list(worst.itertuples())  # most improved first
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    vals = np.array([getattr(r, value) for r in rows], dtype=float)
    colors = ["C0" if v < 0 else ("C3" if v > 0 else "0.6") for v in vals]
    ys = np.arange(len(rows))[::-1]  # the first row on top
    ax.barh(ys, vals, color=colors)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"L{r.layer} E{r.expert} {r.proj}" for r in rows])
    half = symmetric_limit(vals)
    ax.set_xlim(-1.08 * half, 1.08 * half)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_xlabel(VALUE_LABELS.get(value, value).format(metric=metric))
    ax.set_ylabel("layer, expert, projection")
    ax.set_title(f"A = {a_label} vs B = {b_label}: most improved (blue) and most worsened (red)",
                 fontsize="medium")
    return fig
