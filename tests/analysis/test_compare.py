"""`workbench.analysis.compare` and `workbench compare`: two checkpoints expert by expert.

Expected errors are computed here from the tensors written, with `workbench.formats` codecs
(the spec, tested against the libraries elsewhere), not read back from the analysis code.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import moe_weights, write_dense, write_mxfp4
from safetensors.torch import save_file

from workbench.analysis import CompareError, compare
from workbench.formats import dequantize, quantize
from workbench.report import compare_figures

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    t = tmp_path_factory.mktemp("compare")
    sd = moe_weights(layers=3, experts=4)
    return {"sd": sd, "ref": write_dense(t / "ref", sd),
            "packed": write_mxfp4(t / "packed", sd, "mxfp4:even"),
            "other": write_dense(t / "other", moe_weights(layers=3, experts=6))}


def _rel(w, recipe):
    w = w.float()
    d = dequantize(quantize(w.bfloat16(), recipe, pad=True), torch.float32)
    return float((d - w).norm() / w.norm())


def test_each_side_against_the_reference_and_the_verdicts(ckpts):
    r = compare(ckpts["packed"], "ptq:mxfp4:floor", ckpts["ref"], progress=False, tol_pct=1.0)
    t = r.table
    routed = t[t.kind == "routed"]
    assert len(routed) == 2 * 4 * 3  # layers 1-2 x experts x projections
    sd = ckpts["sd"]
    for row in routed.sample(6, random_state=0).itertuples():
        w = sd[f"model.layers.{row.layer}.mlp.experts.{row.expert}.{row.proj}_proj.weight"]
        assert row.a_rel_err == pytest.approx(_rel(w, "mxfp4:even"), rel=1e-5)
        assert row.b_rel_err == pytest.approx(_rel(w, "mxfp4:floor"), rel=1e-5)
        assert row.delta == pytest.approx(row.a_rel_err - row.b_rel_err)
        assert row.change_pct == pytest.approx(100 * row.delta / row.b_rel_err)
    # FLOOR clips every block with amax in (6, 8) * 2^k; EVEN rounds those up: A is better
    assert (routed.verdict == "improved").sum() > len(routed) // 2
    # the verdict rule itself, at and around the tolerance: test_compare_verdict.py (hand-built)
    assert r.counts()["improved"] == int((routed.verdict == "improved").sum())
    assert not r.identical and "improved" in r.summary()
    assert len(repr(r)) < 200 and "weights" in repr(r)


def test_identical_sides_are_named_not_drawn(ckpts, tmp_path):
    r = compare(ckpts["packed"], "ptq:mxfp4:even", ckpts["ref"], progress=False)
    assert r.identical and (r.table.delta == 0).all()
    assert "same rel_err on all" in r.summary()
    assert compare_figures(r) == {}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(ckpts["packed"]),
                        "ptq:mxfp4:even", "--reference", str(ckpts["ref"]), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    assert "same rel_err on all" in p.stdout and not list(out.glob("*.png"))


def test_cli_writes_table_and_figures(ckpts, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(ckpts["packed"]),
                        "ptq:mxfp4", "--reference", str(ckpts["ref"]), "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    df = pd.read_csv(out / "compare.csv")
    assert {"a_rel_err", "b_rel_err", "delta", "change_pct", "verdict"} <= set(df.columns)
    assert sorted(x.name for x in out.glob("*.png")) == [
        "compare_extremes.png", "compare_heatmap.png", "compare_scatter.png"]
    assert (out / "summary.txt").read_text().strip() in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["{packed}", "ptq:mxfp4", "--reference", "{other}"], "architecture mismatch"),
    (["{packed}", "{other}", "--reference", "{ref}"], "architecture mismatch"),
    (["{packed}", "ptq:mxfp4"], "--reference"),
    (["{packed}", "ptq:bogus", "--reference", "{ref}"], "bogus"),
    (["{packed}", "{ref}/nope", "--reference", "{ref}"], "nope"),
])
def test_cli_bad_input_is_one_line(ckpts, tmp_path, args, needle):
    argv = [a.format(**{k: str(v) for k, v in ckpts.items() if k != "sd"}) for a in args]
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", *argv, "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=False)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith("workbench")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()


def test_ptq_of_each_side_needs_no_shared_reference(ckpts):
    r = compare(f"ptq:mxfp4:even@{ckpts['ref']}", f"ptq:nvfp4@{ckpts['ref']}", progress=False)
    sd = ckpts["sd"]
    row = r.table[(r.table.kind == "routed") & (r.table.layer == 2) & (r.table.expert == 3)
                  & (r.table.proj == "down")].iloc[0]
    w = sd["model.layers.2.mlp.experts.3.down_proj.weight"]
    assert row.a_rel_err == pytest.approx(_rel(w, "mxfp4:even"), rel=1e-5)
    assert row.b_rel_err == pytest.approx(_rel(w, "nvfp4"), rel=1e-5)
    with pytest.raises(CompareError, match="reference"):
        compare(ckpts["packed"], "ptq:mxfp4", progress=False)


def test_two_layouts_of_one_model(tmp_path):
    """A gpt-oss packed checkpoint against the same experts written per expert in BF16: A
    reproduces them exactly (its decode is the reference), PTQ of the reference does not."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "checkpoint"))
    import oracles

    o = oracles.write_gpt_oss(tmp_path / "gptoss", seed=3)
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file({f"model.layers.{L}.mlp.experts.{e}.{p}_proj.weight": w.contiguous()
               for (L, e, p), w in o.experts.items()}, str(ref / "model.safetensors"))
    cfg = json.loads((o.path / "config.json").read_text())
    cfg.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(cfg))
    # the reference lies on the MXFP4 grid (it was decoded from one): NVFP4 must round it
    r = compare(o.path, "ptq:nvfp4", ref, progress=False)
    assert len(r.table) == o.num_layers * o.num_experts * 3
    assert r.exact("a") and not r.exact("b")
    assert "A reproduces its reference exactly" in r.summary()
    # A (exact) improves on every weight NVFP4 does not reproduce, and only there
    assert ((r.table.verdict == "improved") == (r.table.b_rel_err > 0)).all()
    assert (r.table.verdict == "improved").sum() > len(r.table) // 2
    assert all(math.isfinite(x) for x in r.table.b_rel_err)


def test_inspect_without_reference_names_the_lossless_grid(ckpts, tmp_path):
    """`workbench inspect PACKED` alone re-quantizes the decoded grid: every MX rule reproduces
    it, which is one line per recipe, not zero-valued lists and empty plots."""
    out = tmp_path / "rep"
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(ckpts["packed"]),
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    for rec in ("mxfp4:rceil", "mxfp4:floor", "mxfp4:even"):
        assert f"{rec} reproduces exactly: rel_err 0 on all 24 routed weights" in p.stdout
    assert "worst" not in p.stdout and "per-recipe means" not in p.stdout
    assert sorted(x.name for x in out.glob("*.png")) == ["scale_exponents.png"]
    assert (pd.read_csv(out / "experts.csv").rel_err == 0).all()
