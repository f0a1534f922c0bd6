"""Submit launch specs through submitit: one job, or a sweep as one job array.

Folder layout of a run (`spec.folder`, the trainer's `--out`; `LaunchSpec.build`'s default is
`./runs/<name>-<time>`):
    launch.json        what JobHandle.attach needs (spec, executor, job id, submitit folder)
    submitit/          submitit's pickles and per-rank logs (<job_id>_<rank>_log.out/.err)
    metrics.jsonl, checkpoints/, result.json    written by the trainer
    job_result.json    rank 0's return value, written by the job
    attempts/N/        launch.json and job_result.json of the N-th submission into the folder
    workbench-run.json, workbench-run.lock     what the run owns; its one writer (runfolder)
A sweep shares one submitit folder, `<sweep folder>/submitit/`, and gives every element its own run
folder `<sweep folder>/<run name>/`.

One job per run folder. A submission takes the folder's lock while it queues the job (the
trainer takes it for the run's life) and refuses, naming the holder, a folder a trainer or a
queued or running job of ours is using, and a folder that is not a run folder of ours (new,
empty, or holding a manifest). Submitting again into the folder of a job that has ended is a new
attempt: its files go to `attempts/N/`, the earlier job's record and result stay where they were
(its handle and `JobHandle.attach(job_id)` read them); `JobHandle.attach(folder)` gives the newest
attempt. A run that has checkpoints is continued only with `resume=True` (else refused, saying so).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import itertools
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import workbench
from workbench.train import runfolder
from workbench.train.determinism import LAUNCH_ENV as DETERMINISTIC_ENV
from workbench.train.runfolder import process_token

from .handle import (
    FORMAT,
    LAUNCH_FILE,
    RESULT_FILE,
    TERMINAL,
    JobHandle,
    LaunchError,
    latest_attempt,
)
from .spec import LaunchSpec, LaunchSpecError, missing_inputs, run_name, safe_name


def _submitit():
    try:
        import submitit
    except ImportError as e:
        raise ImportError("workbench.launch needs submitit: pip install 'workbench[launch]'") from e
    return submitit


def _job_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment for the tasks: PYTHONPATH (this checkout first, so the job imports the same
    workbench as the submitter, plus resources.pythonpath) and the resources' variables."""
    res = spec.resources
    root = str(Path(workbench.__file__).resolve().parents[1])
    paths = list(dict.fromkeys([*res.pythonpath, root]))
    old = os.environ.get("PYTHONPATH")
    env = {"PYTHONPATH": ":".join(paths + ([old] if old else []))}
    # Several ranks share a node's cores: one intra-op thread pool each, sized to its CPUs.
    env["OMP_NUM_THREADS"] = str(res.cpus_per_task)
    if spec.train.deterministic:
        # Set before the rank's Python starts, so no import can create a cuBLAS handle first
        # (the trainer sets it too; resources.env may pick the other deterministic value, ":16:8").
        env.update(DETERMINISTIC_ENV)
    env.update(res.env)
    return env


@contextlib.contextmanager
def _submission_env(spec: LaunchSpec):
    """The local executor starts its controller with a copy of os.environ; set the job's variables
    there while submitting (its `setup` lines would put a shell between us and the controller,
    whose pid is the job id, and SIGINT-cancel would then stop at the shell)."""
    if spec.resources.executor != "local":
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
    res = spec.resources
    if res.executor == "local":
        ex = submitit.LocalExecutor(folder=submitit_folder, max_num_timeout=res.max_requeues)
        ex.update_parameters(tasks_per_node=res.tasks_per_node, nodes=1, timeout_min=res.time_min,
                             gpus_per_node=res.gpus_per_node, signal_delay_s=res.signal_delay_s)
        return ex
    if shutil.which("sbatch") is None:
        raise LaunchError("executor='slurm' but sbatch is not on PATH: run on a Slurm login node, "
                          "start the local cluster (sudo jobs/slurm/local-cluster.sh), or use "
                          "executor='local'")
    # sbatch exports the submitter's environment; these lines add the job's own on top.
    setup = [f"export {k}={shlex.quote(v)}" for k, v in _job_env(spec).items()]
    ex = submitit.SlurmExecutor(folder=submitit_folder, python=shlex.quote(sys.executable),
                                max_num_timeout=res.max_requeues)
    params = {"job_name": res.job_name or f"wb-{spec.name}", "nodes": res.nodes,
              "ntasks_per_node": res.tasks_per_node, "cpus_per_task": res.cpus_per_task,
              "time": res.time_min, "setup": setup, "signal_delay_s": res.signal_delay_s}
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    if res.mem:
        params["mem"] = res.mem
    if res.partition:
        params["partition"] = res.partition
    if res.sbatch:
        params["additional_parameters"] = dict(res.sbatch)
    ex.update_parameters(**params)
    return ex


def _job_callable(spec: LaunchSpec, files: dict[str, str]):
    from .job import DistributedJob  # imports submitit (the `launch` extra): only when submitting

    res = spec.resources
    return DistributedJob(target=spec.target, argv=tuple(spec.job_argv()),
                          result_path=str(spec.folder / files["result_file"]),
                          stop_hook=spec.stop_hook, pythonpath=res.pythonpath,
                          signal_delay_s=res.signal_delay_s,
                          dist_timeout_s=max(1, round(spec.train.dist_timeout * 60)))


def _preflight(spec: LaunchSpec) -> None:
    """What would fail in the job, checked before anything is queued or written: an input that
    does not exist (a typo), a GPU run the planner says cannot fit (`launch.fits`)."""
    # Here, not at module top: the planner reads the model configuration, and
    # `import workbench.launch` stays light for notebooks that only attach to running jobs.
    from .fits import check_fits

    missing = missing_inputs(spec.train)
    if missing:
        raise LaunchSpecError(f"LaunchSpec: the job would read {', '.join(missing)}, which does "
                              "not exist; nothing was queued")
    check_fits(spec)


def _refuse_busy_or_finished(spec: LaunchSpec) -> int:
    """The attempt number this submission gets in `spec.folder` (1 for a new folder), or
    LaunchError when a job of ours is still queued or running there, or when the folder holds a
    run with checkpoints and the spec does not resume it."""
    folder = spec.folder
    previous = latest_attempt(folder)
    if previous is not None:
        state = previous.state
        if state not in TERMINAL:
            raise LaunchError(
                f"{folder}: job {previous.job_id} is {state} there, and a run folder takes one "
                f"job at a time: wait for it (JobHandle.attach({previous.job_id!r}).wait()), "
                "cancel it, or submit into another folder")
    if not spec.train.resume and any((folder / "checkpoints").glob("step_*/COMPLETE")):
        earlier = "" if previous is None else (
            f" (job {previous.job_id}, {previous.state}; its result stays readable: "
            f"JobHandle.attach({previous.job_id!r}).result())")
        raise LaunchError(
            f"{folder} already holds a run with checkpoints{earlier}; to train it further "
            "submit spec.replace(train=spec.train.replace(resume=True)) (with a new --steps, "
            "allow_config_change=('steps',)), or submit into another folder")
    return 1 if previous is None else previous.attempt + 1


def _attempt_files(attempt: int) -> dict[str, str]:
    """Where the attempt's record and result live, relative to the run folder."""
    if attempt == 1:
        return {"record_file": LAUNCH_FILE, "result_file": RESULT_FILE}
    return {"record_file": f"attempts/{attempt}/{LAUNCH_FILE}",
            "result_file": f"attempts/{attempt}/{RESULT_FILE}"}


def _open_run_folder(spec: LaunchSpec) -> tuple[runfolder.RunLock, dict]:
    """Take `spec.folder`'s lock for the submission, refuse what must be refused (see the module
    docstring), name the launcher's entries in the manifest; returns the held lock and the
    attempt's files (release the lock once the job's record is written)."""
    folder = spec.folder
    try:
        kind = runfolder.check_claimable(folder, runfolder.RUN_ENTRIES,
                                         adopt_legacy=spec.train.resume, flag="LaunchSpec folder")
        lock = runfolder.acquire(folder, role="submit")
    except runfolder.RunFolderError as e:
        raise LaunchError(str(e)) from None
    try:
        attempt = _refuse_busy_or_finished(spec)
        files = _attempt_files(attempt)
        runfolder.claim(folder, runfolder.RUN_ENTRIES, legacy=kind == "legacy")
        if attempt > 1:
            (folder / files["record_file"]).parent.mkdir(parents=True, exist_ok=True)
        return lock, {**files, "attempt": attempt}
    except BaseException:
        lock.release()
        raise


def _handle(spec: LaunchSpec, submitit_folder: Path, job, files: dict) -> JobHandle:
    record = {"format": FORMAT, "executor": spec.resources.executor, "job_id": str(job.job_id),
              "run_folder": str(spec.folder), "submitit_folder": str(submitit_folder),
              "submitted_at": _dt.datetime.now(_dt.UTC).isoformat(), "spec": spec.to_json(),
              **files}
    if spec.resources.executor == "local":  # the controller's pid may be reused after it exits
        record["process_token"] = process_token(int(job.job_id))
    handle = JobHandle(spec.folder, record, submitit_job=job)
    handle._save()
    return handle


def submit(spec: LaunchSpec) -> JobHandle:
    """Submit one run into `spec.folder`; returns its handle at once (the job runs in the
    background)."""
    _preflight(spec)
    lock, files = _open_run_folder(spec)
    try:
        submitit_folder = spec.folder / "submitit"
        ex = make_executor(spec, submitit_folder)
        with _submission_env(spec):
            job = ex.submit(_job_callable(spec, files))
        return _handle(spec, submitit_folder, job, files)
    finally:
        lock.release()  # the job's trainer takes the lock when it starts


# The old keywords of sweep(), and the TrainConfig fields a run's name already shows.
_AXIS_ALIASES = {"recipes": "recipe", "seeds": "seed", "profiles": "profile"}
_NAMED = frozenset({"preset", "recipe", "profile", "seed", "ep", "fsdp"})


def sweep_specs(spec: LaunchSpec, **axes: Sequence | None) -> list[LaunchSpec]:
    """The elements of `sweep(spec, **axes)`: the product of `axes`, each a TrainConfig field
    and its values (`recipe=["bf16", "mxfp4"], seed=[0, 1], lr=[1e-4, 3e-4]`; `recipes=`,
    `seeds=`, `profiles=` name the same axes; None leaves an axis out). Every element gets its own
    run folder under the sweep folder (`spec.folder`), named by its run name plus the values the
    name does not already show (`-lr0.0001`), and the sweep's run group (`spec.train.run_group`,
    default: the sweep folder's name)."""
    named: dict[str, list] = {}
    for key, values in axes.items():
        field_name = _AXIS_ALIASES.get(key, key)
        if values is None:
            continue
        if field_name in named:
            raise LaunchSpecError(f"sweep: the axis {field_name!r} is given twice")
        if isinstance(values, (str, bytes)) or not list(values):
            raise LaunchSpecError(f"sweep: {key} must be a non-empty sequence of values, "
                                  f"got {values!r}")
        named[field_name] = list(values)
    base = spec.folder
    group = spec.train.run_group or base.name
    combos = list(itertools.product(*named.values()))
    if len(set(map(repr, combos))) != len(combos):
        raise LaunchSpecError(f"sweep: repeated combinations in {combos}")
    specs = []
    for combo in combos:
        changes = dict(zip(named, combo))
        try:
            train = spec.train.replace(**changes, run_group=group)
            name = run_name(train, spec.resources) + "".join(
                f"-{k}{safe_name(str(v))}" for k, v in changes.items() if k not in _NAMED)
            specs.append(spec.replace(train=train.replace(out=str(base / name))))
        except ValueError as e:  # replace() checks every element again
            raise LaunchSpecError(f"sweep: element {changes}: {' '.join(str(e).split())}") from None
    if len({s.folder for s in specs}) != len(specs):
        raise LaunchSpecError(f"sweep: two elements would share a run folder: "
                              f"{sorted(s.folder.name for s in specs)}")
    return specs


def sweep(spec: LaunchSpec, **axes: Sequence | None) -> list[JobHandle]:
    """One job array (on Slurm) over `sweep_specs(spec, **axes)`, submitted together; returns a
    handle per element."""
    specs = sweep_specs(spec, **axes)
    for s in specs:
        _preflight(s)
    base = spec.folder
    try:  # the sweep folder holds the shared submitit folder and the elements' run folders
        runfolder.check_claimable(base, ["submitit", *(s.folder.name for s in specs)],
                                  flag="sweep folder")
    except runfolder.RunFolderError as e:
        raise LaunchError(str(e)) from None
    runfolder.own(base, "submitit", *(s.folder.name for s in specs))
    submitit_folder = base / "submitit"
    ex = make_executor(spec, submitit_folder)
    opened: list[tuple[runfolder.RunLock, dict]] = []
    try:
        for s in specs:
            opened.append(_open_run_folder(s))
        with _submission_env(spec), ex.batch():
            jobs = [ex.submit(_job_callable(s, files)) for s, (_, files) in zip(specs, opened)]
        return [_handle(s, submitit_folder, j, files)
                for s, j, (_, files) in zip(specs, jobs, opened)]
    finally:
        for lock, _ in opened:
            lock.release()
