"""An eval job chained after a training job: `chain_eval(handle, EvalRequest(tasks=...))`.

    from workbench.launch import submit
    from workbench.eval.launch import EvalRequest, chain_eval
    train = submit(spec)
    ev = chain_eval(train, EvalRequest(tasks=("wb_code_choice", "wb_code_complete"), limit=100))
    ev.wait(); ev.result()           # {"eval": "RUN/eval/eval.json", "models": [...]}

On Slurm the eval job is submitted at once with ``--dependency=afterok:TRAIN_JOB`` (and
``--kill-on-invalid-dep=yes``: a training job that fails cancels it instead of leaving it pending
forever); it holds no node while it waits and starts when training completes, requeues
included. On the local executor (no dependencies there) the job waits for the training job's
handle instead. One task, one GPU when the training job had GPUs, the training job's partition,
sbatch extras and environment.

What it evaluates, into ``RUN/eval/``: the run (its packed export, else its newest DCP checkpoint
with the run's fake quantization: `workbench.eval.refs`) and, with ``baselines``, the run's BF16
model (its ``init``) and the PTQ of that model with the run's recipe. Baseline rows go to the
group's cache (``GROUP/eval-cache``, GROUP = the run folder's parent: a sweep's folder) and are
reused by every later run of the group evaluated on the same tasks and options.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench._io import atomic_write_json
from workbench.eval.cli import job as run_eval_job
from workbench.eval.errors import EvalError
from workbench.launch import JobHandle, make_executor
from workbench.launch.handle import (
    FORMAT,
    LAUNCH_FILE,
    RESULT_FILE,
    index_dir,
    write_json_atomic,
)
from workbench.recipe import parse_qat_recipe
from workbench.train.runfolder import process_token

EVAL_FOLDER = "eval"
CACHE_FOLDER = "eval-cache"


@dataclass(frozen=True)
class EvalRequest:
    """What the chained job evaluates, with what (the options of `workbench eval`)."""

    tasks: tuple[str, ...]
    limit: int | float | None = None
    num_fewshot: int | None = None
    include: tuple[str, ...] = ()  # task folders (made absolute: the job runs elsewhere)
    baselines: bool = True  # also the run's BF16 model and its PTQ (cached per group)
    batch_size: int = 1
    dtype: str = "auto"
    time_min: int = 60

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            object.__setattr__(self, "tasks", tuple(t for t in self.tasks.split(",") if t))
        if not self.tasks or not all(isinstance(t, str) and t.strip() for t in self.tasks):
            raise EvalError(f"EvalRequest.tasks must name at least one task, got {self.tasks!r}")
        object.__setattr__(self, "include",
                           tuple(str(Path(p).expanduser().resolve()) for p in self.include))
        for p in self.include:
            if not Path(p).is_dir():
                raise EvalError(f"EvalRequest.include: {p} is not a folder")
        if not isinstance(self.time_min, int) or self.time_min < 2:
            raise EvalError(f"EvalRequest.time_min must be an int >= 2, got {self.time_min!r}")

    def argv(self, run: Path, models: Sequence[str], cache: Path) -> list[str]:
        """The `workbench eval` arguments of the job."""
        argv = [*models, "--tasks", ",".join(self.tasks), "--out", str(run / EVAL_FOLDER),
                "--cache", str(cache), "--batch-size", str(self.batch_size),
                "--dtype", self.dtype]
        if self.limit is not None:
            argv += ["--limit", str(self.limit)]
        if self.num_fewshot is not None:
            argv += ["--num-fewshot", str(self.num_fewshot)]
        for inc in self.include:
            argv += ["--include", inc]
        return argv


@dataclass
class EvalJob:
    """What submitit runs: (local executor only) wait for the training job, then `workbench
    eval` with `argv`; rank 0's result is written next to the eval like a training job's."""

    argv: tuple[str, ...]
    result_path: str
    pythonpath: tuple[str, ...] = ()
    wait_for: str | None = None  # the training run folder, when the executor has no dependencies

    def __call__(self) -> Any:
        for p in reversed(self.pythonpath):
            if p not in sys.path:
                sys.path.insert(0, p)
        if self.wait_for is not None:
            state = JobHandle.attach(self.wait_for).wait()
            if state != "COMPLETED":
                raise RuntimeError(f"the training job in {self.wait_for} ended {state}; "
                                   "nothing to evaluate")
        result = run_eval_job(list(self.argv))
        atomic_write_json(Path(self.result_path), {"ok": True, "result": result}, default=str)
        return result


def eval_models(run: Path, train_config: Any, baselines: bool) -> list[str]:
    """The MODEL arguments for a run: its BF16 model and PTQ (when asked and known), the run."""
    models = [str(run)]
    init, recipe = train_config.init, parse_qat_recipe(train_config.recipe, train_config.profile)
    if baselines and init and not recipe.is_bf16:
        models = [str(init), f"ptq:{recipe}@{init}", str(run)]
    return models


def chain_eval(train: JobHandle, request: EvalRequest, *,
               group_dir: str | Path | None = None) -> JobHandle:
    """Submit the eval job of `train`'s run to start when it completes; returns its handle (its
    folder is RUN/eval; `JobHandle.attach` finds it again)."""
    spec = train.spec
    run = train.folder.resolve()
    cfg = spec.train
    if cfg.init is None and cfg.tokenizer is None and not cfg.data:
        raise EvalError(f"{run}: the run trains on the shipped byte corpus and has no tokenizer "
                        "to evaluate with; chain evals to runs with init= (a checkpoint and its "
                        "tokenizer)")
    group = Path(group_dir).resolve() if group_dir is not None else run.parent
    folder = run / EVAL_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    (folder / RESULT_FILE).unlink(missing_ok=True)
    argv = request.argv(run, eval_models(run, cfg, request.baselines), group / CACHE_FOLDER)
    res = spec.resources
    # One task on one GPU (when training had GPUs), the training job's partition, memory,
    # sbatch extras and environment.
    one = spec.replace(train=cfg.replace(ep=None, fsdp=False), resources=dataclasses.replace(
        res, nodes=1, tasks_per_node=1, gpus_per_node=min(res.gpus_per_node, 1),
        time_min=request.time_min, signal_delay_s=min(res.signal_delay_s, request.time_min * 30),
        job_name=f"wb-eval-{spec.name}"))
    ex = make_executor(one, folder / "submitit")
    slurm = res.executor == "slurm"
    if slurm:
        ex.update_parameters(additional_parameters={
            **res.sbatch, "dependency": f"afterok:{train.job_id}", "kill-on-invalid-dep": "yes"})
    job = ex.submit(EvalJob(tuple(argv), str(folder / RESULT_FILE), res.pythonpath,
                            wait_for=None if slurm else str(train.folder)))
    record = {"format": FORMAT, "executor": res.executor, "job_id": str(job.job_id),
              "run_folder": str(folder), "submitit_folder": str(folder / "submitit"),
              "submitted_at": _dt.datetime.now(_dt.UTC).isoformat(), "spec": spec.to_json(),
              "kind": "eval", "after": train.job_id, "argv": argv}
    if not slurm:  # the controller's pid may be reused after it exits
        record["process_token"] = process_token(int(job.job_id))
    write_json_atomic(folder / LAUNCH_FILE, record)
    write_json_atomic(index_dir() / f"{job.job_id}.json", {"folder": str(folder)})
    return JobHandle(folder, record, submitit_job=job)
