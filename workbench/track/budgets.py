"""Declarative convergence and performance budgets, checked during and after a run.

A budget is a small frozen dataclass with `evaluate(run, baseline) -> Verdict`. Inputs are
plain per-step metric frames (see `workbench.track.metrics.as_metrics`): the trainer's
metrics.jsonl, a wandb offline history, or a partial history of a live run. A verdict is
`passed=True/False`, or `None` while it cannot be decided yet (step not reached, no baseline,
metric not logged); `detail` says which.

Baseline-relative budgets compare against the BF16 run of the same seed and data; which run
that is, is decided by `workbench.track.compare`, not here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pandas as pd

from workbench.track.evals import column
from workbench.track.metrics import as_metrics
from workbench.train.logger import Logger


@dataclass(frozen=True)
class Verdict:
    budget: str
    measured: float
    limit: float
    passed: bool | None
    detail: str

    def __post_init__(self) -> None:
        # Budgets compute with numpy; the verdict holds plain Python values (JSON, summaries).
        object.__setattr__(self, "measured", float(self.measured))
        object.__setattr__(self, "limit", float(self.limit))
        if self.passed is not None:
            object.__setattr__(self, "passed", bool(self.passed))


class Budget(Protocol):
    @property
    def name(self) -> str: ...
    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict: ...


def _col(df: pd.DataFrame, column: str) -> pd.DataFrame:
    if column not in df.columns:
        return pd.DataFrame({"step": [], column: []})
    return df.loc[df[column].notna(), ["step", column]].astype({column: "float64"})


def _warmup_ok(name: str, warmup: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"{name}: warmup must be an int >= 0 (steps left out), got {warmup!r}")


def _positive(name: str, **values: float) -> None:
    for k, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}: {k} must be a finite number > 0, got {v!r}")


def _pct_gap(q: float, base: float) -> float:
    """100 x (q - base) / base; a baseline of 0 gives 0 for an equal value and +-inf otherwise
    (any excess over a zero loss is infinitely many percent), a non-finite q gives +inf."""
    if not math.isfinite(q):
        return math.inf
    if base == 0:
        return 0.0 if q == 0 else math.copysign(math.inf, q)
    return 100.0 * (q - base) / base


# --- convergence -------------------------------------------------------------------------

@dataclass(frozen=True)
class ValLossWithin:
    """QAT `metric` is at most `pct` percent above the baseline's at the same step: the last
    step at or before `at_step` (default: the run's newest step) where the baseline measured
    it. A NaN there fails."""

    pct: float
    at_step: int | None = None
    metric: str = "val_loss"

    def __post_init__(self) -> None:
        _positive("ValLossWithin", pct=self.pct)
        if self.at_step is not None and self.at_step < 0:
            raise ValueError(f"ValLossWithin: at_step must be >= 0, got {self.at_step}")

    @property
    def name(self) -> str:
        at = "last" if self.at_step is None else f"step {self.at_step}"
        return f"{self.metric} within {self.pct:g}% of baseline @ {at}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        def pending(why: str) -> Verdict:
            return Verdict(self.name, math.nan, self.pct, None, why)

        if baseline is None:
            return pending("no baseline run")
        if self.metric not in run.columns:
            return pending(f"run has no {self.metric} yet")
        b = _col(baseline, self.metric)
        last = int(run["step"].max()) if len(run) else -1
        if self.at_step is not None:
            if last < self.at_step:
                return pending(f"run is at step {last} < {self.at_step}")
            b = b[b["step"] <= self.at_step]
        # Both runs measure on the same schedule (same config), so a step where the baseline
        # has a value and the run a NaN cell is a NaN validation loss, not a missing one.
        steps = [int(s) for s in b["step"] if s <= last]
        if not steps:
            return pending(f"no step where both runs measured {self.metric} yet")
        vals = pd.to_numeric(run.set_index("step")[self.metric], errors="coerce")
        step = steps[-1]
        q = float(vals.get(step, math.nan))
        # The newest row of a live run may still lack its validation loss: judge the one before.
        # Not once the run has reached the baseline's last step (the end of the shared
        # schedule): a finished run's final NaN is a NaN, and fails.
        still_running = last < int(baseline["step"].max())
        if math.isnan(q) and step == last and len(steps) > 1 and still_running:
            step = steps[-2]
            q = float(vals.get(step, math.nan))
        base = float(b.loc[b["step"] == step, self.metric].iloc[-1])
        gap = _pct_gap(q, base)
        ok = math.isfinite(gap) and gap <= self.pct
        return Verdict(self.name, gap, self.pct, ok,
                       f"step {step}: {q:.6g} vs baseline {base:.6g} ({gap:+.3g}%)")


@dataclass(frozen=True)
class LossFinite:
    """No value of `metric` is NaN or infinite.

    In a metrics frame a NaN cell can also mean "not logged at this step" (validation loss is
    measured every few steps). For such metrics set `nan_means_missing=True`: then only
    infinities count, since the frame cannot tell a logged NaN from a missing value."""

    metric: str = "loss"
    nan_means_missing: bool = False

    @property
    def name(self) -> str:
        return f"{self.metric} finite"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        if self.metric not in run.columns:
            return Verdict(self.name, math.nan, 0, None, f"{self.metric} not logged")
        v = pd.to_numeric(run[self.metric], errors="coerce").to_numpy(dtype="float64")
        bad = np.isinf(v) if self.nan_means_missing else ~np.isfinite(v)
        steps = run["step"].to_numpy()[bad]
        n = int(bad.sum())
        logged = int((~np.isnan(v)).sum()) if self.nan_means_missing else len(v)
        detail = f"first non-finite at step {int(steps.min())}" if n else \
            f"all {logged} values finite"
        return Verdict(self.name, float(n), 0, n == 0, detail)


@dataclass(frozen=True)
class NoDivergence:
    """The `window`-step mean of `metric` never rises above `factor` times its best value so
    far. `metric` must be logged every step; a NaN counts as +inf (a NaN run has diverged)."""

    window: int = 20
    factor: float = 1.5
    metric: str = "loss"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"NoDivergence: window must be >= 1, got {self.window}")
        _positive("NoDivergence", factor=self.factor)

    @property
    def name(self) -> str:
        return f"no divergence ({self.window}-step mean <= {self.factor:g}x best)"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        if self.metric not in run.columns:
            return Verdict(self.name, math.nan, self.factor, None, f"{self.metric} not logged")
        v = pd.to_numeric(run[self.metric], errors="coerce").fillna(math.inf)
        if len(v) < self.window:
            return Verdict(self.name, math.nan, self.factor, None,
                           f"{len(v)} of {self.window} steps logged")
        mean = v.rolling(self.window).mean()
        # A rolling sum over an inf gives NaN (inf - inf) once the inf leaves the window.
        mean[np.isinf(v).astype(float).rolling(self.window).max() > 0] = math.inf
        mean = mean.iloc[self.window - 1:]
        best = mean.cummin()
        ratio = (mean / best).fillna(math.inf)  # inf/inf: diverged from the first window on
        worst = float(ratio.max())
        at = int(run.loc[ratio.idxmax(), "step"])
        return Verdict(self.name, worst, self.factor, worst <= self.factor,
                       f"worst window mean {worst:.3g}x the best so far, at step {at}")


# --- distillation (runs with --distill log val_kl and teacher_val_loss) -------------------

@dataclass(frozen=True)
class ValKLBelow:
    """The newest logged `val_kl` (KL(teacher || student) per token, T=1) is at most `limit`."""

    limit: float

    def __post_init__(self) -> None:
        _positive("ValKLBelow", limit=self.limit)

    @property
    def name(self) -> str:
        return f"val_kl <= {self.limit:g}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        c = _col(run, "val_kl")
        if not len(c):
            return Verdict(self.name, math.nan, self.limit, None, "val_kl not logged (--distill)")
        step, v = int(c["step"].iloc[-1]), float(c["val_kl"].iloc[-1])
        return Verdict(self.name, v, self.limit, math.isfinite(v) and v <= self.limit,
                       f"step {step}: val_kl {v:.4g}")


def recovery(run: pd.DataFrame) -> tuple[float, str]:
    """Fraction of the student's gap to the teacher closed since the first validation:

        1 - (val_loss_now - teacher_val_loss_now) / (val_loss_first - teacher_val_loss_first)

    1 = the student reached the teacher's validation loss, 0 = no progress since the first
    validation, < 0 = it fell further behind. NaN (with why) until two validations exist; a
    first gap <= 0 (the student already at or below the teacher) counts as fully recovered."""
    v, t = _col(run, "val_loss"), _col(run, "teacher_val_loss")
    both = v.merge(t, on="step")
    if len(both) < 2:
        return math.nan, f"{len(both)} validation(s) with teacher_val_loss; need 2"
    first, now = both.iloc[0], both.iloc[-1]
    gap0 = float(first["val_loss"] - first["teacher_val_loss"])
    gap = float(now["val_loss"] - now["teacher_val_loss"])
    where = f"gap {gap0:.4g} at step {int(first['step'])} -> {gap:.4g} at step {int(now['step'])}"
    if not math.isfinite(gap):
        return -math.inf, where
    return (1.0 if gap0 <= 0 else 1.0 - gap / gap0), where


@dataclass(frozen=True)
class RecoveryAtLeast:
    """`recovery(run)` (see there) is at least `fraction`."""

    fraction: float

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, (int, float)) and self.fraction <= 1):
            raise ValueError(f"RecoveryAtLeast: fraction must be a number <= 1, got "
                             f"{self.fraction!r}")

    @property
    def name(self) -> str:
        return f"recovery >= {self.fraction:g}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        r, detail = recovery(run)
        if math.isnan(r):
            return Verdict(self.name, r, self.fraction, None, detail)
        return Verdict(self.name, r, self.fraction, r >= self.fraction, detail)


# --- downstream evaluation (workbench eval writes these columns into the run's metrics) ----

@dataclass(frozen=True)
class EvalWithin:
    """The run's score on `task`'s `metric` (lm-eval's name, e.g. ``acc``, ``exact_match``, or
    ``exact_match,strict-match`` for a filter other than none) is at most `points` percentage
    points below the BF16 model's: 100 x (BF16 - run) <= points, for a higher-is-better metric
    in [0, 1]. The BF16 score is the run's own ``/bf16`` column (the model its QAT started from,
    evaluated with it by `workbench eval`), else the baseline run's score. Judged at the newest
    step that has both; pending until the run has been evaluated."""

    task: str
    metric: str
    points: float

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task or not isinstance(self.metric, str) \
                or not self.metric:
            raise ValueError("EvalWithin: task and metric must be non-empty names")
        if not (isinstance(self.points, (int, float)) and math.isfinite(self.points)
                and self.points >= 0):
            raise ValueError(f"EvalWithin: points must be a finite number >= 0, got "
                             f"{self.points!r}")

    @property
    def name(self) -> str:
        return f"{self.task} {self.metric} within {self.points:g} points of BF16"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        own, ref = column(self.task, self.metric), column(self.task, self.metric, "bf16")
        mine = _col(run, own)
        if not len(mine):
            return Verdict(self.name, math.nan, self.points, None,
                           f"not evaluated yet (no {own} column: run workbench eval)")
        if ref in run.columns and run[ref].notna().any():
            both = mine.merge(_col(run, ref), on="step")
            step, q, b = (int(both["step"].iloc[-1]), float(both[own].iloc[-1]),
                          float(both[ref].iloc[-1]))
            where = "the run's BF16 model"
        elif baseline is not None and len(_col(baseline, own)):
            base = _col(baseline, own)
            step, q = int(mine["step"].iloc[-1]), float(mine[own].iloc[-1])
            b = float(base[own].iloc[-1])
            where = "the baseline run"
        else:
            return Verdict(self.name, math.nan, self.points, None,
                           "no BF16 score: evaluate the run with its BF16 model, or give a "
                           "baseline run that was evaluated")
        gap = 100.0 * (b - q)
        return Verdict(self.name, gap, self.points, math.isfinite(gap) and gap <= self.points,
                       f"step {step}: {q:.4g} vs {b:.4g} of {where} ({gap:+.3g} points)")


# --- performance -------------------------------------------------------------------------

def _median_after(df: pd.DataFrame, column: str, warmup: int) -> tuple[float, int]:
    c = _col(df, column)
    # The first steps pay for compilation, allocator growth and data-loader start.
    c = c.iloc[warmup:] if len(c) > warmup else c.iloc[0:0]
    return (float(c[column].median()) if len(c) else math.nan), len(c)


class _RatioToBaseline:
    """Shared by the baseline-relative throughput budgets (subclasses declare the fields)."""

    column: str
    warmup: int

    def _ratio(self, run: pd.DataFrame, baseline: pd.DataFrame | None
               ) -> tuple[float, str | None]:
        if baseline is None:
            return math.nan, "no baseline run"
        q, nq = _median_after(run, self.column, self.warmup)
        b, nb = _median_after(baseline, self.column, self.warmup)
        if nq == 0 or nb == 0:
            return math.nan, (f"need > {self.warmup} warm-up steps of {self.column} "
                              f"(run {nq}, baseline {nb} after warm-up)")
        detail = f"median {q:.4g} vs baseline {b:.4g} over {nq}/{nb} steps"
        if b == 0:  # a zero median baseline: equal is 1x, anything above is infinitely more
            return (1.0 if q == 0 else math.inf), detail + " (baseline median is 0)"
        return q / b, detail


@dataclass(frozen=True)
class StepTimeRatio(_RatioToBaseline):
    """Median step time after warm-up is at most `max_ratio` x the baseline's."""

    max_ratio: float = 2.0
    column: str = "step_time_s"
    warmup: int = 2

    def __post_init__(self) -> None:
        _positive("StepTimeRatio", max_ratio=self.max_ratio)
        _warmup_ok("StepTimeRatio", self.warmup)

    @property
    def name(self) -> str:
        return f"step time <= {self.max_ratio:g}x baseline"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        ratio, detail = self._ratio(run, baseline)
        ok = None if math.isnan(ratio) else ratio <= self.max_ratio
        return Verdict(self.name, ratio, self.max_ratio, ok, detail or "")


@dataclass(frozen=True)
class TokensPerSecRatio(_RatioToBaseline):
    """Median tokens/s after warm-up is at least `min_ratio` x the baseline's."""

    min_ratio: float = 0.5
    column: str = "tokens_per_s"
    warmup: int = 2

    def __post_init__(self) -> None:
        _positive("TokensPerSecRatio", min_ratio=self.min_ratio)
        _warmup_ok("TokensPerSecRatio", self.warmup)

    @property
    def name(self) -> str:
        return f"tokens/s >= {self.min_ratio:g}x baseline"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        ratio, detail = self._ratio(run, baseline)
        ok = None if math.isnan(ratio) else ratio >= self.min_ratio
        return Verdict(self.name, ratio, self.min_ratio, ok, detail or "")


@dataclass(frozen=True)
class FakeQuantShare:
    """Median share of step time spent in fake quantization is at most `max_share`."""

    max_share: float = 0.5
    column: str = "fake_quant_share"
    warmup: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.max_share <= 1:
            raise ValueError(f"FakeQuantShare: max_share must be in (0, 1], "
                             f"got {self.max_share}")
        _warmup_ok("FakeQuantShare", self.warmup)

    @property
    def name(self) -> str:
        return f"fake-quant share <= {self.max_share:.0%}"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        share, n = _median_after(run, self.column, self.warmup)
        if n == 0:
            return Verdict(self.name, math.nan, self.max_share, None,
                           f"{self.column} not logged after {self.warmup} warm-up steps")
        return Verdict(self.name, share, self.max_share, share <= self.max_share,
                       f"median over {n} steps")


@dataclass(frozen=True)
class PeakMemory:
    """Peak memory per rank (the largest value logged) is at most `max_gib` GiB."""

    max_gib: float
    column: str = "peak_mem_gib"

    def __post_init__(self) -> None:
        _positive("PeakMemory", max_gib=self.max_gib)

    @property
    def name(self) -> str:
        return f"peak memory <= {self.max_gib:g} GiB"

    def evaluate(self, run: pd.DataFrame, baseline: pd.DataFrame | None) -> Verdict:
        c = _col(run, self.column)
        if c.empty:
            return Verdict(self.name, math.nan, self.max_gib, None, f"{self.column} not logged")
        peak = float(c[self.column].max())
        at = int(c.loc[c[self.column].idxmax(), "step"])
        return Verdict(self.name, peak, self.max_gib, peak <= self.max_gib,
                       f"peak {peak:.3g} GiB at step {at}")


# --- checking and reporting --------------------------------------------------------------

def default_budgets() -> tuple[Budget, ...]:
    """A starting point for MXFP4/NVFP4 QAT against BF16; tighten per project."""
    return (ValLossWithin(pct=2.0), LossFinite(), NoDivergence(window=20, factor=1.5),
            StepTimeRatio(max_ratio=2.0), FakeQuantShare(max_share=0.5))


COLUMNS = ["budget", "measured", "limit", "passed", "detail"]


def check(budgets: Sequence[Budget], run: Any, baseline: Any = None) -> pd.DataFrame:
    """One row per budget: budget, measured, limit, passed (True/False/<NA>), detail.
    `run`/`baseline`: metric frames, OfflineRuns or run folders (see `as_metrics`)."""
    r = as_metrics(run)
    b = None if baseline is None else as_metrics(baseline)
    rows = [b_.evaluate(r, b).__dict__ for b_ in budgets]
    table = pd.DataFrame(rows, columns=COLUMNS)
    table["passed"] = table["passed"].astype("boolean")
    return table


def publish(table: pd.DataFrame, logger: Logger, alerted: set[str] | None = None,
            run_name: str = "") -> set[str]:
    """Write verdicts into the run summary and alert once per newly failed budget.
    Returns the set of budgets alerted so far (pass it back on the next call)."""
    alerted = set() if alerted is None else set(alerted)
    values: dict[str, Any] = {}
    for row in table.itertuples(index=False):
        passed = None if pd.isna(row.passed) else bool(row.passed)
        values[f"budget/{row.budget}"] = {"passed": passed, "measured": float(row.measured),
                                          "limit": float(row.limit), "detail": row.detail}
    decided = table["passed"].dropna()
    if (~decided.astype(bool)).any():
        values["budget/all_passed"] = False
    else:  # None while some budget is still pending
        values["budget/all_passed"] = True if len(decided) == len(table) else None
    logger.summary(values)
    failed = table[table["passed"].fillna(True).astype(bool).eq(False)]
    for row in failed.itertuples(index=False):
        if row.budget in alerted:
            continue
        who = f"{run_name}: " if run_name else ""
        logger.alert(f"budget violated: {row.budget}",
                     f"{who}measured {row.measured:.4g}, limit {row.limit:.4g}; {row.detail}")
        alerted.add(row.budget)
    return alerted


@dataclass
class BudgetWatch:
    """Checks budgets on a growing history and reports each new violation once; call
    `update` every few steps from the trainer (rank 0) and once at the end."""

    budgets: Sequence[Budget]
    logger: Logger
    baseline: Any = None  # a metric frame, OfflineRun or run folder (see `as_metrics`)
    run_name: str = ""
    alerted: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.baseline is not None:
            self.baseline = as_metrics(self.baseline)

    def update(self, run: Any) -> pd.DataFrame:
        table = check(self.budgets, run, self.baseline)
        self.alerted = publish(table, self.logger, self.alerted, self.run_name)
        return table
