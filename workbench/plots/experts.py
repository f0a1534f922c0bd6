"""Per-expert quantization error figures from ``workbench.analysis`` tables.

Each function takes a DataFrame (``ErrorTables.experts`` / ``.scales`` or an ``ExpertDetail``)
and returns a ``matplotlib.figure.Figure`` built without pyplot, so notebooks, the CLI and
wandb show the same pictures and no global figure state leaks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from .runs import _figure_class

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

# label and unit of each metric, for axes and colorbars
METRIC_LABELS = {
    "rel_err": "relative error ||Wq-W||/||W||",
    "sqnr_db": "SQNR (dB)",
    "max_abs_err": "max |Wq-W|",
    "cosine": "cosine(Wq, W)",
    "clip_frac": "clipped fraction",
    "zero_frac": "zero-code fraction",
    "amax": "max |W|",
    "scale_mismatch_frac": "blocks with another scale",
    "code_mismatch_frac": "codes that differ",
}
PROJ_ORDER = ("gate", "up", "down")
# A cell whose weight holds NaN/Inf (or whose value is not finite) is drawn in this colour with
# a hatch and named in a legend: imshow would leave it blank, like a weight that is not there.
NONFINITE_STYLE = {"facecolor": "#ff00ff", "edgecolor": "black", "hatch": "xx", "linewidth": 0.5}
NONFINITE_LABEL = "NaN/Inf: non-finite weights or value"


def _label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _select(df: pd.DataFrame, recipe: str | None, kind: str | None = "routed") -> pd.DataFrame:
    if kind is not None:
        df = df[df.kind == kind]
    if recipe is None:
        recipes = sorted(df.recipe.unique())
        if len(recipes) > 1:
            raise ValueError(f"table holds several recipes {recipes}: pass recipe=")
        return df
    out = df[df.recipe == recipe]
    if out.empty:
        raise ValueError(f"no rows for recipe {recipe!r}; the table has {sorted(df.recipe.unique())}")
    return out


def value_range(values) -> tuple[float, float]:
    """Colour limits of finite ``values``: their min and max, widened when they are all equal
    (a flat grid gets a visible range around its value instead of a degenerate norm), (0, 1)
    when nothing is finite."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return 0.0, 1.0
    lo, hi = float(v.min()), float(v.max())
    if lo == hi:
        pad = abs(lo) * 0.05 if lo else 1.0
        return (lo - pad, hi + pad) if lo else (0.0, pad)
    return lo, hi


def plot_heatmap(df: pd.DataFrame, metric: str = "rel_err", *, recipe: str | None = None,
            projs: tuple[str, ...] | None = None, kind: str = "routed",
            vmin: float | None = None, vmax: float | None = None,
            figsize: tuple[float, float] | None = None) -> Figure:
    """Layer x expert heatmap of ``metric``, one panel per projection, shared color scale.

    ``vmin``/``vmax`` fix the colour scale (pass the same ones to every recipe's heatmap, or use
    ``plot_recipe_heatmaps``, so equal colours mean equal errors across figures)."""
    d = _select(df, recipe, kind)
    projs = projs or tuple(p for p in PROJ_ORDER if p in set(d.proj))
    lo, hi = value_range(d[metric])
    vmin, vmax = (lo if vmin is None else vmin), (hi if vmax is None else vmax)
    fig, axes, im = projection_panels(d, metric, projs, {"vmin": vmin, "vmax": vmax,
                                                         "cmap": "viridis"},
                                      figsize=figsize, min_height=2.5, base_height=1.2)
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.9)
    cbar.set_label(_label(metric))
    rec = recipe or d.recipe.iloc[0]
    fig.suptitle(f"{_label(metric)} per expert: {rec} ({kind})")
    return fig


def projection_panels(d: pd.DataFrame, value: str, projs: tuple[str, ...], imshow_kw: dict, *,
                      figsize: tuple[float, float] | None, min_height: float,
                      base_height: float):
    """One layer x expert panel of ``value`` per projection, drawn with ``imshow_kw`` (one norm
    or vmin/vmax for all panels): (figure, axes, last image) for the caller's colour bar."""
    layers, experts = sorted(d.layer.unique()), sorted(d.expert.unique())
    n = len(projs)
    w = min(18.0, 2.0 + 0.25 * len(experts) * n + 1.5 * n)
    fig = _figure_class()(figsize=figsize or (max(6.0, w),
                                              max(min_height, base_height + 0.3 * len(layers))),
                          layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    im = None
    marked = False
    for ax, proj in zip(axes, projs):
        g = d[d.proj == proj]
        grid = g.pivot_table(index="layer", columns="expert", values=value, dropna=False)
        grid = grid.reindex(index=layers, columns=experts)
        im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", interpolation="nearest",
                       origin="lower", **imshow_kw)
        marked |= mark_nonfinite(ax, g, value, layers, experts)
        ax.set_title(f"{proj}_proj")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        _ticks(ax.set_xticks, ax.set_xticklabels, experts)
        _ticks(ax.set_yticks, ax.set_yticklabels, layers)
    if marked:
        nonfinite_legend(fig)
    return fig, axes, im


def nonfinite_mask(d: pd.DataFrame, value: str) -> np.ndarray:
    """Rows whose ``value`` is NaN/Inf or whose weights hold NaN/Inf (``nonfinite`` columns of
    an analysis table or of a comparison's sides)."""
    bad = ~np.isfinite(d[value].to_numpy(dtype=float))
    for col in ("nonfinite", "a_nonfinite", "b_nonfinite"):
        if col in d:
            bad |= d[col].to_numpy(dtype=float) > 0
    return bad


def _nan_rows(d: pd.DataFrame, metric: str) -> np.ndarray:
    """Rows with NaN/Inf weights (or a NaN metric): unlike an infinite SQNR (an exact row),
    these are findings a figure must not drop unsaid."""
    bad = np.isnan(d[metric].to_numpy(dtype=float))
    if "nonfinite" in d:
        bad |= d["nonfinite"].to_numpy(dtype=float) > 0
    return bad


def mark_nonfinite(ax, d: pd.DataFrame, value: str, layers: list, experts: list) -> bool:
    """Draw each non-finite row of ``d`` (one projection) as a hatched cell; whether any was."""
    from matplotlib.patches import Rectangle

    rows = d[nonfinite_mask(d, value)]
    for r in rows.itertuples():
        x, y = experts.index(r.expert), layers.index(r.layer)
        ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1.0, 1.0, **NONFINITE_STYLE))
    return len(rows) > 0


def nonfinite_legend(fig) -> None:
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(label=NONFINITE_LABEL, **NONFINITE_STYLE)],
               loc="outside lower center", fontsize="small", frameon=False)


def _ticks(set_ticks, set_labels, values, max_ticks: int = 16):
    step = max(1, math.ceil(len(values) / max_ticks))
    pos = list(range(0, len(values), step))
    set_ticks(pos)
    set_labels([str(values[i]) for i in pos])


def plot_recipe_heatmaps(df: pd.DataFrame, metric: str = "rel_err", *,
                    recipes: list[str] | None = None, kind: str = "routed",
                    projs: tuple[str, ...] | None = None,
                    figsize: tuple[float, float] | None = None) -> Figure:
    """Layer x expert heatmaps of ``metric`` for several recipes in one figure: one row per
    recipe, one column per projection, ONE colour scale (and colorbar) for all panels, so a
    colour means the same error in every recipe."""
    d = df[df.kind == kind] if kind is not None else df
    recipes = list(recipes) if recipes is not None else sorted(d.recipe.unique())
    if not recipes:
        raise ValueError(f"no {kind} rows to draw")
    d = d[d.recipe.isin(recipes)]
    projs = projs or tuple(p for p in PROJ_ORDER if p in set(d.proj))
    layers, experts = sorted(d.layer.unique()), sorted(d.expert.unique())
    vmin, vmax = value_range(d[metric])
    n, m = len(recipes), len(projs)
    w = min(18.0, 2.0 + 0.25 * len(experts) * m + 1.5 * m)
    fig = _figure_class()(figsize=figsize or (max(6.0, w), max(2.5, (1.0 + 0.3 * len(layers)) * n)),
                          layout="constrained")
    axes = fig.subplots(n, m, squeeze=False)
    im = None
    marked = False
    for i, rec in enumerate(recipes):
        for j, proj in enumerate(projs):
            ax = axes[i][j]
            g = d[(d.recipe == rec) & (d.proj == proj)]
            grid = g.pivot_table(index="layer", columns="expert", values=metric, dropna=False)
            grid = grid.reindex(index=layers, columns=experts)
            im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", interpolation="nearest",
                           vmin=vmin, vmax=vmax, cmap="viridis", origin="lower")
            marked |= mark_nonfinite(ax, g, metric, layers, experts)
            ax.set_title(f"{rec}: {proj}_proj", fontsize="medium")
            ax.set_xlabel("expert")
            ax.set_ylabel("layer")
            _ticks(ax.set_xticks, ax.set_xticklabels, experts)
            _ticks(ax.set_yticks, ax.set_yticklabels, layers)
    cbar = fig.colorbar(im, ax=[a for row in axes for a in row], shrink=0.9)
    cbar.set_label(_label(metric))
    if marked:
        nonfinite_legend(fig)
    fig.suptitle(f"{_label(metric)} per expert, one colour scale for all recipes ({kind})")
    return fig


def plot_expert_distribution(df: pd.DataFrame, metric: str = "rel_err", *, recipe: str | None = None,
                        proj: str | None = None, kind: str = "routed",
                        figsize: tuple[float, float] = (10.0, 4.0)) -> Figure:
    """Per-expert distribution of ``metric`` across layers (box per expert)."""
    d = _select(df, recipe, kind)
    if proj is not None:
        d = d[d.proj == proj]
    experts = sorted(d.expert.unique())
    n_bad = int(_nan_rows(d, metric).sum())
    d = d[~nonfinite_mask(d, metric)]
    data = [d[d.expert == e][metric].to_numpy() for e in experts]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    ax.boxplot(data, positions=range(len(experts)), widths=0.6, showfliers=True)
    _ticks(ax.set_xticks, ax.set_xticklabels, experts, max_ticks=32)
    ax.set_xlabel("expert")
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} across layers, per expert"
                 + (f" ({proj}_proj)" if proj else " (all projections)")
                 + (f"; {n_bad} non-finite left out" if n_bad else ""))
    return fig


def plot_recipe_comparison(df: pd.DataFrame, metric: str = "sqnr_db", *, kind: str = "routed",
                      figsize: tuple[float, float] = (8.0, 4.0)) -> Figure:
    """Distribution of ``metric`` over all expert weights, one box per recipe and projection."""
    d = df[df.kind == kind]
    recipes = sorted(d.recipe.unique())
    projs = [p for p in PROJ_ORDER if p in set(d.proj)]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(projs))
    handles = []
    for j, proj in enumerate(projs):
        data = [d[(d.recipe == r) & (d.proj == proj)][metric]
                .replace([np.inf, -np.inf], np.nan).dropna().to_numpy() for r in recipes]
        pos = [i + (j - (len(projs) - 1) / 2) * width for i in range(len(recipes))]
        bp = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True,
                        showfliers=False)
        color = f"C{j}"
        for box in bp["boxes"]:
            box.set_facecolor(color)
            box.set_alpha(0.6)
        handles.append((bp["boxes"][0], f"{proj}_proj"))
    ax.set_xticks(range(len(recipes)))
    ax.set_xticklabels(recipes, rotation=20, ha="right")
    ax.set_xlabel("recipe")
    ax.set_ylabel(_label(metric))
    ax.set_title(f"recipes compared: {_label(metric)}")
    if handles:
        ax.legend([h for h, _ in handles], [lab for _, lab in handles], loc="best")
    return fig


def plot_scale_histogram(scales: pd.DataFrame, *, recipe: str | None = None,
                    layer: int | None = None, expert: int | None = None, proj: str | None = None,
                    kind: str = "routed", figsize: tuple[float, float] = (7.0, 3.5)) -> Figure:
    """Histogram of block-scale exponents (log2 of each block's scale), as the fraction of a
    recipe's elements whose block has that exponent. Counting blocks would weigh NVFP4 (16
    elements per block) twice as much as MX (32); within one recipe every block has the same
    size, so the fraction of its elements equals the fraction of its blocks."""
    d = scales[scales.kind == kind] if kind else scales
    for col, v in (("recipe", recipe), ("layer", layer), ("expert", expert), ("proj", proj)):
        if v is not None:
            d = d[d[col] == v]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    for i, (rec, g) in enumerate(sorted(d.groupby("recipe"), key=lambda kv: kv[0])):
        agg = g.groupby("exponent")["count"].sum()
        special = agg[(agg.index <= -1000) | (agg.index >= 1000)]
        agg = agg[(agg.index > -1000) & (agg.index < 1000)]
        total = float(agg.sum() + special.sum())
        off = (i - (d.recipe.nunique() - 1) / 2) * 0.8 / max(1, d.recipe.nunique())
        label = rec + (f" (+{special.sum() / total:.2%} zero/NaN blocks)" if len(special) else "")
        ax.bar(agg.index + off, agg.to_numpy() / total, width=0.8 / max(1, d.recipe.nunique()),
               label=label)
    ax.set_xlabel("block scale exponent (log2)")
    ax.set_ylabel("fraction of elements")
    where = ", ".join(f"{k}={v}" for k, v in (("layer", layer), ("expert", expert), ("proj", proj))
                      if v is not None)
    ax.set_title("scale exponents" + (f" ({where})" if where else ""))
    ax.legend(loc="best", fontsize="small")
    return fig


def plot_worst_experts(df: pd.DataFrame, metric: str = "rel_err", *, n: int = 10,
                  recipe: str | None = None, kind: str = "routed", largest: bool | None = None,
                  figsize: tuple[float, float] = (8.0, 4.0)) -> Figure:
    """The ``n`` worst expert weights by ``metric`` (largest error, or lowest SQNR/cosine)."""
    d = _select(df, recipe, kind)
    if largest is None:
        largest = metric not in ("sqnr_db", "cosine")
    n_bad = int(_nan_rows(d, metric).sum())
    d = d[~nonfinite_mask(d, metric)]  # and +-inf (exact SQNR) rows, which rank nowhere
    top = d.nlargest(n, metric) if largest else d.nsmallest(n, metric)
    labels = [f"L{r.layer} E{r.expert} {r.proj}" for r in top.itertuples()]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    vals = top[metric].to_numpy(dtype=float)
    ax.barh(range(len(top))[::-1], vals, color="C3")
    ax.set_yticks(range(len(top))[::-1])
    ax.set_yticklabels(labels)
    ax.set_ylabel("layer, expert, projection")
    zoom = ""
    if len(vals):
        # Bars from 0 make ten errors of 0.140-0.152 look equal: the axis spans the values shown.
        lo, hi = value_range(vals)
        pad = 0.08 * (hi - lo)
        ax.set_xlim(lo - pad, hi + pad)
        zoom = " (axis zoomed to the values shown)"
        for y, v in zip(range(len(top))[::-1], vals):
            ax.text(v, y, f" {v:.4g}", va="center", fontsize="x-small", clip_on=True)
    ax.set_xlabel(_label(metric) + zoom)
    unranked = f"\n({n_bad} non-finite weights not ranked: see the summary)" if n_bad else ""
    ax.set_title(f"worst {len(top)} expert weights: "
                 f"{recipe or d.recipe.iloc[0] if len(d) else ''}{unranked}")
    return fig


def plot_expert_detail(detail, *, bins: int = 80, figsize: tuple[float, float] = (10.0, 3.6)) -> Figure:
    """One expert weight: histogram of element errors and of its block-scale exponents.

    ``detail`` is a ``workbench.analysis.ExpertDetail``.
    """
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    err = (detail.deq.float() - detail.weight.float()).flatten().numpy()
    ax1.set_xlabel("element error W_q - W")
    ax1.set_ylabel("elements (log)")
    if not err.any():  # lossless: name it instead of drawing one spike at 0
        ax1.text(0.5, 0.5, f"{detail.recipe} reproduces these weights exactly\n(every element "
                 "error is 0)", ha="center", va="center", transform=ax1.transAxes)
        ax1.set_title(f"{detail.label}: exact (rel err 0)", fontsize="medium")
    else:
        ax1.hist(err, bins=bins, color="C0", log=True)
        ax1.set_title(f"{detail.label}: rel err {detail.metrics['rel_err']:.4f}, "
                      f"SQNR {detail.metrics['sqnr_db']:.1f} dB", fontsize="medium")
    ex = detail.exponents.flatten().numpy()
    ex = ex[(ex > -1000) & (ex < 1000)]
    if ex.size:
        lo, hi = int(ex.min()), int(ex.max())
        # one weight, one block size: the fraction of blocks is the fraction of elements
        ax2.hist(ex, bins=np.arange(lo - 0.5, hi + 1.5), color="C1",
                 weights=np.full(ex.size, 1.0 / detail.exponents.numel()))
    ax2.set_xlabel("block scale exponent (log2)")
    ax2.set_ylabel("fraction of elements")
    ax2.set_title(f"scales ({detail.recipe})", fontsize="medium")
    return fig
