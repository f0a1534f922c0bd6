"""Run-comparison figures draw what they are given."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pandas as pd
import pytest
from track_runs import curve_rows

from workbench.plots.runs import plot_budgets, plot_curves
from workbench.track import FakeQuantShare, LossFinite, StepTimeRatio, ValLossWithin, check
from workbench.track.budget_chart import chart_data

matplotlib.use("Agg")


def _curves():
    parts = []
    for name, scale in (("bf16", 1.0), ("mxfp4", 1.01), ("nvfp4", 1.2)):
        df = pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in curve_rows(scale=scale)])
        parts.append(df.assign(run=name))
    return pd.concat(parts, ignore_index=True)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def test_plot_curves_lines_and_labels():
    df = _curves()
    fig = plot_curves(df, logx=True)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.lines]
    assert labels == [f"{r} {m}" for r in ("bf16", "mxfp4", "nvfp4") for m in ("loss", "val_loss")]
    train = ax.lines[2]  # mxfp4 train loss, raw
    np.testing.assert_allclose(train.get_ydata(), df[df.run == "mxfp4"]["loss"].to_numpy())
    val = ax.lines[3]
    np.testing.assert_array_equal(val.get_xdata(), [4, 9, 14, 19, 24, 29, 34, 39])
    assert ax.lines[2].get_color() == ax.lines[3].get_color()
    assert ax.get_xscale() == "symlog" and ax.get_xlabel() == "step"
    assert ax.get_legend() is not None
    assert _png(fig)[:4] == b"\x89PNG"


def test_plot_curves_smoothing_and_errors():
    df = _curves()
    fig = plot_curves(df, metric="step_time_s", val_metric=None, smooth=4, ylabel="step time (s)")
    ax = fig.axes[0]
    assert len(ax.lines) == 6  # raw + smoothed per run
    raw = df[df.run == "bf16"]["step_time_s"]
    faint, smooth = ax.lines[0], ax.lines[1]
    np.testing.assert_allclose(faint.get_ydata(), raw)
    np.testing.assert_allclose(smooth.get_ydata(), raw.rolling(4, min_periods=1).mean())
    assert faint.get_alpha() < 0.5 and (smooth.get_alpha() or 1.0) == 1.0
    assert faint.get_color() == smooth.get_color()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"{r} step_time_s (4-step mean)" for r in ("bf16", "mxfp4", "nvfp4")]
    assert ax.get_ylabel() == "step time (s)" and ax.get_xlabel() == "step"
    with pytest.raises(KeyError, match="nope"):
        plot_curves(df, metric="nope")
    with pytest.raises(ValueError, match="smooth"):
        plot_curves(df, smooth=0)


def _budget_table():
    base = pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in curve_rows()])
    slow = pd.DataFrame([{"step": r["step"], **r["metrics"]}
                         for r in curve_rows(scale=1.2, step_time=3.0)])
    slow["fake_quant_share"] = 0.2
    budgets = [ValLossWithin(2.0), StepTimeRatio(4.0), LossFinite("nope"), FakeQuantShare(0.5)]
    return check(budgets, slow, base), budgets


def test_budget_chart_data_units_and_pending():
    table, budgets = _budget_table()
    data = chart_data(table, budgets)
    assert list(data.verdict) == ["FAIL", "PASS", "pending", "PASS"]
    share = data[data.budget == FakeQuantShare(0.5).name].iloc[0]
    # a share is shown in percent like the val-loss gap, never as a fraction next to percents
    assert share.measured == pytest.approx(20.0) and share.limit == pytest.approx(50.0)
    assert share.unit == "% of step time"
    gap = data[data.budget == ValLossWithin(2.0).name].iloc[0]
    assert gap.unit.startswith("%") and gap.limit == 2.0
    assert gap.measured == pytest.approx(table.measured.iloc[0])
    with pytest.raises(KeyError, match="no budget object"):
        chart_data(table, budgets[:1])


def test_plot_budgets_measured_against_limit():
    table, budgets = _budget_table()
    data = chart_data(table, budgets).assign(run="qat")
    fig = plot_budgets(data)
    axes = fig.axes
    assert len(axes) == 4
    for ax, row in zip(axes, data.itertuples()):
        assert ax.get_xlabel() == row.unit and ax.get_ylabel() == "run"
        bars = [p for p in ax.patches]
        limit_lines = [ln for ln in ax.lines if ln.get_linestyle() == "--"]
        assert [ln.get_xdata()[0] for ln in limit_lines] == [pytest.approx(row.limit)]
        if row.verdict == "pending":
            assert not bars and any("pending" in t.get_text() for t in ax.texts)
            continue
        assert len(bars) == 1 and bars[0].get_width() == pytest.approx(row.measured)
        colour = {"PASS": "#2e7d32", "FAIL": "#c62828"}[row.verdict]
        assert bars[0].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb(colour))
        lo, hi = ax.get_xlim()
        assert lo <= min(row.measured, row.limit, 0) and hi >= max(row.measured, row.limit)
    assert not fig.axes[0].tables  # a chart, not the table drawn as an image
    assert _png(fig)[:4] == b"\x89PNG"
    empty = plot_budgets(data.iloc[0:0])
    assert "no budgets" in empty.axes[0].texts[0].get_text()
    raw = plot_budgets(table)  # the raw table draws too, verdicts from `passed`
    assert any("pending" in t.get_text() for t in raw.axes[2].texts)
