"""The trainer's per-expert telemetry, read back: tables for notebooks and budgets on it.

`read(run_dir)` loads `OUT/expert_stats.parquet` (columns: `workbench.train.expert_stats`);
`per_expert` reduces the three projections to one value per expert (max for errors and churn,
the routed load once); `error_growth` and `final_difference` are what notebook 05 draws.
The budgets read the summary scalars the trainer logs next to the loss at every record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from workbench.track.budgets import Verdict, _positive
from workbench.train.expert_stats import read_expert_stats

__all__ = [
    "ChurnBelow", "DeadExpertsAtMost", "ExpertErrorBelow", "error_growth", "final_difference",
    "per_expert", "read",
]

_REDUCE = {"rel_err": "max", "sqnr_db": "min", "churn": "max", "sat_frac": "max",
           "clip_frac": "max", "amax_drift": "max", "load": "first", "act_amax": "first"}


def read(run_dir: str | Path) -> pd.DataFrame:
    return read_expert_stats(run_dir)


def per_expert(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per step x layer x expert: `metric` over the projections (worst of the three;
    load and activation amax are per expert already)."""
    how = _REDUCE.get(metric, "max")
    return df.groupby(["step", "layer", "expert"], as_index=False)[metric].agg(how)


def error_growth(df: pd.DataFrame, metric: str = "rel_err") -> pd.DataFrame:
    """Per layer x expert: `metric` (worst projection) at the first and the last record."""
    g = per_expert(df, metric)
    first, last = g["step"].min(), g["step"].max()
    a = g[g["step"] == first].set_index(["layer", "expert"])[metric]
    b = g[g["step"] == last].set_index(["layer", "expert"])[metric]
    out = pd.DataFrame({"first": a, "last": b}).reset_index()
    out["growth"] = out["last"] - out["first"]
    return out.sort_values("growth", ascending=False, ignore_index=True)


def final_difference(a: pd.DataFrame, b: pd.DataFrame, metric: str = "rel_err") -> pd.DataFrame:
    """Per layer x expert: `metric` of run a minus run b at each run's last record."""
    def last(df: pd.DataFrame) -> pd.Series:
        g = per_expert(df, metric)
        return g[g["step"] == g["step"].max()].set_index(["layer", "expert"])[metric]

    la, lb = last(a), last(b)
    if not la.index.equals(lb.index):
        raise ValueError("final_difference: the runs have different layers or experts")
    return pd.DataFrame({"a": la, "b": lb, "diff": la - lb}).reset_index()


def _newest_at_most(name: str, run: pd.DataFrame, column: str, limit: float, what: str
                    ) -> Verdict:
    """The verdict `column`'s newest logged value <= limit (pending while none is logged; a
    NaN fails). `what` formats the detail from the value."""
    v = run.loc[run[column].notna(), ["step", column]] if column in run.columns else None
    if v is None or v.empty:
        return Verdict(name, math.nan, limit, None, "no expert statistics logged")
    step, value = int(v.iloc[-1]["step"]), float(v.iloc[-1][column])
    return Verdict(name, value, limit, math.isfinite(value) and value <= limit,
                   f"step {step}: " + what.format(value))


@dataclass(frozen=True)
class ExpertErrorBelow:
    """The worst expert's relative weight error at the newest record is at most `limit`."""

    limit: float

    def __post_init__(self) -> None:
        _positive("ExpertErrorBelow", limit=self.limit)

    @property
    def name(self) -> str:
        return f"worst expert rel_err <= {self.limit:g}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        return _newest_at_most(self.name, run, "expert_worst_rel_err", self.limit,
                               "worst expert {:.4g}")


@dataclass(frozen=True)
class DeadExpertsAtMost:
    """At most `count` experts got no tokens in each of the trainer's last `dead_intervals`
    record intervals (`experts_dead`, default 3 intervals), at the newest record."""

    count: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"DeadExpertsAtMost: count must be an integer >= 0, got "
                             f"{self.count!r}")

    @property
    def name(self) -> str:
        return f"dead experts <= {self.count}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        return _newest_at_most(self.name, run, "experts_dead", self.count,
                               "{:.0f} experts without tokens for the last intervals")


@dataclass(frozen=True)
class ChurnBelow:
    """Mean code churn between records never exceeds `limit` (after the first `warmup`
    records' steps), a ceiling on how much the quantized model moves per interval."""

    limit: float
    warmup: int = 0

    def __post_init__(self) -> None:
        # churn is a share of codes in [0, 1]: a limit above 1 is a typo (a percentage?)
        if not (isinstance(self.limit, (int, float)) and 0 < self.limit <= 1):
            raise ValueError(f"ChurnBelow: limit must be in (0, 1], got {self.limit!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"ChurnBelow: warmup must be an integer >= 0, got {self.warmup!r}")

    @property
    def name(self) -> str:
        return f"mean code churn <= {self.limit:g}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        if "expert_mean_churn" not in run.columns:
            return Verdict(self.name, math.nan, self.limit, None, "no expert statistics logged")
        v = run.loc[(run["step"] > self.warmup) & run["expert_mean_churn"].notna(),
                    ["step", "expert_mean_churn"]]
        if v.empty:
            return Verdict(self.name, math.nan, self.limit, None,
                           f"no churn recorded after step {self.warmup} yet")
        worst = v.loc[v["expert_mean_churn"].idxmax()]
        m = float(worst["expert_mean_churn"])
        return Verdict(self.name, m, self.limit, m <= self.limit,
                       f"highest at step {int(worst['step'])}: {m:.4g}")
