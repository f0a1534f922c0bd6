"""The budget table in display units, for the budget chart and for reading.

`check` / `compare` keep what each budget computed (a gap in percent, a ratio, a share as a
fraction, a count). A chart of measured against limit needs one unit per budget, said on the
axis, and a verdict a reader can parse: this module maps each budget type to its unit and
direction, converts shares to percent so no column mixes percent and fractions, and writes
`pending` where pandas would show `<NA>`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from workbench.track.budgets import (
    Budget,
    FakeQuantShare,
    LossFinite,
    NoDivergence,
    PeakMemory,
    StepTimeRatio,
    TokensPerSecRatio,
    ValLossWithin,
)

# budget type -> (unit on the axis, factor from the measured value to that unit, pass direction)
UNITS: dict[type, tuple[str, float, str]] = {
    ValLossWithin: ("% above the baseline", 1.0, "max"),
    LossFinite: ("non-finite values (count)", 1.0, "max"),
    NoDivergence: ("window mean / best so far (x)", 1.0, "max"),
    StepTimeRatio: ("median step time / baseline (x)", 1.0, "max"),
    TokensPerSecRatio: ("median tokens/s / baseline (x)", 1.0, "min"),
    FakeQuantShare: ("% of step time", 100.0, "max"),
    PeakMemory: ("GiB per rank", 1.0, "max"),
}

# The row `workbench.track.compare` adds for a run it could not read: measured 0 runs read
# against a limit of 1, so the chart draws it as a failed bar, never as "pending".
RUN_READABLE = "run file readable"
_READABLE_UNIT = ("runs read (1: read, 0: unreadable)", 1.0, "min")

CHART_COLUMNS = ["run", "budget", "measured", "limit", "unit", "direction", "verdict", "detail"]


def unit_of(budget: Budget) -> tuple[str, float, str]:
    """(unit, factor, direction) of a budget; a budget type not listed here may declare
    `unit`, `unit_factor` and `direction` attributes, else its values are shown as computed."""
    for cls in type(budget).__mro__:
        if cls in UNITS:
            return UNITS[cls]
    return (getattr(budget, "unit", "value"), float(getattr(budget, "unit_factor", 1.0)),
            getattr(budget, "direction", "max"))


def verdict(passed) -> str:
    return "pending" if passed is None or pd.isna(passed) else ("PASS" if bool(passed) else "FAIL")


def chart_data(table: pd.DataFrame, budgets: Sequence[Budget]) -> pd.DataFrame:
    """`table` (from `check` or `compare(...).budgets`) with measured and limit in each
    budget's display unit, plus unit, direction and verdict (PASS / FAIL / pending).
    `budgets` are the budget objects that made the table (matched by name)."""
    by_name = {RUN_READABLE: _READABLE_UNIT, **{b.name: unit_of(b) for b in budgets}}
    missing = sorted(set(table["budget"]) - set(by_name))
    if missing:
        raise KeyError(f"chart_data: no budget object for {missing}; pass the budgets that "
                       "made the table")
    rows = []
    for r in table.to_dict("records"):
        unit, factor, direction = by_name[r["budget"]]
        rows.append({"run": r.get("run", ""), "budget": r["budget"],
                     "measured": float(r["measured"]) * factor,
                     "limit": float(r["limit"]) * factor, "unit": unit, "direction": direction,
                     "verdict": verdict(r["passed"]), "detail": r.get("detail", "")})
    return pd.DataFrame(rows, columns=CHART_COLUMNS)
