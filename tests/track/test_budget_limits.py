"""Each budget at its limit: a run measuring exactly the limit passes (every budget's name says
`<=` or `>=`, "within", "at least"), one measuring just past it fails.

The frames are built by hand so that the measured value is exactly the limit in floating
point (powers of two and small integers); the verdicts are written out, not computed.
"""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.track import (
    FakeQuantShare,
    NoDivergence,
    PeakMemory,
    StepTimeRatio,
    TokensPerSecRatio,
    ValLossWithin,
)
from workbench.track.budgets import RecoveryAtLeast, ValKLBelow
from workbench.track.expert_stats import ChurnBelow, DeadExpertsAtMost, ExpertErrorBelow


def _frame(**cols) -> pd.DataFrame:
    n = len(next(iter(cols.values())))
    return pd.DataFrame({"step": list(range(1, n + 1)), **cols})  # the trainer's steps


# val_loss 5 against the baseline's 4: exactly 25% above it
VAL = (_frame(val_loss=[6.0, 5.0]), _frame(val_loss=[6.0, 4.0]))
# 2-step means 2, 3, 3 of a loss 2, 2, 4, 2: the worst is exactly 1.5x the best so far
LOSS = (_frame(loss=[2.0, 2.0, 4.0, 2.0]), None)
# the newest val_kl is 0.25 (an older one was far above any limit here)
KL = (_frame(val_kl=[1.0, 0.25]), None)
# the gap to the teacher closes from 4 to 1: recovery exactly 0.75
REC = (_frame(val_loss=[5.0, 2.0], teacher_val_loss=[1.0, 1.0]), None)
# median step time 3 s against 1.5 s: exactly 2x; tokens/s 1000 against 2000: exactly 0.5x
TIME = (_frame(step_time_s=[3.0, 3.0, 3.0]), _frame(step_time_s=[1.5, 1.5, 1.5]))
TOKS = (_frame(tokens_per_s=[1000.0] * 3), _frame(tokens_per_s=[2000.0] * 3))
# median fake-quant share 0.5; peak memory 4 GiB
FQ = (_frame(fake_quant_share=[0.25, 0.5, 0.75]), None)
MEM = (_frame(peak_mem_gib=[1.0, 4.0, 2.0]), None)
# expert statistics: the newest worst-expert rel_err 0.125 (an older one far above), no dead
# expert at the newest record (three earlier), churn peaking at 0.25 after a 0.5 at step 1
WORST = (_frame(expert_worst_rel_err=[1.0, 0.125]), None)
DEAD = (_frame(experts_dead=[3.0, 0.0]), None)
ONE_DEAD = (_frame(experts_dead=[0.0, 1.0]), None)
CHURN = (_frame(expert_mean_churn=[0.5, 0.125, 0.25]), None)


@pytest.mark.parametrize("budget, data, measured, passed", [
    (ValLossWithin(25.0), VAL, 25.0, True),
    (ValLossWithin(24.0), VAL, 25.0, False),
    (NoDivergence(window=2, factor=1.5), LOSS, 1.5, True),
    (NoDivergence(window=2, factor=1.25), LOSS, 1.5, False),
    (ValKLBelow(0.25), KL, 0.25, True),
    (ValKLBelow(0.125), KL, 0.25, False),
    (RecoveryAtLeast(0.75), REC, 0.75, True),
    (RecoveryAtLeast(0.875), REC, 0.75, False),
    (StepTimeRatio(2.0, warmup=0), TIME, 2.0, True),
    (StepTimeRatio(1.75, warmup=0), TIME, 2.0, False),
    (TokensPerSecRatio(0.5, warmup=0), TOKS, 0.5, True),
    (TokensPerSecRatio(0.625, warmup=0), TOKS, 0.5, False),
    (FakeQuantShare(0.5, warmup=0), FQ, 0.5, True),
    (FakeQuantShare(0.25, warmup=0), FQ, 0.5, False),
    (PeakMemory(4.0), MEM, 4.0, True),
    (PeakMemory(3.5), MEM, 4.0, False),
    (ExpertErrorBelow(0.125), WORST, 0.125, True),
    (ExpertErrorBelow(0.0625), WORST, 0.125, False),
    (DeadExpertsAtMost(), DEAD, 0.0, True),  # the default: none dead
    (DeadExpertsAtMost(), ONE_DEAD, 1.0, False),
    (DeadExpertsAtMost(1), ONE_DEAD, 1.0, True),
    (ChurnBelow(0.25, warmup=1), CHURN, 0.25, True),  # steps after the warmup only
    (ChurnBelow(0.125, warmup=1), CHURN, 0.25, False),
    (ChurnBelow(0.25), CHURN, 0.5, False),  # no warmup: step 1 counts
], ids=lambda x: x.name if hasattr(x, "evaluate") else None)
def test_a_run_exactly_at_the_limit_passes(budget, data, measured, passed):
    run, baseline = data
    v = budget.evaluate(run, baseline)
    assert v.measured == measured
    assert v.passed is passed
