"""notebooks/03_budgets.ipynb shows a run group's downstream evaluation: the score table with
stderr, the recovery of the QAT run, and the bar chart (papermill, headless)."""

from __future__ import annotations

import pytest
from builders import REPO, env

from workbench.track import group_eval

pytestmark = pytest.mark.slow


def test_budgets_notebook_shows_the_group_eval(group, group_eval_dir, tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill", reason="needs the 'notebooks' extra")
    import nbformat

    for k, v in env(tmp_path).items():  # the kernel inherits this process's environment
        monkeypatch.setenv(k, v)
    out = tmp_path / "03.out.ipynb"
    papermill.execute_notebook(
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
