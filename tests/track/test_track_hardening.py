"""Budgets and readers on the inputs a real run group produces when things go wrong: a final NaN,
a zero baseline, slow warm-up steps, one damaged wandb file, damaged metrics lines."""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
from track_runs import N_STEPS, curve_rows

from workbench.track import (
    FakeQuantShare,
    MetricsLineSkipped,
    StepTimeRatio,
    TokensPerSecRatio,
    ValLossWithin,
    check,
    compare,
    find_runs,
    read_metrics,
)
from workbench.train.metrics import parse_metrics_lines, truncate_metrics


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in rows])


def verdict(budget, run, baseline):
    row = check([budget], run, baseline).iloc[0]
    return None if pd.isna(row["passed"]) else bool(row["passed"]), float(row["measured"]), \
        row["detail"]


# --- ValLossWithin ------------------------------------------------------------------------------

def test_a_finished_runs_final_nan_val_loss_fails():
    """A run that reached the end of the shared schedule with a NaN validation loss: failed, not
    judged on its previous validation (that fallback is for a live run's newest row)."""
    base = frame(curve_rows())
    run = frame(curve_rows())
    last = N_STEPS - 1
    assert not math.isnan(run.loc[last, "val_loss"])  # the schedule validates the last step
    run.loc[last, "val_loss"] = math.nan
    passed, measured, detail = verdict(ValLossWithin(2.0), run, base)
    assert passed is False and math.isinf(measured) and f"step {last}" in detail
    # The same NaN in the newest row of a run still short of the schedule's end is not final.
    live = run.iloc[:15].copy()
    live.loc[14, "val_loss"] = math.nan
    passed, _, detail = verdict(ValLossWithin(2.0), live, base)
    assert passed is True and "step 9" in detail


def test_a_zero_baseline_gives_a_verdict():
    base = frame(curve_rows())
    base["val_loss"] = base["val_loss"] * 0.0
    zero = frame(curve_rows())
    zero["val_loss"] = zero["val_loss"] * 0.0
    assert verdict(ValLossWithin(2.0), zero, base)[:2] == (True, 0.0)
    passed, measured, _ = verdict(ValLossWithin(2.0), frame(curve_rows()), base)
    assert passed is False and measured == math.inf
    idle = frame(curve_rows())
    idle["step_time_s"] = 0.0
    idle["tokens_per_s"] = 0.0
    run = frame(curve_rows())
    assert verdict(StepTimeRatio(2.0), run, idle)[:2] == (False, math.inf)
    assert verdict(StepTimeRatio(2.0), idle, idle)[:2] == (True, 1.0)
    assert verdict(TokensPerSecRatio(0.5), run, idle)[:2] == (True, math.inf)


# --- warm-up steps ------------------------------------------------------------------------------

def _timed(times, column="step_time_s"):
    return pd.DataFrame({"step": range(len(times)), column: times})


def test_warm_up_steps_are_left_out_of_both_medians():
    """Run: fast warm-up, then 3 s steps; baseline: slow warm-up, then 1 s steps. Without the
    warm-up the run is 3x slower (fails 1.5x); counting the warm-up steps would make it look
    faster than the baseline (medians 2 vs 5.5) and pass."""
    run, base = _timed([1.0, 1.0, 3.0, 3.0]), _timed([10.0, 10.0, 1.0, 1.0])
    passed, measured, detail = verdict(StepTimeRatio(1.5, warmup=2), run, base)
    assert (passed, measured) == (False, 3.0) and "over 2/2 steps" in detail
    assert verdict(StepTimeRatio(1.5, warmup=0), run, base)[0] is True  # the rule matters here
    run, base = (_timed([9e3, 9e3, 1e3, 1e3], "tokens_per_s"),
                 _timed([1e3, 1e3, 4e3, 4e3], "tokens_per_s"))
    passed, measured, _ = verdict(TokensPerSecRatio(0.5, warmup=2), run, base)
    assert (passed, measured) == (False, 0.25)
    share = _timed([0.1, 0.1, 0.9, 0.9], "fake_quant_share")
    passed, measured, _ = verdict(FakeQuantShare(0.5, warmup=2), share, None)
    assert (passed, measured) == (False, 0.9)


# --- compare() with one damaged wandb run file -------------------------------------------------

def test_compare_judges_the_others_and_reports_the_corrupt_file(wandb_dir, tmp_path):
    group = find_runs(wandb_dir, group="cmp")
    root = tmp_path / "group"
    for r in group:
        for p in r.paths:
            dst = root / Path(p).relative_to(wandb_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, dst)
    bad_run = next(r for r in group if r.name == "nvfp4-s0")
    bad = root / Path(bad_run.paths[0]).relative_to(wandb_dir)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a record: its crc32 no longer matches
    bad.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="corrupt wandb run file"):
        cmp = compare(root, group="cmp")
    assert {r.name for r in cmp.runs} == {r.name for r in group} - {"nvfp4-s0"}
    assert [c.path for c in cmp.corrupt] == [str(bad)]
    judged = set(cmp.budgets["run"])
    assert {"mxfp4-s0", "nan-s0", "mxfp4-s1"} <= judged
    row = cmp.budgets[cmp.budgets["run"] == str(bad)]
    assert len(row) == 1 and bool(row["passed"].iloc[0]) is False
    assert "corrupt" in row["detail"].iloc[0]


# --- damaged metrics.jsonl lines ----------------------------------------------------------------

DAMAGED = [
    b'{"step": 1, "loss": 4.0}',
    b'{"step": 2, "loss": 3.\xff\xfe}',      # not UTF-8
    b'{"step": "abc", "loss": 3.0}',         # step of the wrong type
    b'{"step": 2.5, "loss": 3.0}',
    b'{"step": true, "loss": 3.0}',
    b'[3, 3.0]',                             # not an object
    b'{"step": 3, "loss": "high"}',          # a metric of the wrong type
    b'{"step": 3, "loss": [1, 2]}',
    b'{"loss": 3.0}',                        # no step
    b'{"step": 4, "loss": 2.0, "val_loss": null}',
    b'{"step": 5, oops}',                    # not JSON
    b'{"step": 6, "loss": 1.0}',
]


def _write_damaged(folder):
    (folder / "metrics.jsonl").write_bytes(b"\n".join(DAMAGED) + b'\n{"step": 7, "lo')


def test_reader_skips_damaged_lines_with_a_warning(tmp_path):
    _write_damaged(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = read_metrics(tmp_path)
    assert df["step"].tolist() == [1, 4, 6] and df["loss"].tolist() == [4.0, 2.0, 1.0]
    skipped = [w for w in caught if issubclass(w.category, MetricsLineSkipped)]
    assert sorted(int(str(w.message).split(":")[1]) for w in skipped) == list(range(2, 10)) + [11]
    assert all("metrics.jsonl" in str(w.message) for w in skipped)
    assert any("not UTF-8" in str(w.message) for w in skipped)


def test_resume_truncation_skips_damaged_lines_with_a_warning(tmp_path):
    _write_damaged(tmp_path)
    with pytest.warns(MetricsLineSkipped):
        truncate_metrics(tmp_path, 4)
    lines = (tmp_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what is left is clean: no more warnings
        assert [r["step"] for r in parse_metrics_lines(tmp_path / "metrics.jsonl")] == [1, 4]
