"""Tracking: a logger protocol (wandb, offline by default; a null logger), a reader for wandb
offline run files, declarative budgets, and run-group comparison.

Importing this package imports pandas but never wandb or matplotlib; those load on use.
"""

from workbench.track.budgets import (
    Budget,
    BudgetWatch,
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    PeakMemory,
    StepTimeRatio,
    TokensPerSecRatio,
    ValLossWithin,
    Verdict,
    check,
    default_budgets,
    publish,
)
from workbench.track.compare import Comparison, RunData, compare, load_runs, runs_table
from workbench.train.logger import (
    Logger,
    NullLogger,
    TrackingWarning,
    WandbConfig,
    WandbLogger,
    make_logger,
)
from workbench.track.metrics import BadMetricsFile, MetricsLineSkipped, as_metrics, read_metrics
from workbench.track.offline import OfflineRun, find_runs, merge_segments, read_run
from workbench.track.wandb_file import CorruptRunFile

__all__ = [
    "BadMetricsFile", "Budget", "BudgetWatch", "Comparison", "CorruptRunFile", "FakeQuantShare",
    "Logger", "LossFinite", "MetricsLineSkipped", "NoDivergence", "NullLogger", "OfflineRun", "PeakMemory", "RunData",
    "StepTimeRatio", "TokensPerSecRatio", "TrackingWarning", "ValLossWithin", "Verdict",
    "WandbConfig", "WandbLogger", "as_metrics", "check", "compare", "default_budgets",
    "find_runs", "load_runs", "make_logger", "merge_segments", "publish", "read_metrics",
    "read_run", "runs_table",
]
