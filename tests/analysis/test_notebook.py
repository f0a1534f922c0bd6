"""The inspection notebook, executed headless with papermill on a small checkpoint."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from analysis_ckpts import moe_weights, write_dense
from notebook_run import run_notebook

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_inspection_notebook_renders_figures(tmp_path):
    pytest.importorskip("papermill")
    import nbformat

    ck = write_dense(tmp_path / "ck", moe_weights(layers=3, experts=4))
    out = tmp_path / "nb.ipynb"
    run_notebook(str(ROOT / "notebooks" / "01_inspect_checkpoint.ipynb"), str(out),
                 parameters={"checkpoint": str(ck), "out_dir": str(tmp_path / "rep"),
                             "recipes": ["mxfp4:floor", "mxfp4:rceil"]},
                 cwd=str(ROOT), kernel_name="python3", progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    pngs = [o["data"]["image/png"] for c in nb.cells for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
    # one heatmap figure for both recipes (one colour scale), recipe comparison, worst experts,
    # scale histogram, and the picker's figure
    assert len(pngs) >= 4
    assert all(base64.b64decode(p)[:4] == b"\x89PNG" for p in pngs)
    assert (tmp_path / "rep" / "experts.csv").exists()
    widgets = [o for c in nb.cells for o in c.get("outputs", [])
               if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets, "the expert picker did not render"
