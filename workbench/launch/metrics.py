"""Read a run's metrics.jsonl (written by the trainer, one JSON object per step) while it grows."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsFormatError(ValueError):
    """metrics.jsonl holds a line that is not a JSON object with an integer 'step'."""


def read_metrics(path: str | Path):
    """DataFrame sorted by step, one row per step; when a step appears twice (a resumed run
    re-logging the steps after its last checkpoint) the later line wins. A last line without its
    newline is skipped: the trainer may be writing it right now. Empty frame if there is no file."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        return pd.DataFrame(columns=["step", "loss"])
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # partial line in flight
    rows: dict[int, dict] = {}
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MetricsFormatError(f"{path}:{no}: not JSON ({e.msg}): {line[:80]!r}") from e
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsFormatError(f"{path}:{no}: expected an object with an integer 'step', "
                                     f"got {line[:80]!r}")
        rows.pop(row["step"], None)  # re-insert so dict order follows the latest write
        rows[row["step"]] = row
    if not rows:
        return pd.DataFrame(columns=["step", "loss"])
    return pd.DataFrame(list(rows.values())).sort_values("step", kind="stable").reset_index(drop=True)
