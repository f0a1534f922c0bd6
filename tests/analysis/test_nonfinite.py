"""Non-finite weights are loud: counted per expert row on every path, named in the inspect
summary (and on stderr), marked in the heatmaps, never called "same" by compare."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import moe_weights, write_dense, write_mxfp4
from safetensors.torch import load_file, save_file

from workbench import plots
from workbench.analysis import candidate_errors, reference_errors, stored_vs_recipes
from workbench.analysis.compare import compare
from workbench.analysis.inspect import inspect_checkpoint
from workbench.checkpoint import open_checkpoint
from workbench.report import compare_figures, inspect_figures

ROOT = Path(__file__).parents[2]
NAN_AT = ("model.layers.1.mlp.experts.2.up_proj.weight", (3, 5))
INF_AT = ("model.layers.1.mlp.experts.3.gate_proj.weight", (0, 7))
SCALE_AT = ("model.layers.1.mlp.experts.1.down_proj.weight_scale", (4, 0))  # one E8M0 byte
BLOCK = 32  # MXFP4 elements per scale byte: a NaN scale decodes the whole block to NaN
PATHS = ("reference", "batched", "fused")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    sd = moe_weights()
    ref = write_dense(root / "ref", sd)
    bad = dict(sd)
    for name, (i, j), v in ((*NAN_AT, math.nan), (*INF_AT, math.inf)):
        w = bad[name].clone()
        w[i, j] = v
        bad[name] = w
    dense_bad = write_dense(root / "dense_bad", bad)
    mx_good = write_mxfp4(root / "mx_good", sd)
    mx_bad = write_mxfp4(root / "mx_bad", sd)
    st = load_file(str(mx_bad / "model.safetensors"))
    st[SCALE_AT[0]][SCALE_AT[1]] = 255  # E8M0 NaN
    save_file(st, str(mx_bad / "model.safetensors"))
    return {"ref": ref, "dense_bad": dense_bad, "mx_good": mx_good, "mx_bad": mx_bad}


def _counts(df) -> dict:
    bad = df[df.nonfinite > 0]
    return {(r.layer, r.expert, r.proj): int(r.nonfinite) for r in bad.itertuples()}


@pytest.mark.parametrize("path", PATHS)
def test_every_question_counts_non_finite_values_per_row(ckpts, path):
    ck = open_checkpoint(ckpts["dense_bad"])
    t = candidate_errors(ck, ["mxfp4:rceil", "nvfp4:torchao"], progress=False, path=path).experts
    assert t.nonfinite.dtype.kind == "i"
    assert _counts(t) == {(1, 2, "up"): 1, (1, 3, "gate"): 1}
    assert len(t[t.nonfinite > 0]) == 2 * 2  # each recipe's row of each weight
    mx_bad, ref = open_checkpoint(ckpts["mx_bad"]), open_checkpoint(ckpts["ref"])
    s = stored_vs_recipes(mx_bad, ["mxfp4:even"], progress=False, path=path).experts
    assert _counts(s) == {(1, 1, "down"): BLOCK}
    r = reference_errors(mx_bad, ref, progress=False, path=path).experts
    assert _counts(r) == {(1, 1, "down"): BLOCK}
    # and the reference side's own non-finite values count too
    r2 = reference_errors(open_checkpoint(ckpts["mx_good"]), ck, progress=False,
                          path=path).experts
    assert _counts(r2) == {(1, 2, "up"): 1, (1, 3, "gate"): 1}


def test_fast_paths_give_the_reference_table_with_the_count(ckpts):
    ck = open_checkpoint(ckpts["dense_bad"])
    tables = [candidate_errors(ck, ["mxfp4:rceil"], progress=False, path=p).experts
              for p in PATHS]
    for t in tables[1:]:
        pd.testing.assert_frame_equal(t, tables[0], check_exact=False, rtol=1e-5)
        assert t.nonfinite.tolist() == tables[0].nonfinite.tolist()


def test_inspect_summary_names_them_and_keeps_them_out_of_the_means(ckpts):
    res = inspect_checkpoint(open_checkpoint(ckpts["dense_bad"]), ["mxfp4:rceil"],
                             progress=False)
    lines = res.summary.splitlines()
    (warn,) = [x for x in lines if x.startswith("WARNING")]
    assert "2 expert weights" in warn and "layer 1 expert 2 up" in warn and \
        "layer 1 expert 3 gate" in warn
    assert any("means over finite rows" in x and "2 non-finite rows excluded" in x
               for x in lines)
    # the worst list names them instead of dropping them
    i = next(k for k, x in enumerate(lines) if x.startswith("worst"))
    block = "\n".join(lines[i - 3:i + 8])
    assert "non-finite" in block and "expert    2 up" in block
    df = res.tables.experts
    finite = df[(df.nonfinite == 0) & (df.kind == "routed")]
    mean = finite.rel_err.mean()
    assert f"{mean:.4g}" in res.summary


def test_inspect_cli_warns_on_stderr_and_exits_0(ckpts, tmp_path):
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect",
                        str(ckpts["dense_bad"]), "--recipe", "mxfp4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    warn = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    assert len(warn) == 1 and "non-finite" in warn[0] and "layer 1 expert 2 up" in warn[0]
    df = pd.read_csv(out / "experts.csv")
    assert int(df.nonfinite.sum()) == 2


def _marked_cells(fig) -> set[tuple[str, int, int]]:
    cells = set()
    for ax in fig.get_axes():
        for p in ax.patches:
            if p.get_hatch():
                x, y = p.get_xy()
                cells.add((ax.get_title(), round(x + 0.5), round(y + 0.5)))
    return cells


def _legend_texts(fig) -> list[str]:
    texts = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    for ax in fig.get_axes():
        lg = ax.get_legend()
        if lg is not None:
            texts += [t.get_text() for t in lg.get_texts()]
    return texts


def test_heatmaps_mark_non_finite_cells_with_a_legend(ckpts):
    res = inspect_checkpoint(open_checkpoint(ckpts["dense_bad"]), ["mxfp4:rceil"],
                             progress=False)
    df = res.tables.experts
    fig = plots.plot_heatmap(df, "rel_err", recipe="mxfp4:rceil")
    # panels index rows by position among the layers drawn (layer 1 is row 0: layer 0 is dense)
    assert _marked_cells(fig) == {("up_proj", 2, 0), ("gate_proj", 3, 0)}
    assert any("non-finite" in t for t in _legend_texts(fig))
    fig = plots.plot_recipe_heatmaps(df, "rel_err")
    assert len(_marked_cells(fig)) == 2 and any("non-finite" in t for t in _legend_texts(fig))
    figs = inspect_figures(res)
    worst = figs["worst_mxfp4_rceil"].get_axes()[0].get_title()
    assert "2 non-finite" in worst


def test_compare_never_calls_non_finite_same(ckpts, tmp_path):
    res = compare(ckpts["dense_bad"], "ptq:mxfp4", ckpts["ref"], progress=False)
    t = res.table
    bad = t[t.verdict == "non-finite"]
    assert {(r.layer, r.expert, r.proj) for r in bad.itertuples()} == {(1, 2, "up"),
                                                                         (1, 3, "gate")}
    assert (bad.a_nonfinite > 0).all() and (bad.b_nonfinite == 0).all()
    assert res.counts()["non-finite"] == 2 and res.counts()["same"] == \
        int((t[t.kind == "routed"].verdict == "same").sum())
    assert not res.identical
    assert "non-finite" in res.summary() and "layer   1 expert    2 up" in res.summary()
    figs = compare_figures(res)
    assert _marked_cells(figs["compare_heatmap"]) == {("up_proj", 2, 0), ("gate_proj", 3, 0)}


def test_a_zero_reference_with_nonzero_error_is_not_a_crash():
    from workbench.analysis.metrics import error_metrics

    m = error_metrics(torch.zeros(4, 32), torch.ones(4, 32), None)
    assert m["sqnr_db"] == -math.inf and m["rel_err"] == math.inf
