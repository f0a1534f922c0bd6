"""Writes real wandb offline runs from a JSON spec, through workbench's WandbLogger.

Run as a subprocess (`python wandb_writer.py SPEC.json`) so wandb's global state never leaks
into the test process. Spec: {"dir": ..., "runs": [{"name", "group", "id"?, "tags",
"config", "rows": [{"step", "metrics"}], "summary", "alerts": [[title, text]], "dir"? (this
run's wandb dir instead of the spec's: a trainer writes to its own --out),
"table_at"?, "image_at"?, "publish"?: {"baseline": rows, "alert_twice": bool}}]}.
With "live_hold": FILE, the last run logs its rows, then waits until FILE exists to finish.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


def main(spec_path: str) -> None:
    from workbench.track import BudgetWatch, make_logger
    from workbench.track.budgets import StepTimeRatio, ValLossWithin

    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        extra = {"run_id": run["id"]} if run.get("id") else {}
        logger = make_logger("offline", 0, project="wb-tests", group=run.get("group"),
                             name=run["name"], dir=run.get("dir", spec["dir"]), config=run.get("config", {}),
                             tags=tuple(run.get("tags", ())), **extra)
        if type(logger).__name__ != "WandbLogger":
            raise SystemExit(f"expected a WandbLogger, got {type(logger).__name__}")
        if run.get("config_update"):
            logger.log_config(run["config_update"])
        for row in run.get("rows", []):
            logger.log(row["metrics"], step=row["step"])
            if row["step"] == run.get("table_at"):
                errors = pd.DataFrame({"layer": [0, 0, 1], "expert": [0, 1, 0],
                                       "sqnr": [20.5, 19.0, 18.0]})
                logger.log_table("errors", errors, step=row["step"])
                logger.log_table("errors_by_expert", errors.set_index(["layer", "expert"]),
                                 step=row["step"])
            if row["step"] == run.get("image_at"):
                from workbench.plots.runs import plot_curves
                df = pd.DataFrame({"run": "r", "step": [0, 1], "loss": [2.0, 1.0]})
                logger.log_image("curve", plot_curves(df), step=row["step"])
        if run.get("summary"):
            logger.summary(run["summary"])
        for title, text in run.get("alerts", []):
            logger.alert(title, text)
        if run.get("publish"):
            frame = pd.DataFrame([{"step": r["step"], **r["metrics"]} for r in run["rows"]])
            base = pd.DataFrame([{"step": r["step"], **r["metrics"]}
                                 for r in run["publish"]["baseline"]])
            watch = BudgetWatch([ValLossWithin(2.0), StepTimeRatio(2.0)], logger,
                                baseline=base, run_name=run["name"])
            if run["publish"].get("alert_twice"):  # as during a run, then at its end
                watch.update(frame.iloc[: len(frame) // 2])
            watch.update(frame)
        if run.get("live_hold"):
            import pathlib
            import time

            hold = pathlib.Path(run["live_hold"])
            deadline = time.monotonic() + 120
            while not hold.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        if logger.errors:  # the logger swallows wandb errors; a fixture must not
            raise SystemExit(f"wandb calls failed while writing {run['name']}: {logger.errors}")
        logger.finish()


if __name__ == "__main__":
    main(sys.argv[1])
