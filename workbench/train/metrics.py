"""`DIR/metrics.jsonl`: one JSON object per step, appended by rank 0, truncated on resume."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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


def read_metrics(out: str | Path) -> list[dict[str, Any]]:
    """Every complete line; a torn last line (killed mid-write) is skipped."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_metrics(out: str | Path, step: int) -> None:
    """Keep rows with step <= `step` (atomic rewrite), so a resumed curve has no duplicates."""
    path = Path(out) / METRICS_FILE
    if not path.is_file():
        return
    keep = [r for r in read_metrics(out) if int(r.get("step", -1)) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
