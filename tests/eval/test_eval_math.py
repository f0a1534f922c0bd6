"""Recovery, pairing, tables and the EvalWithin budget on hand-built numbers (no lm-eval)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from workbench.track import EvalWithin, check
from workbench.track.evals import (
    FORMAT,
    NA_EQUAL,
    EvalFileError,
    column,
    group_eval,
    metric_label,
    pair,
    read_eval,
    recovery,
    recovery_table,
    results_table,
    retention,
    wide_table,
)


def test_recovery_and_retention_by_hand():
    # BF16 0.80, PTQ 0.50, QAT 0.74: QAT got back 0.24 of the 0.30 PTQ lost.
    assert recovery(0.80, 0.50, 0.74) == pytest.approx(0.8)
    assert retention(0.80, 0.74) == pytest.approx(0.925)
    assert recovery(0.80, 0.50, 0.50) == 0.0  # no better than PTQ
    assert recovery(0.80, 0.50, 0.80) == 1.0  # matches BF16
    assert recovery(0.80, 0.50, 0.86) == pytest.approx(1.2)  # beats BF16
    assert recovery(0.80, 0.50, 0.44) == pytest.approx(-0.2)  # worse than PTQ
    # lower-is-better metrics: the same ratio of gaps (brier 0.10 BF16, 0.20 PTQ, 0.12 QAT)
    assert recovery(0.10, 0.20, 0.12) == pytest.approx(0.8)
    assert recovery(0.6, 0.6, 0.7) is None  # nothing to recover: undefined
    assert retention(0.0, 0.3) is None
    assert recovery(math.nan, 0.5, 0.6) is None and retention(0.8, math.inf) is None


def test_metric_names_and_columns():
    assert metric_label("acc,none") == "acc"
    assert metric_label("exact_match,strict-match") == "exact_match,strict-match"
    assert column("gsm8k", "exact_match,strict-match", "bf16") == \
        "eval/gsm8k/exact_match,strict-match/bf16"


def _model(label, role, vals, *, path, base=None, recipe=None, docs="d1"):
    return {"label": label, "role": role, "path": path, "base": base, "recipe": recipe,
            "results": {"t": {"acc,none": {"value": vals[0], "stderr": vals[1]}}},
            "n_samples": {"t": 10}, "docs_sha": {"t": docs}}


def _ev(models):
    return {"format": FORMAT, "models": models}


def test_pairing_follows_base_and_recipe():
    models = [
        _model("init", "bf16", (0.8, 0.1), path="/g/init"),
        _model("other-bf16", "bf16", (0.7, 0.1), path="/g/other"),
        _model("ptq-mx", "ptq", (0.5, 0.1), path="/g/init", base="/g/init", recipe="mxfp4:rceil"),
        _model("ptq-nv", "ptq", (0.6, 0.1), path="/g/init", base="/g/init", recipe="nvfp4:torchao"),
        _model("qat-mx", "qat", (0.74, 0.1), path="/g/r1", base="/g/init", recipe="mxfp4:rceil"),
        _model("qat-nv", "qat", (0.62, 0.1), path="/g/r2", base="/g/init",
               recipe="nvfp4:torchao"),
        _model("packed", "qat", (0.7, 0.1), path="/g/packed"),  # no base, no recipe: ambiguous
    ]
    got = {q["label"]: (b and b["label"], p and p["label"]) for q, b, p in pair(models)}
    assert got == {"qat-mx": ("init", "ptq-mx"), "qat-nv": ("init", "ptq-nv"),
                   "packed": (None, None)}
    rec = recovery_table(_ev(models)).set_index("model")
    assert rec.loc["qat-mx", "recovery"] == pytest.approx((0.74 - 0.5) / (0.8 - 0.5))
    assert rec.loc["qat-nv", "recovery"] == pytest.approx((0.62 - 0.6) / (0.8 - 0.6))
    assert rec.loc["qat-mx", "retention"] == pytest.approx(0.74 / 0.8)
    assert math.isnan(rec.loc["packed", "recovery"]) and "no BF16 model" in rec.loc["packed", "note"]
    # one model of each role pairs without keys
    three = [_model("b", "bf16", (0.8, 0.1), path="/b"), _model("p", "ptq", (0.6, 0.1), path="/b"),
             _model("q", "qat", (0.7, 0.1), path="/q")]
    assert recovery_table(_ev(three))["recovery"].tolist() == [pytest.approx(0.5)]


def test_equal_bf16_and_ptq_is_reported_not_divided():
    models = [_model("b", "bf16", (0.6, 0.1), path="/b"), _model("p", "ptq", (0.6, 0.1), path="/b"),
              _model("q", "qat", (0.7, 0.1), path="/q")]
    row = recovery_table(_ev(models)).iloc[0]
    assert math.isnan(row["recovery"]) and row["note"] == NA_EQUAL
    assert row["retention"] == pytest.approx(0.7 / 0.6)


def test_results_and_wide_tables():
    models = [_model("b", "bf16", (0.8, 0.0126), path="/b"),
              _model("q", "qat", (0.75, None), path="/q")]
    res = results_table(_ev(models))
    assert res[["model", "metric", "value"]].values.tolist() == [["b", "acc", 0.8],
                                                                 ["q", "acc", 0.75]]
    wide = wide_table(res)
    assert list(wide.columns) == ["b", "q"]
    assert wide.loc[("t", "acc"), "b"] == "0.8000 ± 0.0126"
    assert wide.loc[("t", "acc"), "q"] == "0.7500"  # no stderr: the value alone


def test_group_eval_keeps_shared_baselines_once_and_refuses_other_documents(tmp_path):
    base = [_model("init", "bf16", (0.8, 0.1), path="/g/init"),
            _model("ptq", "ptq", (0.5, 0.1), path="/g/init", base="/g/init", recipe="mxfp4")]
    for i, (name, v) in enumerate((("r1", 0.7), ("r2", 0.65))):
        d = tmp_path / name / "eval"
        d.mkdir(parents=True)
        q = _model(name, "qat", (v, 0.1), path=f"/g/{name}", base="/g/init", recipe="mxfp4")
        (d / "eval.json").write_text(json.dumps({**_ev([*base, q]), "created": i}))
    g = group_eval(tmp_path)
    assert sorted(g.results["model"]) == ["init", "ptq", "r1", "r2"]
    assert g.recovery.set_index("model")["recovery"].to_dict() == {
        "r1": pytest.approx(2 / 3), "r2": pytest.approx(0.5)}
    bad = _model("r3", "qat", (0.6, 0.1), path="/g/r3", docs="other")
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "eval.json").write_text(json.dumps(_ev([*base, bad])))
    with pytest.raises(EvalFileError, match="other documents"):
        group_eval(tmp_path)


def test_read_eval_refuses_other_files(tmp_path):
    (tmp_path / "eval.json").write_text("{not json")
    with pytest.raises(EvalFileError, match="not valid JSON"):
        read_eval(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(EvalFileError, match="not a workbench eval result"):
        read_eval(tmp_path)
    (tmp_path / "eval.json").write_text(json.dumps({"format": FORMAT, "models": [{"label": 1}]}))
    with pytest.raises(EvalFileError, match="'models'"):
        read_eval(tmp_path)


def _frame(rows):
    return pd.DataFrame(rows)


def test_eval_within_judges_against_the_bf16_column():
    c, b = column("t", "acc"), column("t", "acc", "bf16")
    # 0.625 against 0.65625: 3.125 points below BF16 (binary fractions: an exact boundary)
    run = _frame([{"step": 1, "loss": 3.0}, {"step": 10, "loss": 2.0, c: 0.625, b: 0.65625}])
    assert EvalWithin("t", "acc", 3.125).evaluate(run, None).passed is True
    v = EvalWithin("t", "acc", 3.0).evaluate(run, None)
    assert v.passed is False and v.measured == 3.125
    better = _frame([{"step": 5, c: 0.70, b: 0.65}])
    assert EvalWithin("t", "acc", 0.0).evaluate(better, None).passed is True
    pending = EvalWithin("t", "acc", 1.0).evaluate(_frame([{"step": 1, "loss": 1.0}]), None)
    assert pending.passed is None and "not evaluated" in pending.detail
    # no /bf16 column: the evaluated baseline run answers
    own = _frame([{"step": 10, c: 0.60}])
    base = _frame([{"step": 10, c: 0.66}])
    v = EvalWithin("t", "acc", 5.0).evaluate(own, base)
    assert v.passed is False and v.measured == pytest.approx(6.0) and "baseline" in v.detail
    assert EvalWithin("t", "acc", 5.0).evaluate(own, None).passed is None
    table = check([EvalWithin("t", "acc", 3.125)], run)
    assert table["passed"].tolist() == [True]
    with pytest.raises(ValueError, match="points"):
        EvalWithin("t", "acc", -1)
