"""notebooks/04_compare.ipynb executed headless: on two checkpoints given, on an identical pair
(named, not drawn), and fed directly by trainer run folders with BF16 exports (what notebook 02
writes)."""

from __future__ import annotations

import base64
from pathlib import Path

import pandas as pd
import pytest
from analysis_ckpts import moe_weights, write_dense, write_mxfp4
from notebook_run import run_notebook

ROOT = Path(__file__).parents[2]
NB = ROOT / "notebooks" / "04_compare.ipynb"


def _run(tmp_path, params):
    pytest.importorskip("papermill")
    import nbformat

    out = tmp_path / "nb.ipynb"
    run_notebook(str(NB), str(out), parameters=params, cwd=str(ROOT),
                 kernel_name="python3", progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    pngs = [o["data"]["image/png"] for c in nb.cells for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert all(base64.b64decode(p)[:4] == b"\x89PNG" for p in pngs)
    return pngs, text


@pytest.mark.slow
def test_compare_notebook_draws_and_names_the_identical_case(tmp_path):
    sd = moe_weights(layers=3, experts=4)
    ref, packed = write_dense(tmp_path / "ref", sd), write_mxfp4(tmp_path / "p", sd, "mxfp4:even")
    pngs, text = _run(tmp_path, {"a": str(packed), "b": "ptq:mxfp4:floor", "reference": str(ref),
                                 "out_dir": str(tmp_path / "rep")})
    assert len(pngs) == 3 and "improved" in text
    assert (tmp_path / "rep" / "compare.csv").exists()
    pngs, text = _run(tmp_path, {"a": str(packed), "b": "ptq:mxfp4:even", "reference": str(ref),
                                 "out_dir": str(tmp_path / "rep2")})
    assert pngs == [] and "same rel_err on all" in text


@pytest.mark.slow
def test_compare_notebook_fed_by_trainer_exports(tmp_path):
    from workbench.train.cli import main as train

    common = ["--preset", "tiny", "--steps", "2", "--seed", "0", "--batch", "4", "--seq", "32",
              "--wandb", "disabled", "--export", "bf16", "--val-every", "2"]
    group = tmp_path / "group"
    train([*common, "--recipe", "bf16", "--out", str(group / "tiny-bf16")])
    train([*common, "--recipe", "mxfp4", "--out", str(group / "tiny-mxfp4")])
    pngs, text = _run(tmp_path, {"group_dir": str(group), "out_dir": str(tmp_path / "rep")})
    assert "QAT run tiny-mxfp4 vs BF16 baseline tiny-bf16" in text
    assert "each against its own BF16 weights" in text
    df = pd.read_csv(tmp_path / "rep" / "compare.csv")
    assert len(df[df.kind == "routed"]) > 0 and (df.a_rel_err > 0).all()
    assert len(pngs) == 3
