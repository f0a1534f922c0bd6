"""Per-expert quantization error of each run's final weights, for the run-group report.

The final weights are the run's BF16 export (`--export bf16`, DIR/export). Each run, the
baseline included, is measured under the weight formats of the group's QAT recipes, so a QAT
run's experts can be compared with the same experts trained in BF16. A packed export
(compressed-tensors) no longer holds the BF16 masters, so it is skipped with a note.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from workbench.track.compare import RunData


def export_path(run: RunData) -> Path | None:
    """The run's exported checkpoint folder, if the trainer wrote one."""
    if run.folder is None:
        return None
    result = run.folder / "result.json"
    if result.is_file():
        path = json.loads(result.read_text()).get("export")
        if path and Path(path).is_dir():
            return Path(path)
    default = run.folder / "export"
    return default if default.is_dir() else None


def group_weight_recipes(runs: Sequence[RunData]) -> list[str]:
    """The weight formats (with profile) of the QAT recipes in the group, e.g. mxfp4:rceil."""
    from workbench.qat.recipe import parse_qat_recipe

    out: list[str] = []
    for r in runs:
        if r.recipe is None or r.is_baseline:
            continue
        w = parse_qat_recipe(r.recipe, r.config.get("profile")).weight
        if w is not None and str(w) not in out:
            out.append(str(w))
    return out


def final_expert_errors(runs: Sequence[RunData], recipes: Sequence[str] | None = None, *,
                        progress: bool = False) -> pd.DataFrame:
    """Rows of `workbench.analysis.candidate_errors` (layer, expert, proj, kind, recipe, rel_err,
    sqnr_db, ...) for every run with a BF16 export, plus a `run` column. `recipes` defaults to
    the group's QAT weight formats."""
    from workbench.analysis import candidate_errors
    from workbench.checkpoint import open_checkpoint

    recipes = list(recipes) if recipes is not None else group_weight_recipes(runs)
    if not recipes:
        raise ValueError("no QAT weight recipe in the group and none given: nothing to measure")
    parts = []
    for r in runs:
        path = export_path(r)
        if path is None:
            warnings.warn(f"{r.name}: no exported checkpoint (train with --export bf16)",
                          stacklevel=2)
            continue
        ck = open_checkpoint(path)
        if ck.layout != "dense":
            warnings.warn(f"{r.name}: export {path} is packed ({ck.layout}); the final BF16 "
                          "weights are needed (train with --export bf16)", stacklevel=2)
            continue
        t = candidate_errors(ck, recipes, kinds=("routed",), progress=progress)
        parts.append(t.experts.assign(run=r.name))
    if not parts:
        return pd.DataFrame(columns=["run", "layer", "expert", "proj", "kind", "recipe"])
    df = pd.concat(parts, ignore_index=True)
    return df[["run"] + [c for c in df.columns if c != "run"]]


def expert_error_summary(errors: pd.DataFrame, metric: str = "rel_err") -> pd.DataFrame:
    """Per run and recipe: mean, worst and best `metric` over routed expert weights, and the
    worst weight's (layer, expert, proj)."""
    if errors.empty:
        return pd.DataFrame(columns=["run", "recipe", "mean", "max", "min", "worst"])
    rows = []
    for (run, recipe), g in errors.groupby(["run", "recipe"], sort=False):
        worst = g.loc[g[metric].idxmax()]
        rows.append({"run": run, "recipe": recipe, "mean": g[metric].mean(),
                     "max": g[metric].max(), "min": g[metric].min(),
                     "worst": f"layer {worst['layer']} expert {worst['expert']} {worst['proj']}"})
    return pd.DataFrame(rows)
