"""Matplotlib figures built from analysis and tracking tables; every function returns a Figure.

Plots take DataFrames (or plain result objects) and never import ``workbench.analysis``; the
code that runs an analysis and picks its figures lives above both, in ``workbench.report``.
"""

from .compare import compare_extremes, compare_heatmap, compare_scatter
from .experts import (
    METRIC_LABELS,
    expert_detail,
    expert_distribution,
    heatmap,
    recipe_comparison,
    recipe_heatmaps,
    scale_histogram,
    value_range,
    worst_experts,
)

__all__ = [
    "METRIC_LABELS",
    "compare_extremes",
    "compare_heatmap",
    "compare_scatter",
    "expert_detail",
    "expert_distribution",
    "heatmap",
    "recipe_comparison",
    "recipe_heatmaps",
    "scale_histogram",
    "value_range",
    "worst_experts",
]
