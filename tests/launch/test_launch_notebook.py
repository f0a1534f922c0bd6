"""notebooks/02_launch_qat.ipynb executes headless (papermill), small parameters, local executor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from notebook_run import run_notebook

from workbench.launch import JobHandle

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "02_launch_qat.ipynb"


def test_launch_notebook_runs_two_recipes(tmp_path):
    pytest.importorskip("papermill", reason="needs the notebooks extra")
    out = tmp_path / "runs"
    executed = tmp_path / "02.ipynb"
    run_notebook(str(NOTEBOOK), str(executed), cwd=str(tmp_path),
                 kernel_name="python3",
                 parameters={"executor": "local", "ep": 2, "steps": 6,
                             "out": str(out),
                                 "wandb": "disabled", "timeout_s": 600})
    nb = json.loads(executed.read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert pngs, "the curves figure was not rendered"
    # The runs the notebook launched are real and re-attachable from here.
    runs = sorted(p.parent for p in out.glob("*/launch.json"))
    assert [p.name for p in runs] == ["tiny-bf16-ep2-s0", "tiny-mxfp4+mxfp8-ep2-s0"]
    for folder in runs:
        job = JobHandle.attach(folder)
        assert job.state == "COMPLETED"
        assert job.metrics()["step"].tolist() == list(range(1, 7))
        assert job.result()["recipe"] == job.spec.train.recipe
