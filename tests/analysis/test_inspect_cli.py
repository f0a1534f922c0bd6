"""`workbench inspect` end to end (a real subprocess) and the figures it draws."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import moe_weights, write_dense
from safetensors.torch import save_file

from workbench import plots
from workbench.analysis import candidate_errors, expert_detail
from workbench.checkpoint import open_checkpoint
from workbench.cli import main

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
    fig = plots.plot_heatmap(t.experts, "rel_err", recipe="mxfp4:rceil")
    axes = fig.get_axes()
    assert len(axes) == 4  # gate, up, down + colorbar
    assert all(ax.get_xlabel() == "expert" and ax.get_ylabel() == "layer" for ax in axes[:3])
    assert "relative error" in axes[3].get_ylabel()
    for f in (plots.plot_expert_distribution(t.experts, recipe="mxfp4:floor"),
              plots.plot_recipe_comparison(t.experts), plots.plot_worst_experts(t.experts, recipe="mxfp4:floor"),
              plots.plot_scale_histogram(t.scales, recipe="mxfp4:floor")):
        ax = f.get_axes()[0]
        assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    with pytest.raises(ValueError, match="several recipes"):
        plots.plot_heatmap(t.experts)


def test_expert_detail_matches_table_row(ckpt):
    ck = open_checkpoint(ckpt)
    t = candidate_errors(ck, ["mxfp4:floor"], progress=False).experts
    d = expert_detail(ck, 2, 3, "down", "mxfp4:floor")
    row = t[(t.layer == 2) & (t.expert == 3) & (t.proj == "down")].iloc[0]
    assert d.metrics["rel_err"] == row.rel_err
    assert d.exponents.numel() == d.weight.numel() // 32
    fig = plots.plot_expert_detail(d)
    assert len(fig.get_axes()) == 2


def _bad_cuda() -> str:
    """A CUDA device that is not there, on any machine."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("flags,needle", [
    (["--recipe", "mxfp5"], "unknown format 'mxfp5'"),
    (["--recipe", "mxfp4:floor", "--recipe", "nvfp4:bogus"], "no profile 'bogus'"),
    (["--device", "bogus"], "--device 'bogus'"),
    (["--device", "cuda-ish:x"], "--device"),
    (["--device", "meta"], "only cpu and cuda"),
    (["--device", _bad_cuda()], "CUDA"),
])
def test_cli_bad_argument_is_one_line_before_any_work(ckpt, tmp_path, capsys, flags, needle):
    rc = main(["inspect", str(ckpt), "--out", str(tmp_path / "out"), *flags])
    cap = capsys.readouterr()
    assert rc == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], cap.err
    assert cap.out == ""  # the checkpoint was not even opened (it prints itself first)


def test_cli_out_must_be_a_writable_folder_before_the_analysis(ckpt, tmp_path, capsys):
    f = tmp_path / "report.txt"
    f.write_text("mine")
    for out, needle in ((f, "is not a folder"), (f / "sub", "not a writable folder")):
        rc = main(["inspect", str(ckpt), "--out", str(out), "--recipe", "mxfp4"])
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == "", (out, cap)
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], cap.err
    assert f.read_text() == "mine"
    if os.geteuid() != 0:  # root writes into read-only folders anyway
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        rc = main(["inspect", str(ckpt), "--out", str(ro / "report"), "--recipe", "mxfp4"])
        cap = capsys.readouterr()
        assert rc == 2 and cap.out == "" and "not a writable folder" in cap.err


def test_cli_validation_error_is_one_line(tmp_path):
    # several problems at once (a ValidationError) still print as one line
    d = tmp_path / "ck"
    d.mkdir()
    save_file({f"model.layers.0.mlp.experts.{e}.up_proj.weight": torch.zeros(8, 4, dtype=torch.uint8)
               for e in range(3)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(d), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "3 problems" in lines[0] and "model.safetensors" in lines[0], r.stderr
