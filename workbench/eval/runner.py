"""`workbench.eval.run`: several models, the same tasks and documents, one table.

    from workbench.eval import run
    res = run(["runs/demo/init", "ptq:mxfp4@runs/demo/init", "runs/demo/run"],
              tasks="wb_code_choice,wb_code_complete", out="runs/demo/eval")
    res.table()      # task x metric rows, one "value ± stderr" column per model
    res.recovery     # per QAT model: BF16, PTQ, QAT, recovery and retention

Tasks are resolved and their data read before any model is loaded; models are then loaded and
evaluated one at a time (only one is in memory), each by lm-eval on the same task specs and
limit, and the document digests of every task are checked to agree across models.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from workbench.eval.errors import EvalError
from workbench.eval.harness import LM_EVAL_VERSION, HarnessOptions, evaluate
from workbench.eval.load import load
from workbench.eval.record import (
    cache_get,
    cache_key,
    cache_put,
    locked,
    record_in_run,
    write_outputs,
)
from workbench.eval.refs import ModelRef, parse_models
from workbench.eval.taskset import check_loadable, resolve_tasks
from workbench.track.evals import FORMAT, recovery_table, results_table, wide_table

CACHED_ROLES = ("bf16", "ptq")


@dataclass
class EvalResult:
    out: Path
    eval: dict[str, Any]  # what eval.json holds
    results: pd.DataFrame  # workbench.track.evals.results_table
    recovery: pd.DataFrame  # workbench.track.evals.recovery_table
    samples: dict[str, dict[str, list]]  # model label -> task -> per-sample records

    def table(self, digits: int = 4) -> pd.DataFrame:
        return wide_table(self.results, digits)

    def _repr_html_(self) -> str:
        return self.table()._repr_html_()

    def __str__(self) -> str:
        return format_report(self)


def _fmt(x: float, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_report(res: EvalResult) -> str:
    """The tables the CLI prints: scores with stderr, then recovery per QAT model."""
    lines = [res.table().to_string()]
    rec = res.recovery
    if not rec.empty:
        shown = pd.DataFrame({
            "task": rec["task"], "metric": rec["metric"], "QAT model": rec["model"],
            "BF16": [_fmt(x) for x in rec["bf16"]], "PTQ": [_fmt(x) for x in rec["ptq"]],
            "QAT": [_fmt(x) for x in rec["qat"]],
            "recovery": [_fmt(r) if not math.isnan(r) else (n or "n/a")
                         for r, n in zip(rec["recovery"], rec["note"])],
            "QAT/BF16": [_fmt(x) for x in rec["retention"]]})
        lines += ["", ("recovery = (QAT - PTQ) / (BF16 - PTQ), QAT/BF16 = retention "
                       "(docs/eval.md)"), shown.to_string(index=False)]
    return "\n".join(lines)


def _entry(ref: ModelRef, base: str | None, precision: str, info: dict, got: dict) -> dict:
    return {"label": ref.label, "role": ref.role, "recipe": ref.recipe,
            "path": str(ref.path), "base": base, "run": None if ref.run is None else str(ref.run),
            "step": ref.step, "engine": ref.engine, "precision": precision, "ref": ref.to_json(),
            "info": info, **{k: got[k] for k in ("results", "n_samples", "docs_sha",
                                                  "higher_is_better", "versions", "n_shot",
                                                  "seconds")}}


def _same_documents(entries: list[dict]) -> None:
    first: dict[str, tuple[str, str]] = {}
    for e in entries:
        for task, digest in e["docs_sha"].items():
            if task in first and first[task][0] != digest:
                raise EvalError(f"task {task}: {e['label']} saw other documents than "
                                f"{first[task][1]}; its scores are not comparable")
            first.setdefault(task, (digest, e["label"]))


def _free() -> None:
    """Return the last model's memory before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(models: Sequence[str | ModelRef], tasks: str | Sequence[str], *,
        out: str | Path, limit: float | None = None, num_fewshot: int | None = None,
        include: Sequence[str | Path] = (), device: str | None = None, dtype: str = "auto",
        batch_size: int = 1, max_length: int | None = None, tokenizer: str | None = None,
        record_runs: bool = True, cache: str | Path | None = None,
        log: Callable[[str], None] = print) -> EvalResult:
    """Evaluate `models` on `tasks` with lm-eval's HF backend; write `out`/eval.json (see
    `workbench.eval.record`) and return the tables. `cache`: a folder of baseline rows shared
    by the runs of a group (BF16 and PTQ models found there are not evaluated again)."""
    refs = parse_models(list(models))
    opts = HarnessOptions(limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                          max_length=max_length)
    ts = resolve_tasks(tasks, include)
    check_loadable(ts)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    entries: list[dict] = []
    samples: dict[str, dict[str, list]] = {}
    for i, ref in enumerate(refs, 1):
        log(f"[eval] {i}/{len(refs)} {ref.label} ({ref.role}): {ref.note}")
        key = lock = None
        if cache is not None and ref.role in CACHED_ROLES:
            what = {"tasks": ts.specs, "options": opts.to_json(), "lm_eval": LM_EVAL_VERSION,
                    "device": torch.device(device).type, "dtype": dtype,
                    "tokenizer": tokenizer}
            key = cache_key(ref, what)
            lock = Path(cache) / f"{key}.lock"
        with locked(lock) if lock is not None else contextlib.nullcontext():
            hit = cache_get(Path(cache), key) if key is not None else None
            if hit is not None:
                entry = {**hit["entry"], "label": ref.label, "cached": True}
                entries.append(entry)
                samples[ref.label] = hit["samples"]
                log(f"[eval]   reused from the group's cache ({key})")
                continue
            loaded = load(ref, device=device, dtype=dtype, tokenizer=tokenizer)
            try:
                got = evaluate(loaded, ts, opts)
            finally:
                base, precision, info = loaded.base, loaded.precision, loaded.info
                loaded = None
                _free()
            entry = _entry(ref, base, precision, info, got)
            entries.append(entry)
            samples[ref.label] = got["samples"]
            if key is not None:
                cache_put(Path(cache), key, entry, got["samples"])
            log(f"[eval]   {got['seconds']:.1f} s")
    _same_documents(entries)
    ev = {"format": FORMAT, "created": time.time(), "lm_eval": LM_EVAL_VERSION,
          "tasks": list(ts.names), "task_sources": ts.sources, "device": device,
          "dtype": dtype, **opts.to_json(), "models": entries}
    results, rec = results_table(ev), recovery_table(ev)
    ev["recovery"] = rec.astype(object).where(rec.notna(), None).to_dict("records")
    path = write_outputs(out, ev, samples, results.to_csv(index=False), rec.to_csv(index=False))
    res = EvalResult(out, ev, results, rec, samples)
    log(format_report(res))
    log(f"[eval] wrote {path}")
    if record_runs:
        recorded: set[tuple[str, int | None]] = set()
        for ref in (r for r in refs if r.run is not None):
            at = (str(ref.run), ref.step)
            if at in recorded:  # the export and the DCP checkpoint of one step: the first counts
                log(f"[eval] {ref.label}: not recorded in {ref.run} (step {ref.step} already is)")
                continue
            recorded.add(at)
            for line in record_in_run(ref, ev):
                log(f"[eval] {line}")
    return res

