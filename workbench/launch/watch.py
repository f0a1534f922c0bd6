"""Follow running jobs from a notebook or a terminal: status table, live curves, progress bar."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .handle import TERMINAL, JobHandle


def curves(jobs: Sequence[JobHandle]):
    """Long-form metrics of several runs (columns run, recipe, step, ...), the shape
    `workbench.plots.runs.plot_curves` and `workbench.track.compare` use; run = folder name."""
    import pandas as pd

    parts = [j.metrics().assign(run=j.folder.name, recipe=j.spec.train.recipe) for j in jobs]
    parts = [p for p in parts if not p.empty]
    if not parts:
        return pd.DataFrame(columns=["run", "recipe", "step", "loss"])
    df = pd.concat(parts, ignore_index=True)
    first = ["run", "recipe", "step"]
    return df[first + [c for c in df.columns if c not in first]]


def status(jobs: Sequence[JobHandle]):
    """One row per job: id, run, executor, fresh state, last step / steps, last loss."""
    import pandas as pd

    rows = []
    for j in jobs:
        m = j.metrics()
        last = m.iloc[-1] if len(m) else None
        rows.append({"job_id": j.job_id, "run": j.folder.name, "executor": j.executor,
                     "state": j.state, "step": None if last is None else int(last["step"]),
                     "steps": j.spec.train.steps,
                     "loss": None if last is None or "loss" not in m else float(last["loss"])})
    return pd.DataFrame(rows)


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def watch(jobs: Sequence[JobHandle], every_s: float = 5.0, timeout: float | None = None,
          metric: str = "loss", plot: bool = True):
    """Poll until every job is in a final state; returns the last status table. In a notebook the
    status table and the curves figure are redrawn in place; elsewhere a progress bar shows the
    steps done. TimeoutError (naming the unfinished jobs) after `timeout` seconds."""
    from tqdm.auto import tqdm

    jobs = list(jobs)
    notebook = _in_notebook()
    end = None if timeout is None else time.monotonic() + timeout
    total = sum(j.spec.train.steps for j in jobs)
    bar = tqdm(total=total, desc="steps (all runs)", unit="step")
    handle = None
    try:
        while True:
            table = status(jobs)
            bar.n = int(table["step"].fillna(0).sum())
            bar.set_postfix_str(" ".join(f"{r.run}:{r.state}" for r in table.itertuples()))
            bar.refresh()
            if notebook:
                from IPython.display import display

                parts = [table]
                if plot:
                    from workbench.plots.runs import plot_curves

                    df = curves(jobs)
                    if not df.empty and metric in df.columns:
                        parts.append(plot_curves(df, metric=metric, title=f"{metric} (live)"))
                if handle is None:
                    handle = [display(p, display_id=True) for p in parts]
                else:
                    for h, p in zip(handle, parts):
                        h.update(p)
                    for p in parts[len(handle):]:
                        handle.append(display(p, display_id=True))
            if all(s in TERMINAL for s in table["state"]):
                return table
            if end is not None and time.monotonic() > end:
                busy = table[~table["state"].isin(TERMINAL)]
                raise TimeoutError(f"watch: jobs still running after {timeout}s:\n{busy}")
            time.sleep(every_s)
    finally:
        bar.close()
