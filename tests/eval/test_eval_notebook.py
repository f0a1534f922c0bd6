"""notebooks/03_budgets.ipynb shows a run group's downstream evaluation: the score table with
stderr, the recovery of the QAT run, and the bar chart (papermill, headless)."""

from __future__ import annotations

import pytest
from builders import REPO, env
from notebook_run import run_notebook

from workbench.track import group_eval

pytestmark = pytest.mark.slow


def test_budgets_notebook_shows_the_group_eval(group, group_eval_dir, tmp_path, monkeypatch):
    pytest.importorskip("papermill", reason="needs the 'notebooks' extra")
    import nbformat

    for k, v in env(tmp_path).items():  # the kernel inherits this process's environment
        monkeypatch.setenv(k, v)
    out = tmp_path / "03.out.ipynb"
    run_notebook(
        str(REPO / "notebooks" / "03_budgets.ipynb"), str(out), cwd=str(REPO),
        parameters={"group_dir": str(group["root"]), "group": "g", "divergence_window": 3,
                    "expert_error": False},
        kernel_name="python3", progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    cells = {c.get("id"): c for c in nb.cells}
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "\n".join(o["data"].get("text/html", "") for o in cells["eval-table"]["outputs"]
                     if "data" in o)
    expected = group_eval(group["root"])
    assert expected.files == [str(group_eval_dir / "eval.json")]
    for r in expected.results.itertuples():
        cell = f"{r.value:.4f}" + ("" if r.stderr != r.stderr else f" ± {r.stderr:.4f}")
        assert f"<td>{cell}</td>" in html, (r.model, r.metric, cell)
    for r in expected.recovery.itertuples():
        assert f"<td>{r.model}</td>" in html
    chart = [o for o in cells["eval-chart"]["outputs"] if "image/png" in o.get("data", {})]
    assert len(chart) == 1


@pytest.mark.distributed
def test_launch_notebook_chains_an_eval_per_run(group, tmp_path, monkeypatch):
    """notebooks/02 with eval_tasks: an eval job after each of its runs (local executor), the
    group's table at the end; what it shows is what the eval jobs wrote."""
    pytest.importorskip("papermill", reason="needs the 'notebooks' extra")
    import nbformat

    for k, v in env(tmp_path).items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "runs"
    executed = tmp_path / "02.ipynb"
    run_notebook(
        str(REPO / "notebooks" / "02_launch_qat.ipynb"), str(executed), cwd=str(tmp_path),
        kernel_name="python3", progress_bar=False,
        parameters={"executor": "local", "ep": 1, "steps": 4, "out": str(out),
                    "recipes": ["bf16", "mxfp4"], "init": str(group["bf16_model"]),
                    "data": [str(group["root"] / "code.jsonl")], "wandb": "disabled",
                    "timeout_s": 900, "eval_tasks": "wb_code_choice", "eval_limit": 4})
    nb = nbformat.read(executed, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    cell = next(c for c in nb.cells if c.get("id") == "eval-jobs")
    html = "\n".join(o["data"].get("text/html", "") for o in cell["outputs"] if "data" in o)
    g = group_eval(out)
    assert len(g.files) == 2  # one eval.json per run, in RUN/eval/
    assert {"bf16", "ptq", "qat"} == set(g.results["role"])
    for r in g.results.itertuples():
        cell_text = f"{r.value:.4f}" + ("" if r.stderr != r.stderr else f" ± {r.stderr:.4f}")
        assert f"<td>{cell_text}</td>" in html
