"""`workbench inspect` end to end (a real subprocess) and the figures it draws."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from analysis_ckpts import moe_weights, write_dense

from workbench import plots
from workbench.analysis import candidate_errors, expert_detail
from workbench.checkpoint import open_checkpoint

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_dense(tmp_path_factory.mktemp("cli") / "ck", moe_weights(layers=3, experts=4))


def test_cli_writes_table_figures_and_summary(ckpt, tmp_path):
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(ckpt), "--recipe",
                        "mxfp4:floor", "--recipe", "nvfp4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(out / "experts.csv")
    for col in ("layer", "expert", "proj", "recipe", "rel_err", "sqnr_db", "max_abs_err", "clip_frac"):
        assert col in df.columns
    assert set(df.recipe) == {"mxfp4:floor", "nvfp4:torchao"}
    assert len(df[df.kind == "routed"]) == 2 * 4 * 3 * 2  # layers 1-2 x experts x projs x recipes
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "heatmap_rel_err_mxfp4_floor.png" in pngs and "recipes_sqnr_db.png" in pngs
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    summary = (out / "summary.txt").read_text()
    assert "worst" in summary and summary.strip() in r.stdout


def test_cli_reports_a_bad_checkpoint_cleanly(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(tmp_path / "bad")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 2
    assert "model.safetensors" in r.stderr and "Traceback" not in r.stderr


def test_figures_are_labelled(ckpt):
    t = candidate_errors(open_checkpoint(ckpt), ["mxfp4", "mxfp4:floor"], progress=False)
    fig = plots.heatmap(t.experts, "rel_err", recipe="mxfp4:rceil")
    axes = fig.get_axes()
    assert len(axes) == 4  # gate, up, down + colorbar
    assert all(ax.get_xlabel() == "expert" and ax.get_ylabel() == "layer" for ax in axes[:3])
    assert "relative error" in axes[3].get_ylabel()
    for f in (plots.expert_distribution(t.experts, recipe="mxfp4:floor"),
              plots.recipe_comparison(t.experts), plots.worst_experts(t.experts, recipe="mxfp4:floor"),
              plots.scale_histogram(t.scales, recipe="mxfp4:floor")):
        ax = f.get_axes()[0]
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    with pytest.raises(ValueError, match="several recipes"):
        plots.heatmap(t.experts)


def test_expert_detail_matches_table_row(ckpt):
    ck = open_checkpoint(ckpt)
    t = candidate_errors(ck, ["mxfp4:floor"], progress=False).experts
    d = expert_detail(ck, 2, 3, "down", "mxfp4:floor")
    row = t[(t.layer == 2) & (t.expert == 3) & (t.proj == "down")].iloc[0]
    assert d.metrics["rel_err"] == row.rel_err
    assert d.exponents.numel() == d.weight.numel() // 32
    fig = plots.expert_detail(d)
    assert len(fig.get_axes()) == 2
