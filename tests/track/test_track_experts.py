"""Helpers of the per-expert section of the run-group report (the slow notebook test runs
them on real exported checkpoints)."""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pandas as pd
import pytest

from workbench.plots.runs import plot_expert_errors
from workbench.track.compare import RunData
from workbench.track.experts import (
    expert_error_summary,
    export_path,
    final_expert_errors,
    group_weight_recipes,
)

matplotlib.use("Agg")
EMPTY = pd.DataFrame({"step": []})


def _run(name, recipe, folder=None, **cfg):
    return RunData(name, EMPTY, {"recipe": recipe, **cfg}, folder=folder)


def test_group_weight_recipes():
    runs = [_run("b", "bf16"), _run("a", "mxfp4+mxfp8"), _run("c", "mxfp4", profile="floor"),
            _run("d", "nvfp4"), _run("e", "mxfp4")]
    assert group_weight_recipes(runs) == ["mxfp4:rceil", "mxfp4:floor", "nvfp4:torchao"]
    with pytest.raises(ValueError, match="no QAT weight recipe"):
        final_expert_errors([_run("b", "bf16")])


def test_export_path(tmp_path):
    assert export_path(_run("x", "bf16")) is None
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "result.json").write_text(json.dumps({"export": str(tmp_path / "elsewhere")}))
    assert export_path(_run("x", "bf16", tmp_path)) == tmp_path / "elsewhere"
    (tmp_path / "result.json").write_text("{}")
    assert export_path(_run("x", "bf16", tmp_path)) is None
    (tmp_path / "export").mkdir()
    assert export_path(_run("x", "bf16", tmp_path)) == tmp_path / "export"
    with pytest.warns(UserWarning, match="no exported checkpoint"):
        assert final_expert_errors([_run("q", "mxfp4")]).empty


def _errors():
    rng = np.random.default_rng(0)
    rows = []
    for run, base in (("bf16", 0.12), ("mxfp4", 0.10)):
        for e in range(4):
            for proj in ("gate", "up", "down"):
                rows.append({"run": run, "layer": 0, "expert": e, "proj": proj,
                             "kind": "routed", "recipe": "mxfp4:rceil",
                             "rel_err": base + 0.001 * rng.random()})
    rows[5]["rel_err"] = 0.5  # bf16, expert 1, down
    return pd.DataFrame(rows)


def test_expert_error_summary():
    df = _errors()
    s = expert_error_summary(df).set_index("run")
    assert s.loc["bf16", "max"] == 0.5 and s.loc["bf16", "worst"] == "layer 0 expert 1 down"
    mx = df[df.run == "mxfp4"]["rel_err"]
    assert s.loc["mxfp4", "mean"] == pytest.approx(mx.mean()) and s.loc["mxfp4", "min"] == mx.min()
    assert expert_error_summary(df.iloc[0:0]).empty


def test_plot_expert_errors():
    df = _errors()
    fig = plot_expert_errors(df)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["bf16", "mxfp4"]
    assert ax.get_title() == "mxfp4:rceil"
    # every box's median line sits at the median of that run's expert errors
    flat = {round(float(y[0]), 12) for y in (line.get_ydata() for line in ax.lines)
            if len(y) == 2 and y[0] == y[1]}
    for med in df.groupby("run")["rel_err"].median():
        assert round(float(med), 12) in flat
    with pytest.raises(KeyError, match="rel_err"):
        plot_expert_errors(df.drop(columns="rel_err"))
    empty = plot_expert_errors(df.iloc[0:0])
    assert "no exported" in empty.axes[0].texts[0].get_text()
