"""Run-group comparison from wandb offline runs and from trainer metrics.jsonl folders."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from track_runs import N_STEPS, group_runs

from workbench.track import MetricsLineSkipped, as_metrics, compare, load_runs, read_metrics
from workbench.track.budgets import (
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    StepTimeRatio,
    ValLossWithin,
)

BUDGETS = (ValLossWithin(2.0), LossFinite(), NoDivergence(window=5, factor=1.5),
           StepTimeRatio(2.0), FakeQuantShare(0.5))
# What each QAT run was built to do (see track_runs.group_runs).
EXPECTED = {
    "mxfp4-s0": ("bf16-s0", [True, True, True, True, True]),
    "nvfp4-s0": ("bf16-s0", [False, True, True, False, False]),
    "nan-s0": ("bf16-s0", [False, False, False, True, True]),
    "mxfp4-s1": ("bf16-s1", [True, True, True, True, True]),  # +31% vs the seed-0 baseline
}


@pytest.fixture(scope="module")
def metrics_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("group")
    for run in group_runs():
        d = root / run["name"]
        d.mkdir()
        with open(d / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": r["step"], **r["metrics"]}) + "\n"
                         for r in run["rows"])
        (d / "config.json").write_text(json.dumps({**run["config"], "run_group": "cmp"}))
    return root


def _verdicts(cmp):
    out = {}
    for run, g in cmp.budgets.groupby("run"):
        out[run] = (g["baseline"].iloc[0], [None if pd.isna(p) else bool(p) for p in g["passed"]])
    return out


@pytest.mark.parametrize("source", ["wandb", "metrics"])
def test_group_verdicts(source, wandb_dir, metrics_dir):
    path = wandb_dir if source == "wandb" else metrics_dir
    cmp = compare(path, budgets=BUDGETS, group="cmp")
    assert {r.name for r in cmp.runs} == {r["name"] for r in group_runs()}
    assert _verdicts(cmp) == EXPECTED
    row = cmp.budgets[(cmp.budgets.run == "mxfp4-s1") & cmp.budgets.budget.str.startswith("val")]
    assert row["measured"].iloc[0] == pytest.approx(1.0)
    assert set(cmp.curves["run"]) == {r["name"] for r in group_runs()}
    assert len(cmp.curves) == N_STEPS * len(group_runs())
    assert list(cmp.curves.columns[:3]) == ["run", "recipe", "step"]


def test_wandb_and_metrics_sources_agree(wandb_dir, metrics_dir):
    a = compare(wandb_dir, budgets=BUDGETS, group="cmp").budgets
    b = compare(metrics_dir, budgets=BUDGETS, group="cmp").budgets
    key = ["run", "budget"]
    a, b = a.sort_values(key).reset_index(drop=True), b.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)


def test_explicit_baseline(metrics_dir):
    # every run against the seed-0 baseline, seed-1 runs included
    cmp = compare(metrics_dir, budgets=(ValLossWithin(2.0),), baseline="bf16-s0")
    v = cmp.budgets.set_index("run")
    assert set(v.index) == {r["name"] for r in group_runs()} - {"bf16-s0"}
    assert set(v["baseline"]) == {"bf16-s0"}
    assert v.loc["mxfp4-s0", "passed"] and not v.loc["mxfp4-s1", "passed"]
    assert v.loc["bf16-s1", "measured"] == pytest.approx(30.0)  # 1.3x by construction
    with pytest.raises(KeyError, match="nope"):
        compare(metrics_dir, baseline="nope")


def test_read_metrics_live_and_bad(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "loss": 2.0}\n{"step": 1, "loss": NaN}\n{"step": 2, "lo')
    df = read_metrics(tmp_path)  # the half-written last line is a step in progress
    assert list(df["step"]) == [0, 1] and math.isnan(df["loss"].iloc[1])
    p.write_text('{"step": 0, "loss": 2.0}\n{"step": 1, oops}\n{"step": 2, "loss": 1.0}\n')
    with pytest.warns(MetricsLineSkipped, match=r"metrics.jsonl:2: line skipped: not JSON"):
        assert read_metrics(p)["step"].tolist() == [0, 2]  # one bad line hides nothing else
    p.write_text('[1, 2]\n')
    with pytest.warns(MetricsLineSkipped, match="JSON object"):
        assert read_metrics(p).empty
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no runs"):
        load_runs(empty)
    with pytest.raises(FileNotFoundError, match="no wandb run files"):
        load_runs(empty, source="wandb")


def test_as_metrics_merges_rows_of_one_step():
    df = pd.DataFrame([{"_step": 3, "loss": 1.0}, {"_step": 1, "loss": 2.0},
                       {"_step": 3, "val_loss": 1.5}])
    m = as_metrics(df)
    assert list(m["step"]) == [1, 3]
    assert m.set_index("step").loc[3, "loss"] == 1.0
    assert m.set_index("step").loc[3, "val_loss"] == 1.5
    with pytest.raises(KeyError, match="step"):
        as_metrics(pd.DataFrame({"loss": [1.0]}))


def test_runs_table(metrics_dir):
    from workbench.track import runs_table

    t = runs_table(compare(metrics_dir, budgets=()).runs).set_index("run")
    assert set(t.index) == {r["name"] for r in group_runs()}
    assert t.loc["bf16-s0", "baseline"] and not t.loc["nvfp4-s0", "baseline"]
    rows = {r["name"]: r for r in group_runs()}
    last = rows["nvfp4-s0"]["rows"][-1]["metrics"]
    assert t.loc["nvfp4-s0", "loss"] == last["loss"]
    assert t.loc["nvfp4-s0", "val_loss"] == last["val_loss"]
    assert t.loc["nan-s0", "last_step"] == N_STEPS - 1 and t.loc["mxfp4-s1", "seed"] == 1
    assert math.isnan(t.loc["nan-s0", "loss"])
    assert t.loc["nan-s0", "val_loss"] == rows["nan-s0"]["rows"][24]["metrics"]["val_loss"]


def test_attempts_with_new_wandb_ids_merge_into_one_run(wandb_dir):
    from workbench.track import find_runs

    assert len({r.id for r in find_runs(wandb_dir, group="attempts")}) == 2
    (run,) = load_runs(wandb_dir, group="attempts")
    # steps 1-4 from the first attempt, 5-8 redone by the second
    assert list(run.metrics["step"]) == list(range(1, 9))
    assert list(run.metrics["loss"]) == [10.0 + s for s in range(1, 5)] + \
        [20.0 + s for s in range(5, 9)]
    assert len(run.source.split(";")) == 2
