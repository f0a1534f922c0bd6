"""Run-comparison figures draw what they are given."""

from __future__ import annotations

import io

import matplotlib
import numpy as np
import pandas as pd
import pytest
from track_runs import curve_rows

from workbench.plots.runs import plot_budgets, plot_curves
from workbench.track import LossFinite, StepTimeRatio, ValLossWithin, check

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
    fig = plot_curves(df, metric="step_time_s", val_metric=None, smooth=4)
    ax = fig.axes[0]
    assert len(ax.lines) == 3
    raw = df[df.run == "bf16"]["step_time_s"]
    np.testing.assert_allclose(ax.lines[0].get_ydata(), raw.rolling(4, min_periods=1).mean())
    with pytest.raises(KeyError, match="nope"):
        plot_curves(df, metric="nope")
    with pytest.raises(ValueError, match="smooth"):
        plot_curves(df, smooth=0)


def test_plot_budgets_table():
    base = pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in curve_rows()])
    slow = pd.DataFrame([{"step": r["step"], **r["metrics"]}
                         for r in curve_rows(scale=1.2, step_time=3.0)])
    table = check([ValLossWithin(2.0), StepTimeRatio(4.0), LossFinite("nope")], slow, base)
    fig = plot_budgets(table)
    t = fig.axes[0].tables[0]
    cells = t.get_celld()
    texts = {(r, c): cell.get_text().get_text() for (r, c), cell in cells.items()}
    passed_col = next(c for (r, c), s in texts.items() if r == 0 and s == "passed")
    assert [texts[(i, passed_col)] for i in (1, 2, 3)] == ["FAIL", "PASS", "pending"]
    assert cells[(1, 0)].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb("#ffcdd2"))
    assert _png(fig)[:4] == b"\x89PNG"
    empty = plot_budgets(table.iloc[0:0])
    assert "no budgets" in empty.axes[0].texts[0].get_text()
