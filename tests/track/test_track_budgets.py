"""Budgets give the verdict known by construction of the metrics."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from track_runs import N_STEPS, curve_rows, find_group_run

from workbench.track import (
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    PeakMemory,
    StepTimeRatio,
    TokensPerSecRatio,
    ValLossWithin,
    check,
    default_budgets,
)


def frame(rows) -> pd.DataFrame:
    return pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in rows])


BASE = frame(curve_rows())


def verdict(budget, run, baseline=BASE):
    t = check([budget], run, baseline)
    assert list(t.columns) == ["budget", "measured", "limit", "passed", "detail"]
    assert str(t["passed"].dtype) == "boolean"
    row = t.iloc[0].to_dict()
    row["passed"] = None if pd.isna(row["passed"]) else bool(row["passed"])
    return SimpleNamespace(**row)


@pytest.mark.parametrize("scale,passed", [(1.01, True), (1.019, True), (1.021, False),
                                          (1.20, False), (0.9, True)])
def test_val_loss_within(scale, passed):
    v = verdict(ValLossWithin(2.0), frame(curve_rows(scale=scale)))
    assert bool(v.passed) is passed
    assert v.measured == pytest.approx(100 * (scale - 1), abs=1e-9)
    assert f"step {N_STEPS - 1}" in v.detail  # the last validation step


def test_val_loss_at_step_and_partial_history():
    run = frame(curve_rows(scale=1.05))
    v = verdict(ValLossWithin(10.0, at_step=22), run)
    assert v.passed and "step 19" in v.detail  # last validation at or before 22
    v = verdict(ValLossWithin(10.0, at_step=100), run)
    assert v.passed is None and "< 100" in v.detail
    # a live run: 15 rows, its newest row (14) not yet carrying its validation loss
    live = run.iloc[:15].copy()
    live.loc[14, "val_loss"] = np.nan
    v = verdict(ValLossWithin(2.0), live)
    assert v.passed is False and "step 9" in v.detail and v.measured == pytest.approx(5.0)
    v = verdict(ValLossWithin(2.0), run, baseline=None)
    assert v.passed is None and "no baseline" in v.detail


def test_val_loss_nan_fails():
    v = verdict(ValLossWithin(2.0), frame(curve_rows(nan_from=25)))
    assert v.passed is False and math.isinf(v.measured)


def test_loss_finite():
    v = verdict(LossFinite(), frame(curve_rows(nan_from=25)))
    assert v.passed is False and v.measured == N_STEPS - 25 and "step 25" in v.detail
    assert verdict(LossFinite(), BASE).passed
    # validation loss is logged every 5 steps: NaN cells are "not measured", inf is not
    assert verdict(LossFinite("val_loss", nan_means_missing=True), BASE).passed
    inf_val = BASE.copy()
    inf_val.loc[9, "val_loss"] = math.inf
    v = verdict(LossFinite("val_loss", nan_means_missing=True), inf_val)
    assert v.passed is False and "step 9" in v.detail
    assert verdict(LossFinite("nope"), BASE).passed is None


def test_no_divergence():
    assert verdict(NoDivergence(window=5, factor=1.5), BASE).passed
    jump = BASE.copy()
    jump["loss"] = np.where(jump["step"] < 30, 1.0, 3.0)  # tripled from step 30 on
    v = verdict(NoDivergence(window=5, factor=1.5), jump)
    assert v.passed is False and v.measured == pytest.approx(3.0) and "step 34" in v.detail
    assert verdict(NoDivergence(window=5, factor=3.5), jump).passed
    v = verdict(NoDivergence(window=5), frame(curve_rows(nan_from=25)))
    assert v.passed is False and math.isinf(v.measured)
    assert verdict(NoDivergence(window=50), BASE).passed is None  # fewer steps than window


def test_step_time_and_throughput():
    slow = frame(curve_rows(step_time=3.0))
    v = verdict(StepTimeRatio(2.0), slow)
    assert v.passed is False and v.measured == pytest.approx(3.0)
    assert verdict(StepTimeRatio(3.5), slow).passed
    v = verdict(TokensPerSecRatio(0.5), slow)
    assert v.passed is False and v.measured == pytest.approx(1 / 3)
    assert verdict(TokensPerSecRatio(0.5), frame(curve_rows(step_time=1.5))).passed
    # warm-up steps (10x slower by construction) are left out of the median
    v = verdict(StepTimeRatio(2.0, warmup=0), frame(curve_rows(step_time=3.0, n=3)),
                frame(curve_rows(n=3)))
    assert v.measured == pytest.approx(3.0)
    assert verdict(StepTimeRatio(2.0), slow.iloc[:2]).passed is None


def test_fake_quant_share_and_memory():
    assert verdict(FakeQuantShare(0.5), frame(curve_rows(fq_share=0.2))).passed
    v = verdict(FakeQuantShare(0.5), frame(curve_rows(fq_share=0.6)))
    assert v.passed is False and v.measured == pytest.approx(0.6)
    assert verdict(FakeQuantShare(0.5), BASE).passed is None  # not logged
    mem = BASE.assign(peak_mem_gib=np.linspace(1.0, 5.0, N_STEPS))
    v = verdict(PeakMemory(4.0), mem)
    assert v.passed is False and v.measured == 5.0 and f"step {N_STEPS - 1}" in v.detail
    assert verdict(PeakMemory(6.0), mem).passed


def test_budget_configs_are_validated():
    for bad in (lambda: ValLossWithin(-1), lambda: ValLossWithin(1, at_step=-2),
                lambda: FakeQuantShare(1.5), lambda: NoDivergence(window=0),
                lambda: StepTimeRatio(0), lambda: PeakMemory(math.nan)):
        with pytest.raises(ValueError):
            bad()
    assert len({b.name for b in default_budgets()}) == len(default_budgets())


def test_verdicts_published_to_wandb(wandb_dir):
    run = find_group_run(wandb_dir, "judge", "judged")
    s = run.summary
    val = s["budget/val_loss within 2% of baseline @ last"]
    assert val["passed"] is False and val["measured"] == pytest.approx(20.0) and val["limit"] == 2
    assert s["budget/step time <= 2x baseline"]["measured"] == pytest.approx(3.0)
    assert s["budget/all_passed"] is False
    # published twice, alerted once per violated budget
    assert sorted(a["title"] for a in run.alerts) == [
        "budget violated: step time <= 2x baseline",
        "budget violated: val_loss within 2% of baseline @ last"]
    assert all(a["text"].startswith("judged: ") for a in run.alerts)


def test_expert_budget_configs_are_validated():
    from workbench.track.expert_stats import ChurnBelow, DeadExpertsAtMost, ExpertErrorBelow

    for bad, field in ((lambda: ExpertErrorBelow(0), "limit"),
                       (lambda: ExpertErrorBelow(math.inf), "limit"),
                       (lambda: DeadExpertsAtMost(-1), "count"),
                       (lambda: DeadExpertsAtMost(1.5), "count"),
                       (lambda: ChurnBelow(5.0), "limit"),  # 5%, written as a percentage
                       (lambda: ChurnBelow(math.nan), "limit"),
                       (lambda: ChurnBelow(0.25, warmup=-1), "warmup")):
        with pytest.raises(ValueError, match=field):
            bad()
    # the values a user sets are accepted
    ExpertErrorBelow(0.5), DeadExpertsAtMost(0), ChurnBelow(0.25, warmup=10)


def test_warmup_is_validated():
    for cls in (StepTimeRatio, TokensPerSecRatio, FakeQuantShare):
        with pytest.raises(ValueError, match="warmup"):
            cls(0.5, warmup=-1)
