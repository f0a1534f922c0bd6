"""Compare a run group: a BF16 baseline and QAT runs, as curves and a budget table.

Runs come from wandb offline folders (`find_runs`) and from trainer run folders holding
metrics.jsonl (plus result.json / config.json when present); a run folder holding both is read
from the longer of the two, with a warning when they differ (`load_runs`). Each QAT run is judged against
the baseline of the same seed: baseline-relative budgets only mean something when data and
initialisation are the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pandas as pd

from workbench._io import read_json
from workbench.track.budget_chart import RUN_READABLE
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
    # runs that could not be read at all (a damaged wandb file with no metrics.jsonl beside
    # it, an unreadable run folder): skipped, and failed in `budgets`
    corrupt: list[CorruptRunFile | UnreadableRun] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    obj = read_json(path, what=path.name)  # JSONFileError: a ValueError naming the file
    return obj if isinstance(obj, dict) else {}


class UnreadableRun(ValueError):
    """A trainer run folder whose metrics or config cannot be read; the message names the file."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{path}: unreadable run ({reason})")
        self.path = str(path)
        self.reason = reason


class RunSourceWarning(UserWarning):
    """A run's two records (its wandb run file and its metrics.jsonl) disagree, or one is
    missing or damaged: the warning names the run, both lengths and the one used."""


def load_run_folder(folder: str | Path) -> RunData:
    """A trainer output folder: metrics.jsonl, and config from config.json or result.json.
    Raises UnreadableRun naming the file when the folder cannot be read."""
    d = Path(folder)
    try:
        result = _read_json(d / "result.json")
        config = _read_json(d / "config.json") or dict(result.get("config") or {})
        metrics = read_metrics(d)
    except (ValueError, OSError) as exc:  # BadMetricsFile, bad JSON, permissions
        raise UnreadableRun(d, str(exc)) from exc
    # the trainer names its wandb run --run-name, else the folder: the same name either way
    name = config.get("name") or config.get("run_name") or d.name
    return RunData(name=str(name), metrics=metrics, config=config, summary=result,
                   source=str(d), folder=d)


def load_runs(path: str | Path, group: str | None = None,
              source: Literal["auto", "wandb", "metrics"] = "auto",
              corrupt: list[CorruptRunFile | UnreadableRun] | None = None) -> list[RunData]:
    """Every run under `path`; with `group`, only those of that run group.

    `source="auto"` reads both records a trainer run folder holds, its wandb offline run file
    (which carries config and summary) and its `metrics.jsonl`, and uses the longer (more
    steps; the wandb file on a tie), with one `RunSourceWarning` line naming the run and both
    lengths when they differ, when one is missing while the group has the other, or when the
    wandb file is damaged. `"wandb"` / `"metrics"` read only that record. wandb runs of one
    folder with the same group and name are attempts at one run and are merged.

    A run that cannot be read at all (a damaged wandb file with no metrics.jsonl beside it, a
    folder whose metrics or config cannot be parsed) raises CorruptRunFile / UnreadableRun, or,
    with a `corrupt` list, is warned about, put there and skipped."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such run-group folder")
    if source == "wandb":
        if not run_files(p):
            raise FileNotFoundError(f"{p}: no wandb run files (run-*.wandb) under this folder")
        return [_from_wandb(r) for r in _wandb_runs(p, group, corrupt)]
    folders = sorted({f.parent for f in p.rglob(METRICS_FILE)})
    if source == "metrics" or not run_files(p):
        runs = [r for r in (_read_folder(f, corrupt) for f in folders)
                if r is not None and _in_group(r.config, group)]
    else:
        runs = _both_records(p, folders, group, corrupt)
    if not runs and not corrupt:
        raise FileNotFoundError(f"{p}: no runs (no run-*.wandb and no {METRICS_FILE}) found")
    return runs


def _in_group(config: dict[str, Any], group: str | None) -> bool:
    return group is None or config.get("run_group", config.get("group")) == group


def _from_wandb(r) -> RunData:
    return RunData(name=r.name, metrics=as_metrics(r), config=r.config, summary=r.summary,
                   source=";".join(r.paths), folder=_trainer_folder(r.paths[0]))


def _unreadable(exc: CorruptRunFile | UnreadableRun,
                corrupt: list[CorruptRunFile | UnreadableRun] | None) -> None:
    if corrupt is None:
        raise exc
    corrupt.append(exc)
    warnings.warn(f"skipped, unreadable: {exc}", RunSourceWarning, stacklevel=4)


def _read_folder(folder: Path, corrupt) -> RunData | None:
    try:
        return load_run_folder(folder)
    except UnreadableRun as exc:
        _unreadable(exc, corrupt)
        return None


def _both_records(p: Path, folders: list[Path], group: str | None, corrupt) -> list[RunData]:
    """`load_runs(source="auto")` when the tree holds wandb run files: each trainer folder's
    wandb run against its metrics.jsonl."""
    damaged: list[CorruptRunFile] = []
    wandb = _wandb_runs(p, None, damaged, warn=False)  # every group: a folder's two records stay together
    by_folder: dict[Path, list] = {}
    for r in wandb:
        by_folder.setdefault(_trainer_folder(r.paths[0]).resolve(), []).append(r)
    has_metrics = {f.resolve(): f for f in folders}
    damaged_in: dict[Path, CorruptRunFile] = {}
    for exc in damaged:
        home = _trainer_folder(exc.path).resolve()
        if home in has_metrics:
            damaged_in[home] = exc  # the folder's metrics.jsonl still holds the run
        else:
            _unreadable(exc, corrupt)
    runs: list[RunData] = []
    for r in wandb:
        home = _trainer_folder(r.paths[0]).resolve()
        if group is not None and r.group != group:
            continue
        if home not in has_metrics or len(by_folder[home]) > 1:
            # not a trainer folder, or several runs share it: nothing to hold them against
            runs.append(_from_wandb(r))
            continue
        runs.append(_longer(_from_wandb(r), has_metrics[home], damaged_in.get(home)))
    for home, folder in has_metrics.items():
        if home in by_folder:
            continue
        run = _read_folder(folder, corrupt)
        if run is None or not _in_group(run.config, group):
            continue
        exc = damaged_in.get(home)
        what = f"corrupt wandb run file ({exc.reason} in {exc.path})" if exc else \
            "no wandb run file"
        _say(f"run {run.name} ({folder}): {what}; metrics.jsonl has {len(run.metrics)} steps: "
             "using metrics.jsonl")
        runs.append(run)
    return runs


def _longer(wb: RunData, folder: Path, damaged: CorruptRunFile | None) -> RunData:
    """The run from whichever of its records holds more steps (wandb on a tie: it carries the
    summary), with one line when they differ."""
    try:
        mj = load_run_folder(folder)
    except UnreadableRun as exc:
        _say(f"run {wb.name} ({folder}): {exc.reason}; the wandb run file has "
             f"{len(wb.metrics)} steps: using the wandb run file")
        return wb
    n_w, n_m = len(wb.metrics), len(mj.metrics)
    also = f" (and a corrupt wandb run file: {damaged.reason} in {damaged.path})" if damaged \
        else ""
    if n_w == n_m and not also:
        return wb
    use_metrics = n_m > n_w
    _say(f"run {wb.name} ({folder}): metrics.jsonl has {n_m} steps, its wandb run file {n_w}"
         f"{also}: using {'metrics.jsonl' if use_metrics else 'the wandb run file'}")
    if not use_metrics:
        return wb
    return RunData(name=wb.name, metrics=mj.metrics, config=wb.config or mj.config,
                   summary=wb.summary or mj.summary, source=mj.source, folder=mj.folder)


def _say(message: str) -> None:
    warnings.warn(message, RunSourceWarning, stacklevel=5)


def _trainer_folder(run_file: str) -> Path:
    # The trainer logs to <--out>/wandb/offline-run-*/run-*.wandb.
    return Path(run_file).parents[2]


def _wandb_runs(path: Path, group: str | None, corrupt: list | None = None, *,
                warn: bool = True):
    # The trainer logs to <run folder>/wandb/. A resumed job may start a new wandb run (new
    # id) in the same folder under the same name and group: those are attempts at one run.
    attempts: dict[tuple[str, str, str], list] = {}
    for r in find_runs(path, group=group, corrupt=corrupt, warn=warn):
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
    corrupt: list[CorruptRunFile | UnreadableRun] = []
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
        row = {"run": exc.path, "baseline": None, "budget": RUN_READABLE,
               "measured": 0.0, "limit": 1.0, "passed": False,
               "detail": str(exc)}
        tables.append(pd.DataFrame([row]).astype({"passed": "boolean"}))
    table = (pd.concat(tables, ignore_index=True) if tables
             else pd.DataFrame(columns=["run", "baseline", *COLUMNS]))
    return Comparison(runs=runs, curves=curves(runs), budgets=table, corrupt=corrupt)
