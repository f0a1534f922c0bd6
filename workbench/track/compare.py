"""Compare a run group: a BF16 baseline and QAT runs, as curves and a budget table.

Runs come from wandb offline folders (`find_runs`) or from trainer run folders holding
metrics.jsonl (plus result.json / config.json when present). Each QAT run is judged against
the baseline of the same seed: baseline-relative budgets only mean something when data and
initialisation are the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from workbench.track.budgets import COLUMNS, Budget, check, default_budgets
from workbench.track.metrics import METRICS_FILE, as_metrics, read_metrics
from workbench.track.offline import find_runs, merge_segments, run_files
from workbench.track.wandb_file import CorruptRunFile

# Recipe names that mean "no quantization": the run every QAT run is measured against.
BASELINE_RECIPES = ("bf16", "none", "baseline")


@dataclass
class RunData:
    name: str
    metrics: pd.DataFrame  # see workbench.track.metrics.as_metrics
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    folder: Path | None = None  # the trainer's output folder (--out), when known

    @property
    def recipe(self) -> str | None:
        r = self.config.get("recipe")
        return None if r is None else str(r)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def is_baseline(self) -> bool:
        return self.recipe is not None and self.recipe.lower() in BASELINE_RECIPES


@dataclass
class Comparison:
    runs: list[RunData]
    curves: pd.DataFrame  # long form: run, recipe, step, <metrics...>
    budgets: pd.DataFrame  # run, baseline, budget, measured, limit, passed, detail
    corrupt: list[CorruptRunFile] = field(default_factory=list)  # run files that were skipped


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg})") from exc
    return obj if isinstance(obj, dict) else {}


def load_run_folder(folder: str | Path) -> RunData:
    """A trainer output folder: metrics.jsonl, and config from config.json or result.json."""
    d = Path(folder)
    result = _read_json(d / "result.json")
    config = _read_json(d / "config.json") or dict(result.get("config") or {})
    return RunData(name=str(config.get("name") or d.name), metrics=read_metrics(d),
                   config=config, summary=result, source=str(d), folder=d)


def load_runs(path: str | Path, group: str | None = None,
              source: Literal["auto", "wandb", "metrics"] = "auto",
              corrupt: list[CorruptRunFile] | None = None) -> list[RunData]:
    """Every run under `path`. `source="auto"` reads wandb offline runs when there are any
    (they carry config and summary), else the trainer's metrics.jsonl folders. wandb runs of
    one folder with the same group and name are attempts at one run and are merged. A damaged
    wandb run file raises CorruptRunFile, or with a `corrupt` list is skipped and put there."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such run-group folder")
    if source in ("auto", "wandb"):
        if run_files(p):
            return [RunData(name=r.name, metrics=as_metrics(r), config=r.config,
                            summary=r.summary, source=";".join(r.paths),
                            folder=_trainer_folder(r.paths[0]))
                    for r in _wandb_runs(p, group, corrupt)]
        if source == "wandb":
            raise FileNotFoundError(f"{p}: no wandb run files (run-*.wandb) under this folder")
    runs = [load_run_folder(f.parent) for f in sorted(p.rglob(METRICS_FILE))]
    if group is not None:
        runs = [r for r in runs if r.config.get("run_group", r.config.get("group")) == group]
    if not runs:
        raise FileNotFoundError(f"{p}: no runs (no run-*.wandb and no {METRICS_FILE}) found")
    return runs


def _trainer_folder(run_file: str) -> Path:
    # The trainer logs to <--out>/wandb/offline-run-*/run-*.wandb.
    return Path(run_file).parents[2]


def _wandb_runs(path: Path, group: str | None, corrupt: list[CorruptRunFile] | None = None):
    # The trainer logs to <run folder>/wandb/. A resumed job may start a new wandb run (new
    # id) in the same folder under the same name and group: those are attempts at one run.
    attempts: dict[tuple[str, str, str], list] = {}
    for r in find_runs(path, group=group, corrupt=corrupt):
        folder = str(_trainer_folder(r.paths[0]))
        attempts.setdefault((folder, r.group, r.name), []).append(r)
    runs = [merge_segments(a) for a in attempts.values()]
    return sorted(runs, key=lambda r: r.start_time)


def pick_baseline(run: RunData, runs: Sequence[RunData]) -> RunData | None:
    """The baseline of the same seed; the only baseline when seeds are not recorded."""
    bases = [r for r in runs if r.is_baseline and r is not run]
    same = [r for r in bases if r.seed is not None and r.seed == run.seed]
    if same:
        return same[-1]
    if len(bases) == 1 and (run.seed is None or bases[0].seed is None):
        return bases[0]
    return None


def runs_table(runs: Sequence[RunData]) -> pd.DataFrame:
    """One row per run: name, recipe, seed, baseline flag, last step, last loss (NaN if the
    run ended in NaN), last validation loss, and where it was read from."""
    def last(m: pd.DataFrame, col: str, every_step: bool) -> float:
        # loss is logged every step, so its last cell is the last value, NaN included;
        # val_loss cells are empty between validations.
        v = m[col] if col in m.columns else m.iloc[0:0, 0]
        v = v if every_step else v.dropna()
        return float(v.iloc[-1]) if len(v) else float("nan")

    rows = []
    for r in runs:
        m = r.metrics
        rows.append({"run": r.name, "recipe": r.recipe, "seed": r.seed,
                     "baseline": r.is_baseline,
                     "last_step": int(m["step"].max()) if len(m) else None,
                     "loss": last(m, "loss", True), "val_loss": last(m, "val_loss", False),
                     "source": r.source})
    return pd.DataFrame(rows)


def curves(runs: Sequence[RunData]) -> pd.DataFrame:
    """All runs' metrics in long form: run, recipe, step, then the metric columns."""
    parts = [r.metrics.assign(run=r.name, recipe=r.recipe) for r in runs]
    if not parts:
        return pd.DataFrame(columns=["run", "recipe", "step"])
    df = pd.concat(parts, ignore_index=True)
    first = ["run", "recipe", "step"]
    return df[first + [c for c in df.columns if c not in first]]


def compare(runs: str | Path | Sequence[RunData], budgets: Sequence[Budget] | None = None,
            baseline: str | None = None, group: str | None = None) -> Comparison:
    """Curves of all runs and the budget table of every non-baseline run. `baseline` names
    the baseline run explicitly (otherwise: recipe bf16/none of the same seed)."""
    corrupt: list[CorruptRunFile] = []
    if isinstance(runs, (str, Path)):
        # One damaged run file must not hide the verdicts of the others: it is skipped, listed
        # in `Comparison.corrupt`, and failed in the budget table.
        runs = load_runs(runs, group=group, corrupt=corrupt)
    runs = list(runs)
    budgets = default_budgets() if budgets is None else budgets
    names = [r.name for r in runs]
    if baseline is not None and baseline not in names:
        raise KeyError(f"baseline run {baseline!r} is not in the group (runs: {names})")
    tables = []
    for r in runs:
        if (baseline is not None and r.name == baseline) or (baseline is None and r.is_baseline):
            continue
        base = (next(x for x in runs if x.name == baseline) if baseline is not None
                else pick_baseline(r, runs))
        t = check(budgets, r.metrics, None if base is None else base.metrics)
        t.insert(0, "baseline", None if base is None else base.name)
        t.insert(0, "run", r.name)
        tables.append(t)
    for exc in corrupt:
        row = {"run": exc.path, "baseline": None, "budget": "run file readable",
               "measured": float("nan"), "limit": float("nan"), "passed": False,
               "detail": str(exc)}
        tables.append(pd.DataFrame([row]).astype({"passed": "boolean"}))
    table = (pd.concat(tables, ignore_index=True) if tables
             else pd.DataFrame(columns=["run", "baseline", *COLUMNS]))
    return Comparison(runs=runs, curves=curves(runs), budgets=table, corrupt=corrupt)
