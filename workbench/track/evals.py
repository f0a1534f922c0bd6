"""Downstream evaluation results read back: `eval.json` as tables, recovery, a run group's table.

`workbench eval` (``workbench.eval``, which runs EleutherAI's lm-eval) writes ``DIR/eval.json``;
this module is its reader and owns the facts every consumer shares (notebooks, budgets, wandb),
without importing lm-eval or torch:

- metric keys are lm-eval's ``METRIC,FILTER`` (``acc,none``, ``exact_match,strict-match``);
  shown as ``acc`` when the filter is ``none``;
- recovery, defined once (docs/eval.md): for one task and metric, with the BF16 model's score
  B, its post-training quantization's P and the QAT model's Q,

      recovery  = (Q - P) / (B - P)   share of what PTQ lost that QAT got back
      retention = Q / B               share of the BF16 score QAT keeps

  recovery is 1 when QAT matches BF16, 0 when it is no better than PTQ, above 1 when it beats
  BF16 and below 0 when it is worse than PTQ. When B == P there is nothing to recover and
  recovery is undefined: it is None, shown as "n/a (BF16 = PTQ)"; retention is None when B == 0;
- the columns a run's metrics carry (``eval/TASK/METRIC`` for the run's own model, with
  ``/bf16``, ``/ptq``, ``/recovery``, ``/retention`` for its baselines, ``_stderr`` for the
  standard error): `workbench.track.budgets.EvalWithin` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from workbench._io import JSONFileError, read_json

EVAL_JSON = "eval.json"
FORMAT = "workbench.eval/1"
MAX_EVAL_JSON_BYTES = 64 << 20  # results and sample digests of a few hundred tasks
NA_EQUAL = "n/a (BF16 = PTQ)"
NA_ZERO = "n/a (BF16 = 0)"

__all__ = ["EVAL_JSON", "FORMAT", "EvalFileError", "GroupEval", "column", "group_eval",
           "metric_label", "read_eval", "recovery", "recovery_table", "results_table",
           "retention", "wide_table"]


class EvalFileError(ValueError):
    """An eval.json that cannot be read (not JSON, not of this format); names the file."""


def metric_label(key: str) -> str:
    """lm-eval's ``METRIC,FILTER`` key as shown: the filter is dropped when it is ``none``."""
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else key


def column(task: str, metric: str, suffix: str | None = None) -> str:
    """The metrics column of a task's metric (``metric`` as `metric_label` shows it):
    ``eval/TASK/METRIC`` for the run's own model, ``eval/TASK/METRIC/SUFFIX`` for its
    ``bf16`` / ``ptq`` baselines and its ``recovery`` / ``retention``."""
    base = f"eval/{task}/{metric}"
    return base if suffix is None else f"{base}/{suffix}"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def recovery(bf16: float, ptq: float, qat: float) -> float | None:
    """(qat - ptq) / (bf16 - ptq); None when bf16 == ptq (nothing to recover) or a value is
    not a finite number."""
    if not (_finite(bf16) and _finite(ptq) and _finite(qat)) or bf16 == ptq:
        return None
    return (qat - ptq) / (bf16 - ptq)


def retention(bf16: float, qat: float) -> float | None:
    """qat / bf16; None when bf16 == 0 or a value is not a finite number."""
    if not (_finite(bf16) and _finite(qat)) or bf16 == 0:
        return None
    return qat / bf16


def read_eval(path: str | Path) -> dict[str, Any]:
    """An eval.json (the file, or the folder holding it), checked for the fields readers use."""
    p = Path(path)
    if p.is_dir():
        p = p / EVAL_JSON
    try:
        ev = read_json(p, cap=MAX_EVAL_JSON_BYTES, what="the eval result")
    except JSONFileError as e:
        raise EvalFileError(str(e)) from None
    if not isinstance(ev, dict) or ev.get("format") != FORMAT:
        raise EvalFileError(f"{p}: not a workbench eval result (format {FORMAT!r} expected)")
    models = ev.get("models")
    if not isinstance(models, list) or not all(
            isinstance(m, dict) and isinstance(m.get("label"), str)
            and m.get("role") in ("bf16", "ptq", "qat") and isinstance(m.get("results"), dict)
            for m in models):
        raise EvalFileError(f"{p}: 'models' must be a list of {{label, role, results}} objects")
    ev["_path"] = str(p)
    return ev


def results_table(ev: dict[str, Any]) -> pd.DataFrame:
    """One row per task x metric x model: task, metric, model, role, recipe, value, stderr, n,
    higher_is_better (lm-eval's word for the metric; None when it gave none)."""
    rows = []
    for m in ev["models"]:
        for task, metrics in m["results"].items():
            n = (m.get("n_samples") or {}).get(task)
            hib = (m.get("higher_is_better") or {}).get(task, {})
            for key, v in metrics.items():
                metric = key.partition(",")[0]
                rows.append({"task": task, "metric": metric_label(key), "model": m["label"],
                             "role": m["role"], "recipe": m.get("recipe"),
                             "value": _num(v.get("value")), "stderr": _num(v.get("stderr")),
                             "n": n, "higher_is_better": hib.get(metric)})
    cols = ["task", "metric", "model", "role", "recipe", "value", "stderr", "n",
            "higher_is_better"]
    return pd.DataFrame(rows, columns=cols)


def _num(x: Any) -> float:
    return float(x) if _finite(x) else math.nan


def pair(models: list[dict]) -> list[tuple[dict, dict | None, dict | None]]:
    """(qat, bf16, ptq) for every QAT model: the PTQ model of the same BF16 checkpoint (`base`)
    with the same recipe, and that BF16 checkpoint. A key the QAT model does not know (a packed
    checkpoint has no recorded base) does not filter; None unless exactly one model is left."""
    def only(ms: list[dict]) -> dict | None:
        return ms[0] if len(ms) == 1 else None

    out = []
    for q in (m for m in models if m["role"] == "qat"):
        base, recipe = q.get("base"), q.get("recipe")
        p = only([m for m in models if m["role"] == "ptq"
                  and (base is None or m.get("base") == base)
                  and (recipe is None or m.get("recipe") == recipe)])
        base = base or (p or {}).get("base")
        b = only([m for m in models if m["role"] == "bf16"
                  and (base is None or m.get("path") == base)])
        out.append((q, b, p))
    return out


def _value(model: dict | None, task: str, key: str) -> tuple[float, float]:
    r = (model or {}).get("results", {}).get(task, {}).get(key, {})
    return _num(r.get("value")), _num(r.get("stderr"))


def recovery_table(ev: dict[str, Any]) -> pd.DataFrame:
    """One row per QAT model x task x metric: its BF16 and PTQ baselines (values and standard
    errors), recovery and retention; `note` says why a value is missing."""
    rows = []
    for q, b, p in pair(ev["models"]):
        for task, metrics in q["results"].items():
            for key in metrics:
                (qv, qs), (bv, bs), (pv, ps) = (_value(m, task, key) for m in (q, b, p))
                rec, ret = recovery(bv, pv, qv), retention(bv, qv)
                note = []
                if b is None or p is None:
                    note.append(f"no {'BF16' if b is None else 'PTQ'} model to pair with")
                elif rec is None and _finite(bv) and bv == pv:
                    note.append(NA_EQUAL)
                if b is not None and ret is None and bv == 0:
                    note.append(NA_ZERO)
                rows.append({"task": task, "metric": metric_label(key), "model": q["label"],
                             "recipe": q.get("recipe"),
                             "bf16_model": (b or {}).get("label"), "ptq_model": (p or {}).get("label"),
                             "bf16": bv, "bf16_stderr": bs, "ptq": pv, "ptq_stderr": ps,
                             "qat": qv, "qat_stderr": qs,
                             "recovery": math.nan if rec is None else rec,
                             "retention": math.nan if ret is None else ret,
                             "note": "; ".join(note)})
    cols = ["task", "metric", "model", "recipe", "bf16_model", "ptq_model", "bf16",
            "bf16_stderr", "ptq", "ptq_stderr", "qat", "qat_stderr", "recovery", "retention",
            "note"]
    return pd.DataFrame(rows, columns=cols)


def wide_table(results: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """task x metric rows, one column per model: "value ± stderr" as lm-eval prints them."""
    if results.empty:
        return pd.DataFrame()

    def cell(r) -> str:
        v = "nan" if math.isnan(r.value) else f"{r.value:.{digits}f}"
        return v if math.isnan(r.stderr) else f"{v} ± {r.stderr:.{digits}f}"

    df = results.assign(cell=[cell(r) for r in results.itertuples()])
    order = list(dict.fromkeys(results["model"]))
    wide = df.pivot_table(index=["task", "metric"], columns="model", values="cell",
                          aggfunc="first", sort=False)
    return wide[[m for m in order if m in wide.columns]]


@dataclass
class GroupEval:
    """The eval results of a run group: every model once (baselines shared by several runs'
    evaluations appear once), the recovery of every QAT model, and the files read."""

    results: pd.DataFrame  # see results_table
    recovery: pd.DataFrame  # see recovery_table
    files: list[str]


def _eval_files(group_dir: Path) -> list[Path]:
    # DIR/eval.json, DIR/*/eval.json and DIR/*/eval/eval.json (a chained job writes RUN/eval/).
    pats = (EVAL_JSON, f"*/{EVAL_JSON}", f"*/eval/{EVAL_JSON}")
    return sorted({p for pat in pats for p in group_dir.glob(pat) if p.is_file()})


def group_eval(group_dir: str | Path, files: Iterable[str | Path] | None = None) -> GroupEval:
    """Merge the eval.json files of a run group (see `_eval_files` for where they are looked
    for, or pass `files`). A model evaluated in several files (the group's BF16 and PTQ
    baselines) is kept once, from the newest file; all must have used the same tasks' samples."""
    paths = [Path(f) for f in files] if files is not None else _eval_files(Path(group_dir))
    evs = sorted((read_eval(p) for p in paths), key=lambda e: e.get("created", 0))
    models: dict[tuple, dict] = {}
    for ev in evs:
        for m in ev["models"]:
            models[(m.get("path"), m.get("recipe"), m["role"], m.get("step"))] = m
    merged = {"models": list(models.values())}
    _check_same_samples(merged["models"])
    return GroupEval(results_table(merged), recovery_table(merged), [str(p) for p in paths])


def _check_same_samples(models: list[dict]) -> None:
    """Rows are comparable only on the same documents: every model's digest of a task's
    documents must agree (eval.json records it per task)."""
    seen: dict[str, tuple[str, str]] = {}
    for m in models:
        for task, digest in (m.get("docs_sha") or {}).items():
            if task in seen and seen[task][0] != digest:
                raise EvalFileError(f"task {task}: {m['label']} was evaluated on other documents "
                                    f"than {seen[task][1]} (another --limit or dataset?); "
                                    "their scores are not comparable")
            seen.setdefault(task, (digest, m["label"]))
