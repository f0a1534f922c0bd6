"""Per-step metrics as plain DataFrames, from the trainer's metrics.jsonl or a wandb run.

Budgets and comparisons work on one shape only: a DataFrame with an integer `step` column
(sorted, one row per step) and whatever metric columns were logged (`loss`, `val_loss`,
`step_time_s`, `tokens_per_s`, ...). `as_metrics` turns every source into that shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from workbench.train.metrics import METRICS_FILE, MetricsLineSkipped, parse_metrics_lines

if TYPE_CHECKING:
    from workbench.track.offline import OfflineRun


__all__ = ["METRICS_FILE", "BadMetricsFile", "MetricsLineSkipped", "as_metrics", "read_metrics"]


class BadMetricsFile(ValueError):
    """The metrics file itself cannot be read (its lines are judged one by one: a bad line is
    skipped with a MetricsLineSkipped warning)."""


def read_metrics(path: str | Path, *, missing_ok: bool = False) -> pd.DataFrame:
    """The one metrics reader: DIR/metrics.jsonl (or the file itself) as a frame sorted by
    step, one row per step (a step logged twice, e.g. re-done after a resume, keeps its latest
    values). A last line without its newline is a step being written right now and is skipped,
    so this is safe on a live run; a damaged line (not UTF-8, not JSON, a non-integer step, a
    non-numeric value) is skipped with a MetricsLineSkipped warning naming file:line (the
    trainer's resume truncation reads the file with the same rule,
    workbench.train.metrics.parse_metrics_lines). No file raises FileNotFoundError, unless
    `missing_ok`: then a run that has not logged yet is an empty frame (columns step, loss), so
    `JobHandle.metrics()` can be polled from submission on."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        if missing_ok:
            return pd.DataFrame({"step": pd.Series([], dtype="int64"),
                                 "loss": pd.Series([], dtype="float64")})
        raise FileNotFoundError(f"{p}: no metrics file")
    try:
        rows = parse_metrics_lines(p)
    except OSError as exc:
        raise BadMetricsFile(f"{p}: cannot read ({exc})") from exc
    return as_metrics(pd.DataFrame(rows), source=str(p))


def as_metrics(obj: pd.DataFrame | OfflineRun | str | Path, source: str = "") -> pd.DataFrame:
    """Normalize a metrics source to a frame with a sorted, unique integer `step` column."""
    if isinstance(obj, (str, Path)):
        return read_metrics(obj)
    if not isinstance(obj, pd.DataFrame):  # an OfflineRun; avoid importing wandb-side code
        source = source or f"wandb run {getattr(obj, 'id', '?')}"
        obj = obj.history
    df = obj.copy()
    if "step" not in df.columns:
        if "_step" not in df.columns:
            if df.empty:
                return pd.DataFrame({"step": pd.Series([], dtype="int64")})
            raise KeyError(f"{source or 'metrics'}: no 'step' or '_step' column "
                           f"(columns: {list(df.columns)})")
        df["step"] = df["_step"]
    df = df[df["step"].notna()]
    df["step"] = df["step"].astype("int64")
    if df["step"].duplicated().any():
        # Several rows for one step (metrics and validation logged apart, or a step redone
        # after a resume): per column, the latest value logged for that step wins.
        df = df.groupby("step", sort=False).last().reset_index()
    return df.sort_values("step", kind="stable").reset_index(drop=True)
