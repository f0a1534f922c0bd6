"""Run-comparison figures: training curves of a run group and the budget verdict table.

Inputs are the frames of `workbench.track.compare` (`Comparison.curves`,
`Comparison.budgets`) or anything with the same columns; outputs are matplotlib Figures, so
notebooks, the CLI and wandb show the same pictures.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure_class():
    # A bare Figure (not pyplot) leaves the global figure registry and backend alone.
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'workbench[plots]'") from exc
    return Figure


def plot_curves(df: pd.DataFrame, metric: str = "loss", *, val_metric: str | None = "val_loss",
                logx: bool = False, logy: bool = False, smooth: int = 1,
                title: str | None = None, figsize: tuple[float, float] = (8.0, 4.5)) -> Figure:
    """One line per run of `metric` against step (solid), and `val_metric` as markers with a
    dashed line in the same colour when it was logged. `smooth` > 1 applies a trailing
    rolling mean of that many steps to the training curve only."""
    Figure = _figure_class()
    for col in ("run", "step", metric):
        if col not in df.columns:
            raise KeyError(f"plot_curves: column {col!r} missing (columns: {list(df.columns)})")
    if smooth < 1:
        raise ValueError(f"plot_curves: smooth must be >= 1, got {smooth}")
    fig = Figure(figsize=figsize, layout="constrained")
    ax = fig.add_subplot()
    for i, (run, g) in enumerate(df.groupby("run", sort=False)):
        color = f"C{i % 10}"  # train and val of one run share a colour
        g = g.sort_values("step")
        y = pd.to_numeric(g[metric], errors="coerce")
        ok = y.notna()
        y = y[ok].rolling(smooth, min_periods=1).mean()
        ax.plot(g.loc[ok, "step"], y, color=color, lw=1.5, label=f"{run} {metric}")
        if val_metric and val_metric in g.columns:
            v = pd.to_numeric(g[val_metric], errors="coerce")
            if v.notna().any():
                ax.plot(g.loc[v.notna(), "step"], v[v.notna()], color=color, ls="--",
                        marker="o", ms=3, lw=1, label=f"{run} {val_metric}")
    if logx:
        ax.set_xscale("symlog", linthresh=1.0)  # step 0 stays on the plot
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(metric if not val_metric else f"{metric} / {val_metric}")
    ax.set_title(title or f"{metric} per run")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small", loc="best")
    return fig


def plot_budgets(table: pd.DataFrame, *, title: str = "Budget verdicts") -> Figure:
    """The budget table as a figure: one row per (run, budget), PASS / FAIL / pending
    coloured green / red / grey."""
    Figure = _figure_class()
    for col in ("budget", "measured", "limit", "passed"):
        if col not in table.columns:
            raise KeyError(f"plot_budgets: column {col!r} missing "
                           f"(columns: {list(table.columns)})")
    cols = [c for c in ("run", "budget", "measured", "limit", "passed", "detail")
            if c in table.columns]
    cells, colours = [], []
    for _, row in table.iterrows():
        p = row["passed"]
        verdict = "pending" if pd.isna(p) else ("PASS" if bool(p) else "FAIL")
        colour = {"PASS": "#c8e6c9", "FAIL": "#ffcdd2", "pending": "#eeeeee"}[verdict]
        line = []
        for c in cols:
            v = row[c]
            if c == "passed":
                line.append(verdict)
            elif isinstance(v, float):
                line.append("-" if math.isnan(v) else f"{v:.4g}")
            else:
                text = str(v)
                line.append(text if len(text) <= 60 else text[:57] + "...")
        cells.append(line)
        colours.append([colour] * len(cols))
    height = 0.7 + 0.3 * (max(len(cells), 1) + 1)
    fig = Figure(figsize=(13.0, height), layout="constrained")
    ax = fig.add_subplot()
    ax.axis("off")
    ax.set_title(title)
    if cells:
        t = ax.table(cellText=cells, cellColours=colours, colLabels=cols, bbox=(0, 0, 1, 1),
                     cellLoc="left")
        t.auto_set_font_size(False)
        t.set_fontsize(9)
        t.auto_set_column_width(list(range(len(cols))))
    else:
        ax.text(0.5, 0.5, "no budgets checked", ha="center", va="center")
    return fig


def plot_expert_errors(df: pd.DataFrame, metric: str = "rel_err", *,
                       title: str | None = None) -> Figure:
    """Distribution over routed experts (every layer x expert x projection) of `metric`, one
    box per run, one panel per recipe: do QAT-trained experts quantize better than the same
    experts trained in BF16? Input: `workbench.track.experts.final_expert_errors`."""
    Figure = _figure_class()
    if df.empty:  # no run of the group exported final weights: say so in the picture
        df = pd.DataFrame(columns=["run", "recipe", metric])
    for col in ("run", "recipe", metric):
        if col not in df.columns:
            raise KeyError(f"plot_expert_errors: column {col!r} missing "
                           f"(columns: {list(df.columns)})")
    recipes = list(dict.fromkeys(df["recipe"]))
    fig = Figure(figsize=(max(4.0, 3.2 * len(recipes)) + 2.0, 4.0), layout="constrained")
    if not recipes:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no exported final weights", ha="center", va="center")
        return fig
    axes = fig.subplots(1, len(recipes), squeeze=False, sharey=True)[0]
    for ax, recipe in zip(axes, recipes):
        g = df[df["recipe"] == recipe]
        runs = list(dict.fromkeys(g["run"]))
        data = [pd.to_numeric(g.loc[g["run"] == r, metric], errors="coerce").dropna()
                for r in runs]
        ax.boxplot(data, showmeans=True)
        ax.set_xticks(range(1, len(runs) + 1), runs)  # `tick_labels=` needs matplotlib 3.9
        ax.set_title(str(recipe))
        ax.set_xlabel("run")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel(f"{metric} per expert weight")
    fig.suptitle(title or f"final weights: {metric} per routed expert")
    return fig
