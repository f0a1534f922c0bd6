"""The verdict rule of `workbench compare` at its tolerance, on hand-built errors.

The rule a user reads in `--help` and docs/compare.md: "improved" when A's error is more than
`tol_pct` percent below B's, "worse" when more than `tol_pct` percent above, "same" otherwise; a
change of exactly `tol_pct` is "same", and at `tol_pct=0` equal errors are "same". Every
expected verdict below is written by hand, never computed with the code's formula.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import write_dense

from workbench.analysis import compare
from workbench.analysis.compare import combine

ROOT = Path(__file__).parents[2]

# (A's error, B's error): 1% less, 1% more, equal, B exact with A not, both exact, A exact
ROWS = [(99.0, 100.0), (101.0, 100.0), (5.0, 5.0), (1.0, 0.0), (0.0, 0.0), (0.0, 1.0)]


def _side(errors):
    return pd.DataFrame({"kind": "routed", "layer": 1, "expert": list(range(len(errors))),
                         "proj": "gate", "rel_err": errors,
                         "max_abs_err": [2 * e for e in errors]})


@pytest.mark.parametrize("tol, verdicts", [
    (1.0, ["same", "same", "same", "worse", "same", "improved"]),
    (0.0, ["improved", "worse", "same", "worse", "same", "improved"]),
    (0.5, ["improved", "worse", "same", "worse", "same", "improved"]),
    (1.5, ["same", "same", "same", "worse", "same", "improved"]),
    (100.0, ["same", "same", "same", "worse", "same", "same"]),  # -100% is not beyond 100%
])
def test_verdicts_of_hand_built_rows(tol, verdicts):
    a, b = _side([x for x, _ in ROWS]), _side([y for _, y in ROWS])
    t = combine(a, b, "rel_err", tol)
    assert list(t.expert) == list(range(len(ROWS)))
    assert list(t.change_pct) == [-1.0, 1.0, 0.0, math.inf, 0.0, -100.0]
    assert list(t.verdict) == verdicts
    # the metric chosen decides: max_abs_err is 2x rel_err here, so the same percentages
    assert list(combine(a, b, "max_abs_err", tol).verdict) == verdicts


def test_swapping_the_sides_swaps_improved_and_worse():
    a, b = _side([99.0, 101.0, 5.0]), _side([100.0, 100.0, 5.0])
    assert list(combine(b, a, "rel_err", 0.0).verdict) == ["worse", "improved", "same"]


# Checkpoints whose errors are exact: W on a 1/64 grid, A = W + 2E, B = W + E with E = +-1/64, all
# exact in BF16, so max_abs_err is 2/64 against 1/64 on every weight: +100% exactly (-50% with
# the sides swapped), and 100 * delta / B is exact for these powers of two. The boundary is
# reached by real data, not only by hand-built rows. (rel_err's square roots are not exact, so
# `100 * delta / B` lands an ulp off 100: only its equal-error case, W + E against W - E, is used.)


@pytest.fixture(scope="module")
def grid_ckpts(tmp_path_factory):
    t = tmp_path_factory.mktemp("verdict")
    g = torch.Generator().manual_seed(0)
    w, e = {}, {}
    for L in range(2):
        for x in range(2):
            for n in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{L}.mlp.experts.{x}.{n}.weight"
                w[name] = torch.randint(-64, 65, (16, 32), generator=g).float() / 64
                e[name] = (torch.randint(0, 2, (16, 32), generator=g).float() * 2 - 1) / 64
    out = {"ref": write_dense(t / "ref", {n: v.bfloat16() for n, v in w.items()})}
    for label, f in (("plus2", 2), ("plus1", 1), ("minus1", -1)):
        sd = {n: (w[n] + f * e[n]).bfloat16() for n in w}
        assert all(torch.equal(sd[n].float() - w[n], f * e[n]) for n in w)  # exact in BF16
        out[label] = write_dense(t / label, sd)
    return out


@pytest.mark.parametrize("a, b, metric, tol, change, verdict", [
    ("plus2", "plus1", "max_abs_err", 100.0, 100.0, "same"),  # exactly +100% at 100: inside
    ("plus2", "plus1", "max_abs_err", 99.0, 100.0, "worse"),
    ("plus1", "plus2", "max_abs_err", 50.0, -50.0, "same"),  # exactly -50% at 50
    ("plus1", "plus2", "max_abs_err", 49.0, -50.0, "improved"),
    ("plus1", "minus1", "rel_err", 0.0, 0.0, "same"),  # equal errors at tolerance 0
    ("plus1", "minus1", "max_abs_err", 0.0, 0.0, "same"),
])
def test_verdict_at_the_tolerance_on_checkpoints(grid_ckpts, a, b, metric, tol, change, verdict):
    r = compare(grid_ckpts[a], grid_ckpts[b], grid_ckpts["ref"], metric=metric, tol_pct=tol,
                progress=False, device="cpu")
    assert len(r.table) == 12
    assert (r.table.change_pct == change).all()
    assert set(r.table.verdict) == {verdict}


def test_cli_tolerance_is_inclusive(grid_ckpts, tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "compare", str(grid_ckpts["plus2"]),
                        str(grid_ckpts["plus1"]), "--reference", str(grid_ckpts["ref"]),
                        "--metric", "max_abs_err", "--tol-pct", "100", "--device", "cpu",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr
    df = pd.read_csv(out / "compare.csv")
    assert len(df) == 12 and (df.change_pct == 100.0).all()
    assert (df.verdict == "same").all()
    assert "improved 0, same 12, worse 0" in p.stdout
