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
                title: str | None = None, ylabel: str | None = None,
                figsize: tuple[float, float] = (8.0, 4.5)) -> Figure:
    """One line per run of `metric` against step (solid), and `val_metric` as markers with a
    dashed line in the same colour when it was logged. `smooth` > 1 draws a trailing rolling
    mean of that many steps (solid) over the raw curve (faint, same colour, not in the legend);
    the validation curve is never smoothed."""
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
        steps, y = g.loc[ok, "step"], y[ok]
        if smooth > 1:
            ax.plot(steps, y, color=color, lw=0.8, alpha=0.3, label=f"_raw {run} {metric}")
            ax.plot(steps, y.rolling(smooth, min_periods=1).mean(), color=color, lw=1.8,
                    label=f"{run} {metric} ({smooth}-step mean)")
        else:
            ax.plot(steps, y, color=color, lw=1.5, label=f"{run} {metric}")
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
    ax.set_ylabel(ylabel or (metric if not val_metric else f"{metric} / {val_metric}"))
    ax.set_title(title or f"{metric} per run")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small", loc="best")
    return fig


VERDICT_COLOURS = {"PASS": "#2e7d32", "FAIL": "#c62828", "pending": "#9e9e9e"}


def verdict_of(passed) -> str:
    """PASS / FAIL, or "pending" for an undecided budget (None, NaN or pandas' <NA>)."""
    return "pending" if passed is None or pd.isna(passed) else ("PASS" if bool(passed) else "FAIL")


def plot_budgets(table: pd.DataFrame, *, title: str = "Budgets: measured against limit") -> Figure:
    """One panel per budget: each run's measured value as a bar (green PASS, red FAIL) against
    the budget's limit (dashed line); an undecided budget is written "pending" with the reason.

    `table`: `workbench.track.budget_chart.chart_data` (measured and limit in one display unit
    per budget, `unit` and `direction` columns) or the raw `check`/`compare` table (values as
    the budget computed them; no unit)."""
    Figure = _figure_class()
    for col in ("budget", "measured", "limit"):
        if col not in table.columns:
            raise KeyError(f"plot_budgets: column {col!r} missing "
                           f"(columns: {list(table.columns)})")
    if "verdict" not in table.columns and "passed" not in table.columns:
        raise KeyError("plot_budgets: needs a 'verdict' or 'passed' column")
    budgets = list(dict.fromkeys(table["budget"]))
    fig = Figure(figsize=(9.0, 0.6 + max(1, len(budgets)) * (0.55 + 0.35 * max(
        1, table.groupby("budget").size().max() if len(table) else 1))), layout="constrained")
    if not budgets:
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no budgets checked", ha="center", va="center")
        return fig
    axes = fig.subplots(len(budgets), 1, squeeze=False)[:, 0]
    for ax, name in zip(axes, budgets):
        g = table[table["budget"] == name].reset_index(drop=True)
        runs = [str(r) for r in g["run"]] if "run" in g.columns else [""] * len(g)
        verdicts = (list(g["verdict"]) if "verdict" in g.columns
                    else [verdict_of(p) for p in g["passed"]])
        measured = pd.to_numeric(g["measured"], errors="coerce").to_numpy(dtype=float)
        limit = pd.to_numeric(g["limit"], errors="coerce").to_numpy(dtype=float)
        ys = list(range(len(g)))[::-1]
        finite = [m for m, v in zip(measured, verdicts) if v != "pending" and math.isfinite(m)]
        lim = [x for x in limit if math.isfinite(x)]
        span = finite + lim
        hi = max(span) if span else 1.0
        lo = min(min(span), 0.0) if span else 0.0
        for y, m, v, lim_v in zip(ys, measured, verdicts, limit):
            if v == "pending" or not math.isfinite(m):
                ax.text(lo, y, "  pending", va="center", ha="left", color=VERDICT_COLOURS["pending"],
                        fontsize="small")
                continue
            ax.barh(y, m, color=VERDICT_COLOURS[v], height=0.6, label=v)
            ax.text(m, y, f" {m:.4g} ({v})", va="center", fontsize="x-small")
        for y, lim_v in zip(ys, limit):
            if math.isfinite(lim_v):
                ax.plot([lim_v, lim_v], [y - 0.4, y + 0.4], color="k", ls="--", lw=1.2)
        ax.set_yticks(ys)
        ax.set_yticklabels(runs)
        ax.set_ylim(-0.6, len(g) - 0.4)
        width = (hi - lo) or 1.0
        ax.set_xlim(lo - 0.02 * width, hi + 0.3 * width)  # room for the value labels
        unit = str(g["unit"].iloc[0]) if "unit" in g.columns else "value the budget measures"
        direction = str(g["direction"].iloc[0]) if "direction" in g.columns else ""
        lim_txt = ", ".join(f"{x:.4g}" for x in dict.fromkeys(lim))
        rule = {"max": "at most", "min": "at least"}.get(direction, "limit")
        ax.set_title(f"{name}   (limit: {rule} {lim_txt}, dashed)", fontsize="medium", loc="left")
        ax.set_xlabel(unit)
        ax.set_ylabel("run")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
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
