"""Tracking: a logger protocol (wandb, offline by default; a null logger), a reader for wandb
offline run files, declarative budgets, and run-group comparison.

Importing this package imports pandas but never wandb or matplotlib; those load on use.
"""

from workbench.track import expert_stats
from workbench.track.budget_chart import chart_data
from workbench.track.budgets import (
    Budget,
    BudgetWatch,
    EvalWithin,
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    PeakMemory,
    RecoveryAtLeast,
    StepTimeRatio,
    TokensPerSecRatio,
    ValKLBelow,
    ValLossWithin,
    Verdict,
    check,
    default_budgets,
    publish,
)
from workbench.track.compare import (
    Comparison,
    RunData,
    RunSourceWarning,
    UnreadableRun,
    compare,
    load_runs,
    runs_table,
)
from workbench.track.evals import (
    EvalFileError,
    GroupEval,
    group_eval,
    read_eval,
    recovery,
    recovery_table,
    results_table,
    retention,
    wide_table,
)
from workbench.track.experts import expert_error_summary, final_expert_errors
from workbench.track.metrics import BadMetricsFile, MetricsLineSkipped, as_metrics, read_metrics
from workbench.track.offline import OfflineRun, find_runs, merge_segments, read_run
from workbench.track.wandb_file import CorruptRunFile
from workbench.train.logger import (
    Logger,
    NullLogger,
    TrackingWarning,
    WandbConfig,
    WandbLogger,
    make_logger,
)

__all__ = [
    "BadMetricsFile",
    "Budget",
    "BudgetWatch",
    "Comparison",
    "CorruptRunFile",
    "EvalFileError",
    "EvalWithin",
    "FakeQuantShare",
    "GroupEval",
    "Logger",
    "LossFinite",
    "MetricsLineSkipped",
    "NoDivergence",
    "NullLogger",
    "OfflineRun",
    "PeakMemory",
    "RecoveryAtLeast",
    "RunData",
    "RunSourceWarning",
    "StepTimeRatio",
    "TokensPerSecRatio",
    "TrackingWarning",
    "UnreadableRun",
    "ValKLBelow",
    "ValLossWithin",
    "Verdict",
    "WandbConfig",
    "WandbLogger",
    "as_metrics",
    "chart_data",
    "check",
    "compare",
    "default_budgets",
    "expert_error_summary",
    "expert_stats",
    "final_expert_errors",
    "find_runs",
    "group_eval",
    "load_runs",
    "make_logger",
    "merge_segments",
    "publish",
    "read_eval",
    "read_metrics",
    "read_run",
    "recovery",
    "recovery_table",
    "results_table",
    "retention",
    "runs_table",
    "wide_table",
]
