"""Figures of the trainer's per-expert telemetry (`OUT/expert_stats.parquet`).

Inputs are the frames `workbench.track.expert_stats` returns; outputs are Figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .runs import _figure_class

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LABELS = {"rel_err": "relative error ||Q(w) - w|| / ||w||", "load": "tokens routed",
          "churn": "share of codes changed", "sqnr_db": "SQNR (dB)",
          "amax_drift": "amax drift (fraction)", "sat_frac": "share of saturated codes"}


def _label(metric: str) -> str:
    return LABELS.get(metric, metric)


def plot_step_heatmaps(grid: pd.DataFrame, metric: str, *, title: str | None = None) -> Figure:
    """Expert x record-step heatmaps of `metric`, one panel per layer, one colour scale for the
    figure. `grid` has columns layer, expert, step and `metric` (projections already reduced,
    see `workbench.track.expert_stats.per_expert`)."""
    from matplotlib.colors import Normalize  # the plots extra: loaded when a figure is drawn

    layers = sorted(grid["layer"].unique())
    fig = _figure_class()(figsize=(4.0 * len(layers) + 1.5, 4.0), layout="constrained")
    axes = fig.subplots(1, len(layers), squeeze=False)[0]
    vals = pd.to_numeric(grid[metric], errors="coerce").to_numpy(dtype=float)
    finite = vals[np.isfinite(vals)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if lo == hi:  # a flat map still needs a range to draw
        lo, hi = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0)
    norm = Normalize(lo, hi)
    im = None
    for ax, layer in zip(axes, layers):
        g = grid[grid["layer"] == layer].pivot(index="expert", columns="step", values=metric)
        im = ax.imshow(g.to_numpy(dtype=float), aspect="auto", interpolation="nearest",
                       norm=norm, cmap="viridis", origin="lower",
                       extent=(-0.5, g.shape[1] - 0.5, g.index.min() - 0.5, g.index.max() + 0.5))
        ax.set_xticks(range(g.shape[1]), [str(s) for s in g.columns],
                      rotation=90 if g.shape[1] > 12 else 0)
        ax.set_xlabel("step (record)")
        ax.set_ylabel("expert")
        ax.set_title(f"layer {layer}")
    fig.colorbar(im, ax=list(axes), label=_label(metric))
    fig.suptitle(title or f"{metric} per expert and step")
    return fig


def plot_error_growth(table: pd.DataFrame, *, n: int = 10, title: str | None = None) -> Figure:
    """The `n` experts whose relative error grew most between the first and last record;
    `table` has columns layer, expert, first, last, growth. The axis is zoomed to the bars."""
    top = table.nlargest(n, "growth").iloc[::-1]
    fig = _figure_class()(figsize=(7.0, 0.35 * len(top) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    labels = [f"L{int(r.layer)} E{int(r.expert)}" for r in top.itertuples()]
    ax.barh(labels, top["growth"], color="C3")
    if len(top):
        lo, hi = float(top["growth"].min()), float(top["growth"].max())
        pad = 0.1 * (hi - lo) if hi > lo else 0.1 * (abs(hi) or 1e-6)
        ax.set_xlim(min(lo - pad, 0.0) if lo < 0 else lo - pad, hi + pad)
    ax.set_xlabel("growth of relative error, last - first record")
    ax.set_title(title or f"experts whose error grew most (top {len(top)})")
    return fig


def plot_map_difference(diff: pd.DataFrame, *, a: str, b: str, metric: str = "rel_err") -> Figure:
    """Layer x expert map of `metric` of run `a` minus run `b` at their last record, diverging
    colours centred on zero (blue: `a` lower)."""
    g = diff.pivot(index="layer", columns="expert", values="diff")
    vals = g.to_numpy(dtype=float)
    span = float(np.nanmax(np.abs(vals))) if np.isfinite(vals).any() else 0.0
    span = span or 1e-12
    from matplotlib.colors import TwoSlopeNorm

    fig = _figure_class()(figsize=(max(6.0, 0.25 * g.shape[1] + 2), 0.5 * g.shape[0] + 2),
                          layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(vals, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                   norm=TwoSlopeNorm(0.0, -span, span), origin="lower")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(g.shape[0]), [str(v) for v in g.index])
    fig.colorbar(im, ax=ax, label=f"{metric}: {a} - {b}")
    ax.set_title(f"final {metric}, {a} minus {b}")
    return fig
