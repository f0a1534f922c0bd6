"""Matplotlib figures built from analysis and tracking tables.

One naming pattern: every figure function is `plot_*` and returns a matplotlib Figure (so
notebooks, the CLI and wandb show the same pictures). Plots take DataFrames (or plain result
objects) and never import ``workbench.analysis``; the code that runs an analysis and picks its
figures lives above both, in ``workbench.report``.
"""

from .compare import plot_compare_extremes, plot_compare_heatmap, plot_compare_scatter
from .eval import plot_eval
from .expert_stats import plot_error_growth, plot_map_difference, plot_step_heatmaps
from .experts import (
    METRIC_LABELS,
    plot_expert_detail,
    plot_expert_distribution,
    plot_heatmap,
    plot_recipe_comparison,
    plot_recipe_heatmaps,
    plot_scale_histogram,
    plot_worst_experts,
    value_range,
)
from .runs import plot_budgets, plot_curves, plot_expert_errors

__all__ = [
    "METRIC_LABELS",
    "plot_budgets",
    "plot_compare_extremes",
    "plot_compare_heatmap",
    "plot_compare_scatter",
    "plot_curves",
    "plot_error_growth",
    "plot_eval",
    "plot_expert_detail",
    "plot_expert_distribution",
    "plot_expert_errors",
    "plot_heatmap",
    "plot_map_difference",
    "plot_recipe_comparison",
    "plot_recipe_heatmaps",
    "plot_scale_histogram",
    "plot_step_heatmaps",
    "plot_worst_experts",
    "value_range",
]
