"""Downstream evaluation figure: each model's score on each task and metric, with lm-eval's
standard error, BF16 / PTQ / QAT models told apart by colour.

Input: the results table of `workbench.track.evals` (`results_table`, `GroupEval.results`):
columns task, metric, model, role, value, stderr and higher_is_better.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from .runs import _figure_class

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ROLE_COLORS = {"bf16": "0.55", "ptq": "C1", "qat": "C0"}
ROLE_NAMES = {"bf16": "BF16", "ptq": "PTQ", "qat": "QAT"}
# What the common lm-eval metrics measure, for the axis label (the value's unit).
UNITS = {"acc": "share of documents", "acc_norm": "share of documents",
         "exact_match": "share of documents", "acc_mutual_info": "share of documents",
         "f1": "F1 score", "mcc": "Matthews correlation",
         "brier_score": "mean squared error of choice probabilities"}


def _unit(metric: str) -> str:
    return UNITS.get(metric.split(",")[0], "as lm-eval reports it")


def plot_eval(results: pd.DataFrame, *, metrics: list[str] | None = None,
              title: str | None = "downstream evaluation: score ± 1 standard error (lm-eval)",
              panel_width: float = 3.4) -> Figure:
    """One panel per task x metric (or only `metrics`), one bar per model in table order, the
    error bar one standard error (none where lm-eval computed none)."""
    Figure = _figure_class()
    for col in ("task", "metric", "model", "role", "value", "stderr"):
        if col not in results.columns:
            raise KeyError(f"plot_eval: column {col!r} missing (columns: {list(results.columns)})")
    df = results if metrics is None else results[results["metric"].isin(metrics)]
    panels = list(dict.fromkeys(zip(df["task"], df["metric"])))
    if not panels:
        raise ValueError("plot_eval: no results to draw" +
                         (f" for metrics {metrics}" if metrics is not None else ""))
    fig = Figure(figsize=(max(4.5, panel_width * len(panels)), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (task, metric) in zip(axes, panels):
        g = df[(df["task"] == task) & (df["metric"] == metric)]
        x = list(range(len(g)))
        err = [0.0 if (isinstance(s, float) and math.isnan(s)) else s for s in g["stderr"]]
        ax.bar(x, g["value"], yerr=err, capsize=3,
               color=[ROLE_COLORS.get(r, "C7") for r in g["role"]], edgecolor="black", lw=0.5)
        ax.set_xticks(x, list(g["model"]), rotation=30, ha="right", fontsize=8)
        ax.set_title(task, fontsize=10)
        hib = g["higher_is_better"].dropna() if "higher_is_better" in g.columns else []
        better = "" if not len(hib) else (" — higher is better" if bool(hib.iloc[0])
                                          else " — lower is better")
        ax.set_ylabel(f"{metric} ({_unit(metric)}){better}", fontsize=8)
        ax.set_xlabel("model")
        ax.grid(axis="y", alpha=0.3)
    from matplotlib.patches import Patch  # matplotlib is there: _figure_class imported it

    handles = [Patch(facecolor=c, edgecolor="black", label=ROLE_NAMES[r])
               for r, c in ROLE_COLORS.items() if r in set(df["role"])]
    fig.legend(handles=handles, loc="outside upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
