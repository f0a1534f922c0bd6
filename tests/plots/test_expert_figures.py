"""What the inspection and comparison figures hold: colour limits, norms, axis ranges, bar
heights (the figures' data, not pixels), and the lossless case named instead of drawn."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "analysis"))
from analysis_ckpts import moe_weights, write_dense, write_mxfp4

from workbench import plots, report
from workbench.analysis import (
    candidate_errors,
    compare,
    expert_detail,
    stored_vs_recipes,
)
from workbench.analysis.inspect import inspect_checkpoint
from workbench.checkpoint import open_checkpoint
from workbench.formats import quantize

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    t = tmp_path_factory.mktemp("figs")
    sd = moe_weights(layers=3, experts=4)
    return {"ref": write_dense(t / "ref", sd), "packed": write_mxfp4(t / "packed", sd, "mxfp4:rceil")}


@pytest.fixture(scope="module")
def tables(ck):
    return candidate_errors(open_checkpoint(ck["ref"]), ["mxfp4:floor", "nvfp4"], progress=False)


def _images(fig):
    return [im for ax in fig.axes for im in ax.get_images()]


def test_one_colour_scale_across_recipes(tables):
    df = tables.experts
    routed = df[df.kind == "routed"]
    fig = plots.plot_recipe_heatmaps(df, "rel_err")
    ims = _images(fig)
    assert len(ims) == 2 * 3  # recipes x projections
    lims = {im.get_clim() for im in ims}
    assert lims == {(routed.rel_err.min(), routed.rel_err.max())}
    # each panel holds its recipe's values
    top = ims[0].get_array()
    want = routed[(routed.recipe == "mxfp4:floor") & (routed.proj == "gate")].pivot_table(
        index="layer", columns="expert", values="rel_err").to_numpy()
    np.testing.assert_allclose(np.ma.getdata(top), want)
    assert len(fig.axes) == 7 and "relative error" in fig.axes[-1].get_ylabel()


def test_cli_heatmaps_share_limits(ck):
    res = inspect_checkpoint(open_checkpoint(ck["ref"]), ["mxfp4:floor", "nvfp4"], progress=False)
    figs = report.inspect_figures(res)
    heat = [f for k, f in figs.items() if k.startswith("heatmap_")]
    assert len(heat) == 2
    clims = {im.get_clim() for f in heat for im in _images(f)}
    routed = res.tables.experts[res.tables.experts.kind == "routed"]
    assert clims == {(routed.rel_err.min(), routed.rel_err.max())}


def test_flat_values_get_a_proper_range():
    df = pd.DataFrame([{"layer": 1, "expert": e, "proj": p, "kind": "routed", "recipe": "r",
                        "rel_err": 0.14} for e in range(3) for p in ("gate", "up", "down")])
    lo, hi = _images(plots.plot_heatmap(df, "rel_err", recipe="r"))[0].get_clim()
    assert lo < 0.14 < hi and hi - lo > 0.01
    assert plots.value_range([0.0, 0.0]) == (0.0, 1.0)
    assert plots.value_range([np.inf, np.nan]) == (0.0, 1.0)


def test_worst_bars_are_zoomed(tables):
    df = tables.experts
    fig = plots.plot_worst_experts(df, "rel_err", recipe="mxfp4:floor", n=10)
    ax = fig.axes[0]
    widths = sorted(p.get_width() for p in ax.patches)
    top = df[(df.kind == "routed") & (df.recipe == "mxfp4:floor")].rel_err.nlargest(10)
    np.testing.assert_allclose(widths, sorted(top))
    lo, hi = ax.get_xlim()
    assert 0 < lo < min(widths) and hi > max(widths)
    assert "zoomed" in ax.get_xlabel()


def test_scale_histogram_is_a_fraction_of_elements(ck):
    # the same weights as MXFP4 (32-element blocks) and NVFP4 (16): block counts differ 2x
    t = candidate_errors(open_checkpoint(ck["ref"]), ["mxfp4", "nvfp4"], progress=False)
    s = t.scales[t.scales.kind == "routed"]
    blocks = s.groupby("recipe")["count"].sum()
    assert blocks["nvfp4:torchao"] == 2 * blocks["mxfp4:rceil"]
    fig = plots.plot_scale_histogram(t.scales)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "fraction of elements"
    per_recipe = {}
    for c in ax.containers:
        per_recipe[c.get_label().split(" ")[0]] = sum(p.get_height() for p in c.patches)
    assert per_recipe == {"mxfp4:rceil": pytest.approx(1.0), "nvfp4:torchao": pytest.approx(1.0)}


def test_lossless_grid_is_named_not_drawn(ck):
    pk = open_checkpoint(ck["packed"])
    # decoded MXFP4 values lie on the MX grid (any MX rule re-quantizes them exactly); NVFP4's
    # per-tensor scale does not reproduce them
    res = inspect_checkpoint(pk, ["mxfp4:rceil", "nvfp4"], progress=False)
    assert "mxfp4:rceil reproduces exactly" in res.summary
    assert "worst" not in res.summary.split("mxfp4:rceil reproduces exactly")[1].split("\n\n")[0]
    assert "worst 5 routed experts for nvfp4:torchao" in res.summary
    figs = report.inspect_figures(res)
    assert not [k for k in figs if "mxfp4_rceil" in k]
    assert "heatmap_rel_err_nvfp4:torchao".replace(":", "_") in figs
    assert "recipes_sqnr_db" not in figs  # one lossy recipe: nothing to compare
    assert report.lossless_lines(res.tables.experts) == [
        "mxfp4:rceil reproduces exactly: rel_err 0 on all 24 routed weights (nothing to draw)"]
    # all exact: no error figure at all
    only = inspect_checkpoint(pk, ["mxfp4:rceil"], progress=False)
    assert set(report.inspect_figures(only)) <= {"scale_exponents"}
    # the expert view says "exact" instead of drawing one spike at 0
    d = expert_detail(pk, 1, 0, "gate", "mxfp4:rceil")
    fig = plots.plot_expert_detail(d)
    assert not fig.axes[0].patches and "exactly" in fig.axes[0].texts[0].get_text()


def test_picker_never_compares_stored_with_itself(ck):
    pk, ref = open_checkpoint(ck["packed"]), open_checkpoint(ck["ref"])
    with_ref = report.picker_choices(pk, ["mxfp4:floor"], reference=ref)
    assert with_ref[0] == ("stored vs reference", ("reference", None))
    without = report.picker_choices(pk, ["mxfp4:floor"])
    assert without[0] == ("mxfp4:floor vs stored (decoded)", ("stored", "mxfp4:floor"))
    assert all(src != ("stored", None) for _, src in with_ref + without)
    with pytest.raises(ValueError, match="nothing to compare"):
        report.picker_choices(pk, [])
    # the default with a reference really measures against it (rel err of the stored grid)
    d = report.reference_detail(pk, ref, 1, 0, "gate")
    t = stored_vs_recipes(pk, ["mxfp4:rceil"], progress=False).experts
    assert d.metrics["rel_err"] > 0.05 and (t.rel_err == 0).all()


def test_compare_heatmap_diverges_around_zero(ck):
    r = compare(ck["packed"], "ptq:mxfp4:floor", ck["ref"], progress=False)
    figs = report.compare_figures(r)
    assert set(figs) == {"compare_heatmap", "compare_scatter", "compare_extremes"}
    ims = _images(figs["compare_heatmap"])
    routed = r.table[r.table.kind == "routed"]
    half = routed.change_pct.abs().max()
    for im in ims:
        assert im.norm.vmin == -im.norm.vmax == pytest.approx(-half)
        assert im.get_cmap().name == "RdBu_r"
    gate = routed[routed.proj == "gate"].pivot_table(index="layer", columns="expert",
                                                     values="change_pct").to_numpy()
    np.testing.assert_allclose(np.ma.getdata(ims[0].get_array()), gate)
    cbar = figs["compare_heatmap"].axes[-1]
    assert "%" in cbar.get_ylabel()
    sc = figs["compare_scatter"].axes[0]
    assert sc.get_xlabel().startswith("B = ") and sc.get_ylabel().startswith("A = ")
    pts = np.concatenate([c.get_offsets() for c in sc.collections])
    assert len(pts) == len(routed)
    bars = figs["compare_extremes"].axes[0]
    lo, hi = bars.get_xlim()
    assert lo == pytest.approx(-hi)


def test_short_reprs():
    q = quantize(torch.randn(64, 256), "nvfp4")
    text = repr(q)
    assert "nvfp4:torchao" in text and "(64, 256)" in text and "tensor(" not in text
    assert len(text) < 200
    from workbench.qat.prepare import PrepareReport
    from workbench.qat.recipe import parse_qat_recipe

    rep = PrepareReport(parse_qat_recipe("mxfp4"), skipped=[(f"w{i}", "out of scope")
                                                            for i in range(500)])
    assert len(repr(rep)) < 200 and "500 kept" in repr(rep)
