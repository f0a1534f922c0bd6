"""Where results go: `DIR/eval.json` (+ tables and per-sample files), the evaluated runs' own
metrics and wandb run, and a run group's cache of baseline rows.

- ``DIR/eval.json``: the models (role, source, precision, every metric with its stderr, document
  digests) and the recovery rows (`workbench.track.evals` reads it); ``DIR/results.csv`` and
  ``DIR/recovery.csv`` the same as tables; ``DIR/samples/MODEL/TASK.jsonl`` every answer.
- A model that comes from a run folder is recorded in that run too, at the step its weights
  are from: one row appended to ``RUN/metrics.jsonl`` (the trainer's writer; a reader merges it
  into that step's row) and the same values in the summary of the run's wandb run (the id in
  ``RUN/wandb_run_id``, offline unless the run logged online), next to its loss curves. Only the
  summary is written to wandb: a history row at an earlier step would cut the training curve
  when the offline segments are merged (`workbench.track.offline.merge_segments`).
- Baseline cache (``cache=``): rows of BF16 and PTQ models keyed by what decides their numbers
  (the checkpoint's files, recipe, tasks, options, lm-eval version, precision), so the runs of
  one group evaluate their shared baselines once; a file lock serialises two jobs that want the
  same row.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from workbench._io import JSONFileError, atomic_write_json, atomic_write_text, read_json
from workbench.eval.refs import ModelRef
from workbench.track.evals import (
    EVAL_JSON,
    MAX_EVAL_JSON_BYTES,
    column,
    metric_label,
    pair,
    recovery,
    retention,
)
from workbench.train.cli import WANDB_RUN_ID_FILE
from workbench.train.logger import make_logger
from workbench.train.metrics import MetricsWriter

_SAFE = re.compile(r"[^A-Za-z0-9_.+\-]+")


def safe_name(text: str) -> str:
    return _SAFE.sub("_", text).strip("_") or "model"


def write_outputs(out: Path, ev: dict[str, Any], samples: dict[str, dict[str, list]],
                  results_csv: str, recovery_csv: str) -> Path:
    """eval.json, the two tables and the per-sample files, each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for label, by_task in samples.items():
        folder = out / "samples" / safe_name(label)
        folder.mkdir(parents=True, exist_ok=True)
        for task, recs in by_task.items():
            atomic_write_text(folder / f"{safe_name(task)}.jsonl",
                              "".join(json.dumps(r) + "\n" for r in recs))
    atomic_write_text(out / "results.csv", results_csv)
    atomic_write_text(out / "recovery.csv", recovery_csv)
    return atomic_write_json(out / EVAL_JSON, ev)


# --- the run's own record ------------------------------------------------------------------

def run_columns(ev: dict[str, Any], label: str) -> dict[str, float]:
    """The metrics-row columns of model `label` (see `workbench.track.evals.column`): its own
    values and, for a QAT model, its BF16 / PTQ baselines, recovery and retention."""
    models = {m["label"]: m for m in ev["models"]}
    me = models[label]
    paired = {q["label"]: (b, p) for q, b, p in pair(ev["models"])}
    b, p = paired.get(label, (None, None))
    cols: dict[str, float] = {}
    for task, metrics in me["results"].items():
        for key, v in metrics.items():
            vals: dict[str | None, Any] = {None: v["value"], "stderr": v["stderr"]}
            for tag, other in (("bf16", b), ("ptq", p)):
                o = (other or {}).get("results", {}).get(task, {}).get(key)
                if o:
                    vals[tag], vals[f"{tag}/stderr"] = o["value"], o["stderr"]
            if b is not None and p is not None:
                vals["recovery"] = recovery(vals.get("bf16"), vals.get("ptq"), v["value"])
                vals["retention"] = retention(vals.get("bf16"), v["value"])
            for suffix, x in vals.items():
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    cols[column(task, metric_label(key), suffix)] = float(x)
    return cols


def _run_settings(run: Path) -> dict[str, Any]:
    try:
        conf = read_json(run / "config.json")
    except JSONFileError:
        conf = {}
    return conf if isinstance(conf, dict) else {}


def record_in_run(ref: ModelRef, ev: dict[str, Any]) -> list[str]:
    """Append the model's columns to its run's metrics.jsonl at its step and put them in the
    summary of the run's wandb run. Returns what was done (lines for the log)."""
    done: list[str] = []
    if ref.run is None:
        return done
    cols = run_columns(ev, ref.label)
    step = ref.step
    if step is None:
        done.append(f"{ref.run}: the evaluated weights have no recorded step; metrics.jsonl "
                    "left as it is")
    else:
        writer = MetricsWriter(ref.run)
        try:
            writer.write({"step": step, **cols})
        finally:
            writer.close()
        done.append(f"{ref.run / 'metrics.jsonl'}: eval columns at step {step}")
    conf = _run_settings(ref.run)
    mode = conf.get("wandb") or "offline"
    id_file = ref.run / WANDB_RUN_ID_FILE
    if mode == "disabled" or not id_file.is_file():
        why = "wandb disabled" if mode == "disabled" else f"no {WANDB_RUN_ID_FILE}"
        done.append(f"{ref.run}: not logged to wandb ({why})")
        return done
    run_id = id_file.read_text().strip()
    logger = make_logger(mode, project=conf.get("project") or "workbench",
                         group=conf.get("run_group"), name=conf.get("run_name") or ref.run.name,
                         dir=str(ref.run), run_id=run_id)
    try:
        logger.summary({**cols, "eval/step": step})
    finally:
        logger.finish()
    done.append(f"{ref.run}: eval summary in wandb run {run_id} ({mode})")
    return done


# --- baseline cache --------------------------------------------------------------------------

def _fingerprint(folder: Path) -> list[tuple[str, int, int]]:
    """Names, sizes and mtimes of a checkpoint folder's top-level files: what changes when
    the checkpoint is rewritten, without hashing hundreds of GB."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.iterdir() if p.is_file())


def cache_key(ref: ModelRef, what: dict[str, Any]) -> str:
    blob = json.dumps({"kind": ref.kind, "path": str(ref.path), "recipe": ref.recipe,
                       "files": _fingerprint(ref.path), **what}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock held while the block runs (released by the kernel if the process dies,
    so a killed job leaves no stale lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_get(folder: Path, key: str) -> dict[str, Any] | None:
    p = folder / f"{key}.json"
    if not p.is_file():
        return None
    try:
        row = read_json(p, cap=MAX_EVAL_JSON_BYTES)
    except JSONFileError:
        return None  # a damaged entry is recomputed and replaced
    return row if isinstance(row, dict) and "entry" in row else None


def cache_put(folder: Path, key: str, entry: dict[str, Any], samples: dict[str, list]) -> None:
    atomic_write_json(folder / f"{key}.json", {"entry": entry, "samples": samples,
                                               "created": time.time()}, indent=None)
