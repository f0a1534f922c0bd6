"""Submit launch specs through submitit: one job, or a sweep as one job array.

Folder layout of a run (`spec.folder`, default `./runs/<name>-<time>`):
    launch.json        what JobHandle.attach needs (spec, executor, job id, submitit folder)
    submitit/          submitit's pickles and per-rank logs (<job_id>_<rank>_log.out/.err)
    metrics.jsonl, checkpoints/, result.json    written by the trainer
    job_result.json    rank 0's return value, written by the job
A sweep shares one submitit folder, `<sweep folder>/submitit/`, and gives every element its own run
folder `<sweep folder>/<run name>/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import itertools
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from workbench.train.determinism import LAUNCH_ENV as DETERMINISTIC_ENV

from .handle import FORMAT, RESULT_FILE, JobHandle, LaunchError, process_token
from .spec import LaunchSpec


def _submitit():
    try:
        import submitit
    except ImportError as e:
        raise ImportError("workbench.launch needs submitit: pip install 'workbench[launch]'") from e
    return submitit


def _default_folder(spec: LaunchSpec) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{spec.name}-{stamp}"


def _job_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment for the tasks: PYTHONPATH (this checkout first, so the job imports the same
    workbench as the submitter, plus spec.pythonpath) and the spec's variables."""
    import workbench

    root = str(Path(workbench.__file__).resolve().parents[1])
    paths = list(dict.fromkeys([*spec.pythonpath, root]))
    old = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": ":".join(paths + ([old] if old else []))}
    # Several ranks share a node's cores: one intra-op thread pool each, sized to its CPUs.
    env["OMP_NUM_THREADS"] = str(spec.cpus_per_task)
    if spec.deterministic:
        # Set before the rank's Python starts, so no import can create a cuBLAS handle first
        # (the trainer sets it too; spec.env may pick the other deterministic value, ":16:8").
        env.update(DETERMINISTIC_ENV)
    env.update(spec.env)
    return env


@contextlib.contextmanager
def _submission_env(spec: LaunchSpec):
    """The local executor starts its controller with a copy of os.environ; set the job's variables
    there while submitting (its `setup` lines would put a shell between us and the controller,
    whose pid is the job id, and SIGINT-cancel would then stop at the shell)."""
    if spec.executor != "local":
        yield
        return
    saved = {k: os.environ.get(k) for k in _job_env(spec)}
    os.environ.update(_job_env(spec))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_executor(spec: LaunchSpec, submitit_folder: Path):
    """The submitit executor for a spec (its nodes, tasks, GPUs, time, partition, sbatch extras)."""
    submitit = _submitit()
    if spec.executor == "local":
        ex = submitit.LocalExecutor(folder=submitit_folder, max_num_timeout=spec.max_requeues)
        ex.update_parameters(tasks_per_node=spec.tasks_per_node, nodes=1, timeout_min=spec.time_min,
                             gpus_per_node=spec.gpus_per_node,
                             signal_delay_s=spec.signal_delay_s)
        return ex
    if shutil.which("sbatch") is None:
        raise LaunchError("executor='slurm' but sbatch is not on PATH: run on a Slurm login node, "
                          "start the local cluster (sudo jobs/slurm/local-cluster.sh), or use "
                          "executor='local'")
    # sbatch exports the submitter's environment; these lines add the job's own on top.
    setup = [f"export {k}={shlex.quote(v)}" for k, v in _job_env(spec).items()]
    ex = submitit.SlurmExecutor(folder=submitit_folder, python=shlex.quote(sys.executable),
                                max_num_timeout=spec.max_requeues)
    params = {"job_name": f"wb-{spec.name}", "nodes": spec.nodes,
              "ntasks_per_node": spec.tasks_per_node, "cpus_per_task": spec.cpus_per_task,
              "time": spec.time_min, "setup": setup, "signal_delay_s": spec.signal_delay_s}
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.partition:
        params["partition"] = spec.partition
    if spec.sbatch:
        params["additional_parameters"] = dict(spec.sbatch)
    ex.update_parameters(**params)
    return ex


def _job_callable(spec: LaunchSpec, run_folder: Path):
    from .job import DistributedJob

    return DistributedJob(target=spec.target, argv=tuple(spec.trainer_argv(run_folder)),
                          result_path=str(run_folder / RESULT_FILE), stop_hook=spec.stop_hook,
                          pythonpath=spec.pythonpath, signal_delay_s=spec.signal_delay_s)


def _prepare_run_folder(spec: LaunchSpec, run_folder: Path) -> None:
    run_folder.mkdir(parents=True, exist_ok=True)
    # A result from an earlier submission into this folder must not answer for the new job.
    (run_folder / RESULT_FILE).unlink(missing_ok=True)


def _handle(spec: LaunchSpec, run_folder: Path, submitit_folder: Path, job) -> JobHandle:
    record = {"format": FORMAT, "executor": spec.executor, "job_id": str(job.job_id),
              "run_folder": str(run_folder), "submitit_folder": str(submitit_folder),
              "submitted_at": _dt.datetime.now(_dt.UTC).isoformat(),
              "spec": dataclasses.replace(spec, folder=run_folder).to_json()}
    if spec.executor == "local":  # the controller's pid may be reused after it exits
        record["process_token"] = process_token(int(job.job_id))
    handle = JobHandle(run_folder, record, submitit_job=job)
    handle._save()
    return handle


def submit(spec: LaunchSpec) -> JobHandle:
    """Submit one run; returns its handle at once (the job runs in the background). A GPU run
    that the planner says cannot fit is refused before anything is queued (`launch.fits`)."""
    # Here, not at module top: the planner reads the trainer's configuration (torch), and
    # `import workbench.launch` stays light for notebooks that only attach to running jobs.
    from .fits import check_fits

    check_fits(spec)
    run_folder = (Path(spec.folder) if spec.folder is not None else _default_folder(spec)).resolve()
    _prepare_run_folder(spec, run_folder)
    submitit_folder = run_folder / "submitit"
    ex = make_executor(spec, submitit_folder)
    with _submission_env(spec):
        job = ex.submit(_job_callable(spec, run_folder))
    return _handle(spec, run_folder, submitit_folder, job)


def sweep(spec: LaunchSpec, recipes: Sequence[str] | None = None,
          seeds: Sequence[int] | None = None,
          profiles: Sequence[str | None] | None = None) -> list[JobHandle]:
    """One job array over recipes x seeds x profiles (each defaults to the spec's own value).
    Every element gets its own run folder under the sweep folder and the sweep's run group."""
    base = (Path(spec.folder) if spec.folder is not None else _default_folder(spec)).resolve()
    group = spec.run_group or base.name
    combos = list(itertools.product(recipes or [spec.recipe], seeds or [spec.seed],
                                    profiles or [spec.profile]))
    if len(set(combos)) != len(combos):
        raise ValueError(f"sweep: repeated combinations in {combos}")
    specs = [dataclasses.replace(spec, recipe=r, seed=s, profile=p, run_group=group)
             for r, s, p in combos]  # replace() re-runs validation for every element
    from .fits import check_fits  # see submit()

    for s in specs:
        check_fits(s)
    submitit_folder = base / "submitit"
    ex = make_executor(spec, submitit_folder)
    runs = []
    for s in specs:
        run_folder = base / s.name
        _prepare_run_folder(s, run_folder)
        runs.append((dataclasses.replace(s, folder=run_folder), run_folder))
    with _submission_env(spec), ex.batch():
        jobs = [ex.submit(_job_callable(s, rf)) for s, rf in runs]
    return [_handle(s, rf, submitit_folder, j) for (s, rf), j in zip(runs, jobs)]
