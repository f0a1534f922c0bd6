"""Budgets on distillation metrics: val_kl and recovery of the gap to the teacher."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from workbench.track.budgets import RecoveryAtLeast, ValKLBelow, recovery


def frame(rows):
    return pd.DataFrame(rows)


def test_recovery_is_the_share_of_the_first_gap_closed():
    # teacher 2.0; student 3.0 at the first validation, 2.25 at the last: 0.75 of the gap.
    run = frame([{"step": 1, "loss": 3.1}, {"step": 5, "val_loss": 3.0, "teacher_val_loss": 2.0},
                 {"step": 6, "loss": 2.5}, {"step": 10, "val_loss": 2.25,
                                             "teacher_val_loss": 2.0}])
    r, detail = recovery(run)
    assert r == pytest.approx(0.75) and "step 5" in detail and "step 10" in detail
    assert RecoveryAtLeast(0.7).evaluate(run, None).passed is True
    assert RecoveryAtLeast(0.8).evaluate(run, None).passed is False
    worse = frame([{"step": 5, "val_loss": 3.0, "teacher_val_loss": 2.0},
                   {"step": 10, "val_loss": 3.5, "teacher_val_loss": 2.0}])
    assert recovery(worse)[0] == pytest.approx(-0.5)
    nan = frame([{"step": 5, "val_loss": 3.0, "teacher_val_loss": 2.0},
                 {"step": 10, "val_loss": math.nan, "teacher_val_loss": 2.0}])
    assert RecoveryAtLeast(0.5).evaluate(nan, None).passed is None  # one usable validation


def test_recovery_pending_without_two_validations_or_teacher():
    one = frame([{"step": 5, "val_loss": 3.0, "teacher_val_loss": 2.0}])
    assert RecoveryAtLeast(0.5).evaluate(one, None).passed is None
    plain = frame([{"step": 5, "val_loss": 3.0}, {"step": 10, "val_loss": 2.0}])
    assert RecoveryAtLeast(0.5).evaluate(plain, None).passed is None
    at_teacher = frame([{"step": 5, "val_loss": 2.0, "teacher_val_loss": 2.0},
                        {"step": 10, "val_loss": 2.0, "teacher_val_loss": 2.0}])
    assert recovery(at_teacher)[0] == 1.0
    with pytest.raises(ValueError, match="fraction"):
        RecoveryAtLeast(1.5)


def test_val_kl_below_takes_the_newest_value():
    run = frame([{"step": 5, "val_kl": 0.5}, {"step": 7, "loss": 1.0}, {"step": 10, "val_kl": 0.05}])
    v = ValKLBelow(0.1).evaluate(run, None)
    assert v.passed is True and v.measured == 0.05 and "step 10" in v.detail
    assert ValKLBelow(0.01).evaluate(run, None).passed is False
    assert ValKLBelow(0.1).evaluate(frame([{"step": 1, "loss": 1.0}]), None).passed is None
