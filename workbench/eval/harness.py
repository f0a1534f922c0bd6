"""One model through lm-eval's `simple_evaluate`, and its results as plain JSON values.

Scoring, aggregation, standard errors and seeds are lm-eval's (its defaults: the same numbers
`lm_eval --model hf ...` prints for the same model and tasks). What is kept per model: every
``METRIC,FILTER`` value with its stderr, the number of documents, a digest of the documents
(models of one evaluation must have seen the same ones) and the per-sample records.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import time
from dataclasses import dataclass
from typing import Any

from workbench.eval.errors import EvalError
from workbench.eval.lm import WorkbenchLM, hf_lm
from workbench.eval.load import Loaded
from workbench.eval.taskset import TaskSet

try:
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.utils import handle_non_serializable
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("workbench.eval needs lm-eval: pip install 'workbench[eval]'") from e

LM_EVAL_VERSION = importlib.metadata.version("lm_eval")


@dataclass(frozen=True)
class HarnessOptions:
    """What every model of one evaluation is run with (lm-eval's own defaults otherwise)."""

    limit: int | float | None = None  # first N documents of each task (a float < 1: a share)
    num_fewshot: int | None = None  # None: each task's own
    batch_size: int = 1
    max_length: int | None = None  # None: the model config's context length
    bootstrap_iters: int = 100_000  # lm-eval's default; mean metrics use a closed form

    def __post_init__(self) -> None:
        lim = self.limit
        if lim is not None and (isinstance(lim, bool) or not isinstance(lim, (int, float))
                                or lim <= 0 or (isinstance(lim, float) and lim >= 1
                                                and not lim.is_integer())):
            raise EvalError(f"--limit must be a positive count (or a share below 1), got {lim!r}")
        if self.num_fewshot is not None and (not isinstance(self.num_fewshot, int)
                                             or self.num_fewshot < 0):
            raise EvalError(f"--num-fewshot must be an int >= 0, got {self.num_fewshot!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise EvalError(f"--batch-size must be a positive int, got {self.batch_size!r}")

    def to_json(self) -> dict[str, Any]:
        return {"limit": self.limit, "num_fewshot": self.num_fewshot,
                "batch_size": self.batch_size, "max_length": self.max_length,
                "bootstrap_iters": self.bootstrap_iters}


def make_lm(loaded: Loaded, opts: HarnessOptions):
    if loaded.ref.engine == "transformers":
        return hf_lm(loaded.model, loaded.tokenizer, batch_size=opts.batch_size,
                     max_length=opts.max_length)
    return WorkbenchLM(loaded.model, loaded.tokenizer, name=loaded.ref.label,
                       batch_size=opts.batch_size, max_length=opts.max_length)


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def metrics_of(task_results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """{"acc,none": {"value": .., "stderr": ..}} from one task's entry of lm-eval's results
    (its stderr key is ``acc_stderr,none``; "N/A" where it computed none)."""
    out = {}
    for key, value in task_results.items():
        metric, sep, filt = key.partition(",")
        if not sep or metric.endswith("_stderr"):
            continue
        out[key] = {"value": _number(value),
                    "stderr": _number(task_results.get(f"{metric}_stderr,{filt}"))}
    return out


def docs_digest(samples: list[dict]) -> str:
    """sha256 over the (doc_id, doc_hash) pairs a task's samples cover, in document order."""
    pairs = sorted({(int(s["doc_id"]), str(s.get("doc_hash", ""))) for s in samples})
    return hashlib.sha256("\n".join(f"{i}:{h}" for i, h in pairs).encode()).hexdigest()


def sample_records(samples: list[dict]) -> list[dict]:
    """Per document (and filter): what was asked, what the model answered and how it scored;
    JSON values only (the raw document is left out: its digest identifies it)."""
    keep = ("doc_id", "doc_hash", "filter", "target", "resps", "filtered_resps", "metrics")
    out = []
    for s in samples:
        rec = {k: s[k] for k in keep if k in s}
        for m in s.get("metrics", []):
            if m in s:
                rec[m] = s[m]
        out.append(json.loads(json.dumps(rec, default=handle_non_serializable)))
    return out


def evaluate(loaded: Loaded, ts: TaskSet, opts: HarnessOptions) -> dict[str, Any]:
    """Run one model; returns {results, n_samples, docs_sha, higher_is_better, samples,
    seconds}."""
    lm = make_lm(loaded, opts)
    t0 = time.perf_counter()
    try:
        res = simple_evaluate(model=lm, tasks=list(ts.specs), task_manager=ts.manager,
                              limit=opts.limit, num_fewshot=opts.num_fewshot,
                              bootstrap_iters=opts.bootstrap_iters, log_samples=True)
    except EvalError:
        raise
    except Exception as e:  # a task's config or data lm-eval cannot score; the cause is kept
        msg = " ".join(str(e).split())[:300]
        raise EvalError(f"lm-eval failed evaluating {loaded.ref.label} on "
                        f"{', '.join(ts.names)} ({type(e).__name__}: {msg})") from e
    seconds = time.perf_counter() - t0
    if res is None:  # pragma: no cover - only ranks other than 0 get None
        raise EvalError("lm-eval returned no results (not rank 0?)")
    samples = res.get("samples", {})
    return {
        "results": {t: metrics_of(v) for t, v in res["results"].items()},
        "n_samples": {t: int(v["effective"]) for t, v in res.get("n-samples", {}).items()},
        "docs_sha": {t: docs_digest(s) for t, s in samples.items()},
        "higher_is_better": {t: {k: bool(v) for k, v in hib.items()}
                             for t, hib in res.get("higher_is_better", {}).items()},
        "versions": json.loads(json.dumps(res.get("versions", {}), default=str)),
        "n_shot": json.loads(json.dumps(res.get("n-shot", {}), default=str)),
        "samples": {t: sample_records(s) for t, s in samples.items()},
        "seconds": seconds,
    }
