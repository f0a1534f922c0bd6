"""A run's live metrics: the trainer's metrics.jsonl through the one reader, workbench.track's."""

from __future__ import annotations

from pathlib import Path


def read_metrics(path: str | Path):
    """DataFrame sorted by step, one row per step (for a step logged twice, e.g. re-done after a
    resume, the latest value wins); a last line still being written is skipped. Unlike
    `workbench.track.metrics.read_metrics`, a run that has not logged yet gives an empty frame
    (columns step, loss), so notebooks can poll from submission on."""
    import pandas as pd

    from workbench.track.metrics import read_metrics as _read

    p = Path(path)
    if (p / "metrics.jsonl").is_file() or p.is_file():
        return _read(p)
    return pd.DataFrame({"step": pd.Series([], dtype="int64"),
                         "loss": pd.Series([], dtype="float64")})
