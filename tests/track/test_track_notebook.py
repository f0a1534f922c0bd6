"""The real trainer's wandb offline runs read back equal to its metrics.jsonl, and
notebooks/03_budgets.ipynb runs headless on them (papermill)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from html import escape as html_escape

import pandas as pd
import pytest
from notebook_run import run_notebook
from track_runs import REPO, wandb_env

from workbench.track import (
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    StepTimeRatio,
    ValLossWithin,
    compare,
    find_runs,
    load_runs,
    read_metrics,
)

pytestmark = pytest.mark.slow
RUNS = ("bf16", "mxfp4")


@pytest.fixture(scope="module")
def group_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    # One process trains both runs (tiny preset, 6 steps); the QAT run is preempted (SIGUSR2,
    # the signal Slurm/submitit send) once it has logged a step, then resumed.
    code = textwrap.dedent(f"""
        import os, pathlib, signal, threading, time
        from workbench.train.cli import main

        def args(recipe):
            return ["--preset", "tiny", "--recipe", recipe, "--steps", "6", "--val-every", "3",
                    "--out", {str(root)!r} + "/" + recipe, "--wandb", "offline",
                    "--run-group", "nb", "--export", "bf16"]

        main(args("bf16"))

        def preempt():
            f = pathlib.Path({str(root)!r}) / "mxfp4" / "metrics.jsonl"
            while not (f.exists() and f.read_text().count("\\n") >= 1):
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGUSR2)

        threading.Thread(target=preempt, daemon=True).start()
        first = main(args("mxfp4"))
        assert first["stopped"] and first["step"] < 6, first
        second = main(args("mxfp4") + ["--resume"])
        assert not second["stopped"] and second["step"] == 6, second
        print("stopped at", first["step"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=wandb_env(root), cwd=REPO,
                          capture_output=True, text=True, timeout=560, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def test_trainer_wandb_history_equals_metrics_jsonl(group_dir):
    attempts = {name: find_runs(group_dir / name) for name in RUNS}
    # the resumed run continues the same wandb run id: one run, two file segments
    assert len(attempts["bf16"]) == 1 and len(attempts["mxfp4"]) == 1
    assert len(attempts["bf16"][0].paths) == 1 and len(attempts["mxfp4"][0].paths) == 2
    for run in load_runs(group_dir, group="nb"):
        assert run.config["recipe"] == run.name
        from_wandb, from_jsonl = run.metrics, read_metrics(group_dir / run.name)
        assert list(from_jsonl["step"]) == list(range(1, 7))
        cols = [c for c in from_jsonl.columns]
        assert set(cols) <= set(from_wandb.columns)
        pd.testing.assert_frame_equal(from_wandb[cols], from_jsonl[cols], check_dtype=False)


def test_budgets_notebook_headless(group_dir, tmp_path):
    pytest.importorskip("papermill", reason="needs the 'notebooks' extra")
    out = tmp_path / "03_budgets.out.ipynb"
    run_notebook(
        str(REPO / "notebooks" / "03_budgets.ipynb"), str(out), cwd=str(REPO),
        parameters={"group_dir": str(group_dir), "group": "nb", "divergence_window": 3},
        kernel_name="python3", progress_bar=False)
    import nbformat

    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    html = "\n".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 4  # loss curves, step time curves, budget table, expert errors
    # the notebook shows the same verdicts as the library computes here
    budgets = (ValLossWithin(2.0), LossFinite(), NoDivergence(3, 1.5), StepTimeRatio(2.0),
               FakeQuantShare(0.5))
    expected = compare(group_dir, budgets=budgets, group="nb").budgets
    assert list(expected["run"].unique()) == ["mxfp4"]
    # per-expert error of both runs' final weights under the group's QAT weight format
    for name in RUNS:
        assert re.search(rf"<td>{name}</td>\s*<td>mxfp4:rceil</td>", html), name
    assert "&lt;NA&gt;" not in html  # an undecided budget reads "pending"
    for row in expected.itertuples():
        shown = "pending" if pd.isna(row.passed) else ("PASS" if row.passed else "FAIL")
        cell = html_escape(row.budget)
        assert re.search(rf"<td>{re.escape(cell)}</td>(?:(?!</tr>).)*<td>{shown}</td>", html,
                         re.DOTALL), (row.budget, shown)
