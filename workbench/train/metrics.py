"""`DIR/metrics.jsonl`: one JSON object per step, appended by rank 0, truncated on resume.

The trainer's side: the writer, the line rule and the resume truncation. Readers (notebooks,
job handles, reports) use `workbench.track.read_metrics`, which parses with the same rule."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

from workbench._io import atomic_open

METRICS_FILE = "metrics.jsonl"


class MetricsLineSkipped(UserWarning):
    """A metrics.jsonl line was left out: not UTF-8, not JSON, or not a row of the schema."""


def _row_problem(row: Any) -> str | None:
    """Why `row` is not a metrics row (a JSON object with an integer `step` >= 0 and numeric,
    boolean or null values), or None if it is one."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"'step' must be an integer >= 0, got {step!r}"
    for k, v in row.items():
        if v is not None and not isinstance(v, (int, float)):  # bool is an int
            return f"{k!r} must be a number, a boolean or null, got {type(v).__name__}"
    return None


def parse_metrics_lines(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file, in order. A last line without its newline is a step
    being written (or one a kill cut short) and is left out silently; any other line that is not
    UTF-8, not JSON or not a row is left out with a MetricsLineSkipped warning naming
    file:line, so one damaged line never hides the rest of a run."""
    p = Path(path)
    data = p.read_bytes()
    lines = data.split(b"\n")
    lines = lines[:-1]  # after the last newline: b"" or a line still being written
    rows: list[dict[str, Any]] = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            why = f"not UTF-8 ({exc.reason} at byte {exc.start})"
        except (json.JSONDecodeError, RecursionError) as exc:
            why = f"not JSON ({getattr(exc, 'msg', exc)})"
        else:
            why = _row_problem(row)
            if why is None:
                rows.append(row)
                continue
        warnings.warn(f"{p}:{i}: line skipped: {why}", MetricsLineSkipped, stacklevel=2)
    return rows


def _clean(v: Any) -> Any:
    # JSON has no NaN/Inf; write null so every reader (pandas, jq) parses the line.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsWriter:
    def __init__(self, out: str | Path) -> None:
        self.path = Path(out) / METRICS_FILE
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        # Flushed every step: a SIGKILL loses at most the line being written, and a live reader
        # (the notebook's job handle) sees the curve grow.
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def truncate_metrics(out: str | Path, step: int) -> None:
    """Keep rows with step <= `step` (atomic rewrite), so a resumed curve has no duplicates."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return
    keep = [r for r in parse_metrics_lines(path) if r["step"] <= step]
    with atomic_open(path) as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
