"""Matplotlib figures built from analysis and tracking data; every function returns a Figure."""

from .experts import (
                      METRIC_LABELS,
                      expert_detail,
                      expert_distribution,
                      heatmap,
                      recipe_comparison,
                      scale_histogram,
                      worst_experts,
)

__all__ = [
    "METRIC_LABELS",
    "expert_detail",
    "expert_distribution",
    "heatmap",
    "recipe_comparison",
    "scale_histogram",
    "worst_experts",
]
