"""JobHandle.metrics' reader (workbench.track.read_metrics, missing_ok): last entry per step wins,
a line in flight is skipped, a run that has not logged yet is an empty frame, bad lines are
skipped and named."""

from __future__ import annotations

import json

import pytest

from workbench.track.metrics import MetricsLineSkipped
from workbench.track.metrics import read_metrics as _read_metrics


def read_metrics(path):
    return _read_metrics(path, missing_ok=True)  # what JobHandle.metrics() calls


def test_resumed_run_reads_as_one_curve(tmp_path):
    p = tmp_path / "metrics.jsonl"
    first = [{"step": s, "loss": 10.0 - s, "run": 1} for s in range(1, 7)]
    # Resumed from step 4: steps 5 and 6 are logged again, then the run continues.
    second = [{"step": s, "loss": 20.0 - s, "run": 2} for s in range(5, 10)]
    p.write_text("".join(json.dumps(r) + "\n" for r in first + second))
    df = read_metrics(tmp_path)
    assert df["step"].tolist() == list(range(1, 10))
    want = {r["step"]: r for r in first} | {r["step"]: r for r in second}
    assert df["loss"].tolist() == [want[s]["loss"] for s in range(1, 10)]
    assert df["run"].tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 2]


def test_partial_last_line_is_skipped_and_no_file_is_empty(tmp_path):
    empty = read_metrics(tmp_path)
    assert empty.empty and {"step", "loss"} <= set(empty.columns)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')
    df = read_metrics(tmp_path)
    assert df["step"].tolist() == [1] and df["loss"].tolist() == [2.5]


@pytest.mark.parametrize("bad", ['{"step": 1, "loss": 1}\nnot json\n', '[1, 2]\n'])
def test_bad_lines_are_skipped_naming_file_and_line(tmp_path, bad):
    (tmp_path / "metrics.jsonl").write_text(bad)
    with pytest.warns(MetricsLineSkipped, match=r"metrics\.jsonl:\d"):
        df = read_metrics(tmp_path)
    assert df["step"].tolist() == ([1] if bad.startswith("{") else [])
