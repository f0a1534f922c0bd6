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


def heatmap(df: pd.DataFrame, metric: str = "rel_err", *, recipe: str | None = None,
            projs: tuple[str, ...] | None = None, kind: str = "routed",
            figsize: tuple[float, float] | None = None) -> Figure:
    """Layer x expert heatmap of ``metric``, one panel per projection, shared color scale."""
    d = _select(df, recipe, kind)
    projs = projs or tuple(p for p in PROJ_ORDER if p in set(d.proj))
    layers = sorted(d.layer.unique())
    experts = sorted(d.expert.unique())
    vals = d[metric].replace([np.inf, -np.inf], np.nan)
    vmin, vmax = float(np.nanmin(vals)), float(np.nanmax(vals))
    n = len(projs)
    w = min(18.0, 2.0 + 0.25 * len(experts) * n + 1.5 * n)
    fig = _figure_class()(figsize=figsize or (max(6.0, w), max(2.5, 1.2 + 0.3 * len(layers))),
                          layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    im = None
    for ax, proj in zip(axes, projs):
        grid = d[d.proj == proj].pivot_table(index="layer", columns="expert", values=metric)
        grid = grid.reindex(index=layers, columns=experts)
        im = ax.imshow(grid.to_numpy(dtype=float), aspect="auto", interpolation="nearest",
                       vmin=vmin, vmax=vmax, cmap="viridis", origin="lower")
        ax.set_title(f"{proj}_proj")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        _ticks(ax.set_xticks, ax.set_xticklabels, experts)
        _ticks(ax.set_yticks, ax.set_yticklabels, layers)
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.9)
    cbar.set_label(_label(metric))
    rec = recipe or d.recipe.iloc[0]
    fig.suptitle(f"{_label(metric)} per expert: {rec} ({kind})")
    return fig


def _ticks(set_ticks, set_labels, values, max_ticks: int = 16):
    step = max(1, math.ceil(len(values) / max_ticks))
    pos = list(range(0, len(values), step))
    set_ticks(pos)
    set_labels([str(values[i]) for i in pos])


def expert_distribution(df: pd.DataFrame, metric: str = "rel_err", *, recipe: str | None = None,
                        proj: str | None = None, kind: str = "routed",
                        figsize: tuple[float, float] = (10.0, 4.0)) -> Figure:
    """Per-expert distribution of ``metric`` across layers (box per expert)."""
    d = _select(df, recipe, kind)
    if proj is not None:
        d = d[d.proj == proj]
    experts = sorted(d.expert.unique())
    data = [d[d.expert == e][metric].replace([np.inf, -np.inf], np.nan).dropna().to_numpy()
            for e in experts]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    ax.boxplot(data, positions=range(len(experts)), widths=0.6, showfliers=True)
    _ticks(ax.set_xticks, ax.set_xticklabels, experts, max_ticks=32)
    ax.set_xlabel("expert")
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} across layers, per expert"
                 + (f" ({proj}_proj)" if proj else " (all projections)"))
    return fig


def recipe_comparison(df: pd.DataFrame, metric: str = "sqnr_db", *, kind: str = "routed",
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


def scale_histogram(scales: pd.DataFrame, *, recipe: str | None = None,
                    layer: int | None = None, expert: int | None = None, proj: str | None = None,
                    kind: str = "routed", figsize: tuple[float, float] = (7.0, 3.5)) -> Figure:
    """Histogram of block-scale exponents (log2 of each block's scale)."""
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
        off = (i - (d.recipe.nunique() - 1) / 2) * 0.8 / max(1, d.recipe.nunique())
        label = rec + (f" (+{int(special.sum())} zero/NaN blocks)" if len(special) else "")
        ax.bar(agg.index + off, agg.to_numpy(), width=0.8 / max(1, d.recipe.nunique()), label=label)
    ax.set_xlabel("block scale exponent (log2)")
    ax.set_ylabel("blocks")
    where = ", ".join(f"{k}={v}" for k, v in (("layer", layer), ("expert", expert), ("proj", proj))
                      if v is not None)
    ax.set_title("scale exponents" + (f" ({where})" if where else ""))
    ax.legend(loc="best", fontsize="small")
    return fig


def worst_experts(df: pd.DataFrame, metric: str = "rel_err", *, n: int = 10,
                  recipe: str | None = None, kind: str = "routed", largest: bool | None = None,
                  figsize: tuple[float, float] = (8.0, 4.0)) -> Figure:
    """The ``n`` worst expert weights by ``metric`` (largest error, or lowest SQNR/cosine)."""
    d = _select(df, recipe, kind)
    if largest is None:
        largest = metric not in ("sqnr_db", "cosine")
    d = d.replace([np.inf, -np.inf], np.nan).dropna(subset=[metric])
    top = d.nlargest(n, metric) if largest else d.nsmallest(n, metric)
    labels = [f"L{r.layer} E{r.expert} {r.proj}" for r in top.itertuples()]
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax = fig.subplots()
    ax.barh(range(len(top))[::-1], top[metric].to_numpy(), color="C3")
    ax.set_yticks(range(len(top))[::-1])
    ax.set_yticklabels(labels)
    ax.set_ylabel("layer, expert, projection")
    ax.set_xlabel(_label(metric))
    ax.set_title(f"worst {len(top)} expert weights: {recipe or d.recipe.iloc[0] if len(d) else ''}")
    return fig


def expert_detail(detail, *, bins: int = 80, figsize: tuple[float, float] = (10.0, 3.6)) -> Figure:
    """One expert weight: histogram of element errors and of its block-scale exponents.

    ``detail`` is a ``workbench.analysis.ExpertDetail``.
    """
    fig = _figure_class()(figsize=figsize, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    err = (detail.deq.float() - detail.weight.float()).flatten().numpy()
    ax1.hist(err, bins=bins, color="C0", log=True)
    ax1.set_xlabel("element error W_q - W")
    ax1.set_ylabel("elements (log)")
    ax1.set_title(f"{detail.label}: rel err {detail.metrics['rel_err']:.4f}, "
                  f"SQNR {detail.metrics['sqnr_db']:.1f} dB", fontsize="medium")
    ex = detail.exponents.flatten().numpy()
    ex = ex[(ex > -1000) & (ex < 1000)]
    if ex.size:
        lo, hi = int(ex.min()), int(ex.max())
        ax2.hist(ex, bins=np.arange(lo - 0.5, hi + 1.5), color="C1")
    ax2.set_xlabel("block scale exponent (log2)")
    ax2.set_ylabel("blocks")
    ax2.set_title(f"scales ({detail.recipe})", fontsize="medium")
    return fig
