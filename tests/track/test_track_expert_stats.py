"""Telemetry read back: budgets on the logged summaries, figures' data, and notebook 05 headless
on real trainer runs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from notebook_run import run_notebook
from track_runs import REPO

from workbench.plots import plot_error_growth, plot_map_difference, plot_step_heatmaps
from workbench.track import check
from workbench.track import expert_stats as es
from workbench.train import distributed
from workbench.train.config import tiny as tiny_config
from workbench.train.loop import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("telemetry group")  # a space in the path on purpose
    info = distributed.setup()
    for recipe in ("mxfp4", "nvfp4"):
        cfg = tiny_config(str(root / recipe), recipe=recipe, steps=6, batch=4, seq=32,
                          wandb="disabled", warmup=2, ckpt_every=0, val_every=3)
        train(cfg, info)
    return root


def test_budgets_read_the_logged_summaries(runs):
    t = check((es.ExpertErrorBelow(1.0), es.ExpertErrorBelow(1e-6), es.DeadExpertsAtMost(8),
               es.ChurnBelow(1.0), es.ChurnBelow(1e-9)), runs / "mxfp4")
    assert t["passed"].tolist() == [True, False, True, True, False]
    worst = es.read(runs / "mxfp4").query("step == 6")["rel_err"].max()
    assert t["measured"][0] == pytest.approx(worst)
    empty = check((es.ExpertErrorBelow(1.0),), pd.DataFrame({"step": [1], "loss": [1.0]}))
    assert pd.isna(empty["passed"][0])


def test_tables_and_figures_hold_the_data(runs):
    df = es.read(runs / "mxfp4")
    grid = es.per_expert(df, "rel_err")
    worst = df.groupby(["step", "layer", "expert"])["rel_err"].max()
    assert grid.set_index(["step", "layer", "expert"])["rel_err"].equals(worst)
    fig = plot_step_heatmaps(grid, "rel_err")
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == df["layer"].nunique()
    lo, hi = images[0].norm.vmin, images[0].norm.vmax
    assert all((im.norm.vmin, im.norm.vmax) == (lo, hi) for im in images)  # one scale
    assert lo == pytest.approx(grid["rel_err"].min()) and hi == pytest.approx(grid["rel_err"].max())
    layer0 = grid[grid["layer"] == 0].pivot(index="expert", columns="step", values="rel_err")
    np.testing.assert_array_equal(images[0].get_array(), layer0.to_numpy())

    growth = es.error_growth(df)
    bars = plot_error_growth(growth, n=3).axes[0]
    widths = sorted(p.get_width() for p in bars.patches)
    assert widths == pytest.approx(sorted(growth["growth"].nlargest(3)))
    assert bars.get_xlim()[0] != 0 or min(widths) < 0  # zoomed, not from zero

    diff = es.final_difference(es.read(runs / "mxfp4"), es.read(runs / "nvfp4"))
    m = plot_map_difference(diff, a="mxfp4", b="nvfp4")
    im = m.axes[0].images[0]
    assert im.norm.vcenter == 0 and im.norm.vmin == -im.norm.vmax
    assert math.isclose(-im.norm.vmin, diff["diff"].abs().max())


def test_notebook_05_runs_headless(runs, tmp_path):
    out = tmp_path / "05.ipynb"
    run_notebook(str(REPO / "notebooks" / "05_expert_telemetry.ipynb"), str(out),
                 parameters={"group_dir": str(runs), "max_churn": 1.0},
                 cwd=str(REPO / "notebooks"), kernel_name="python3",
                 progress_bar=False)
    import nbformat

    nb = nbformat.read(out, as_version=4)
    pngs = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
               if "image/png" in o.get("data", {}))
    assert pngs >= 5  # three heatmaps, the growth bars, the run-vs-run map
    text = "".join(o.get("data", {}).get("text/plain", "") for c in nb.cells
                   if c.cell_type == "code" for o in c.get("outputs", []))
    assert "worst expert rel_err" in text and "2 run(s) with statistics" in "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
