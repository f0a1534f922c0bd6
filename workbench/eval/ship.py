"""Is what ships what trained? A run's packed export against its newest DCP checkpoint with the
run's fake quantization, on the same documents, answer by answer.

The two are the same model written two ways: the export holds the experts packed (they decode
to exactly the fake-quantized masters) and every other weight rounded to BF16; the checkpoint
holds the fp32 masters. So generated answers must be identical and log-likelihoods may differ
only by what BF16 rounding of the dense weights moves: `DEFAULT_TOLERANCE` nats per scored
continuation (docs/eval.md says what the test model shows). A wrongly packed expert, a lost
scale or a skipped fake quantization moves them by much more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from workbench.eval.errors import EvalError
from workbench.eval.refs import ModelRef, parse_model
from workbench.eval.runner import run
from workbench.train.checkpointing import list_complete

DEFAULT_TOLERANCE = 0.05  # nats, per scored continuation


@dataclass
class ShipCheck:
    table: pd.DataFrame  # one row per task: see compare_samples
    tolerance: float
    export: str
    checkpoint: str

    @property
    def passed(self) -> bool:
        return bool(len(self.table)) and bool(self.table["passed"].all())

    def __str__(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict}: {self.export} against {self.checkpoint} (log-likelihood tolerance "
                f"{self.tolerance:g} nats)\n{self.table.to_string(index=False)}")


def _loglikelihoods(rec: dict) -> list[float]:
    return [float(r[0][0]) if isinstance(r[0], list) else float(r[0]) for r in rec["resps"]]


def compare_samples(a: dict[str, list[dict]], b: dict[str, list[dict]], *,
                    tolerance: float = DEFAULT_TOLERANCE) -> pd.DataFrame:
    """Per task: documents, answers that agree (generation: the filtered answer text; scored
    choices: the choice of highest log-likelihood), the largest |log-likelihood difference| of a scored continuation (log-likelihood tasks), and
    whether the task passes (every answer the same, every difference within `tolerance`)."""
    rows = []
    for task in sorted(set(a) | set(b)):
        if task not in a or task not in b:
            raise EvalError(f"task {task}: evaluated for one model only")
        key = lambda r: (r["doc_id"], r.get("filter"))
        sa, sb = {key(r): r for r in a[task]}, {key(r): r for r in b[task]}
        if set(sa) != set(sb):
            raise EvalError(f"task {task}: the two models saw other documents")
        same = worst = 0.0
        generation = all(isinstance(x, str) for r in sa.values() for x in r["filtered_resps"])
        for k, ra in sa.items():
            rb = sb[k]
            if generation:
                same += ra["filtered_resps"] == rb["filtered_resps"]
            else:  # the answer is the choice of highest log-likelihood
                la, lb = _loglikelihoods(ra), _loglikelihoods(rb)
                same += la.index(max(la)) == lb.index(max(lb))
                worst = max([worst, *(abs(x - y) for x, y in zip(la, lb))])
        n = len(sa)
        rows.append({"task": task, "kind": "generation" if generation else "log-likelihood",
                     "documents": n, "same_answers": int(same),
                     "max_abs_loglik_diff": math.nan if generation else worst,
                     "passed": same == n and (generation or worst <= tolerance)})
    return pd.DataFrame(rows, columns=["task", "kind", "documents", "same_answers",
                                       "max_abs_loglik_diff", "passed"])


def sources(run_folder: str | Path) -> tuple[ModelRef, ModelRef]:
    """(the run's packed export, its newest complete DCP checkpoint)."""
    export = parse_model(str(run_folder))
    if export.kind != "run-export" or not export.packed:
        raise EvalError(f"{run_folder}: no packed export to check ({export.note})")
    found = list_complete(run_folder)
    if not found:
        raise EvalError(f"{run_folder}: no complete DCP checkpoint to check the export against")
    return export, parse_model(str(found[-1].path))


def ship_check(run_folder: str | Path, tasks: str | Sequence[str], *, out: str | Path,
               tolerance: float = DEFAULT_TOLERANCE, limit: float | None = None,
               include: Sequence[str | Path] = (), device: str | None = None,
               batch_size: int = 1, log: Callable[[str], None] = print) -> ShipCheck:
    """Evaluate the run's export and its newest DCP checkpoint (see the module docstring) and
    compare them sample by sample; results of both land in `out` like any evaluation."""
    export, ckpt = sources(run_folder)
    res = run([export, ckpt], tasks, out=out, limit=limit, include=include, device=device,
              batch_size=batch_size, record_runs=False, log=log)
    table = compare_samples(res.samples[export.label], res.samples[ckpt.label],
                            tolerance=tolerance)
    return ShipCheck(table, tolerance, export.label, ckpt.label)
