"""Real tiny QAT runs of the workbench trainer through submitit: EP4 on the local executor, EP4
(1x4) and EP8 (2x4) on the local Slurm cluster, and a preempted Slurm run that resumes.

The oracle is the trainer itself: with the same seed and data, the EP4 Slurm run, the EP8 run over
two nodes and the preempted-and-resumed run must all retrace the local-executor EP4 run's loss
curve step by step (observed differences: < 1e-6; the tolerance leaves room for all-to-all
summation order)."""

from __future__ import annotations

import json
import math
import subprocess
import time

import pytest

from workbench.launch import JobHandle, LaunchSpec, ep4, ep8, submit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, SEED, WAIT_S = 30, 3, 540
ATOL = 1e-4


def _qat(tmp, name, preset_fn=ep4, **kw) -> LaunchSpec:
    return preset_fn(preset="tiny", recipe="mxfp4", steps=STEPS, seed=SEED, wandb="disabled",
                     time_min=20, folder=tmp / name, **kw)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """EP4 on submitit's local executor: the reference curve (needs no Slurm)."""
    job = submit(_qat(tmp_path_factory.mktemp("qat"), "local", executor="local"))
    return job, job.wait(timeout=WAIT_S)


def _curve_matches(job: JobHandle, ref: JobHandle) -> None:
    got, want = job.metrics(), ref.metrics()
    assert got["step"].tolist() == list(range(1, STEPS + 1))
    assert got["loss"].tolist() == pytest.approx(want["loss"].tolist(), rel=0, abs=ATOL)


def test_local_executor_ep4_qat_completes(local_run):
    job, state = local_run
    assert state == "COMPLETED", job.log_tail(40)
    assert job.spec.resources.executor == "local"
    res = job.result()
    assert (res["world_size"], res["step"], res["stopped"]) == (4, STEPS, False)
    assert res["recipe"] == "mxfp4"
    assert json.loads((job.folder / "result.json").read_text()) == res  # the trainer's own file
    df = job.metrics()
    assert df["step"].tolist() == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in df["loss"])
    assert df["loss"].tail(5).mean() < df["loss"].head(5).mean() - 0.5  # it learns
    assert (job.folder / "checkpoints" / f"step_{STEPS:08d}").is_dir()


@pytest.mark.slurm
def test_ep4_qat_on_slurm_retraces_local(slurm_cluster, local_run, tmp_path):
    ref, _ = local_run
    job = submit(_qat(tmp_path, "ep4"))
    assert (job.spec.resources.executor, job.spec.resources.nodes,
            job.spec.resources.tasks_per_node) == ("slurm", 1, 4)
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(40)
    assert job.result()["world_size"] == 4
    _curve_matches(job, ref)


@pytest.mark.slurm
def test_ep8_qat_over_two_nodes_retraces_local(slurm_cluster, local_run, tmp_path):
    ref, _ = local_run
    job = submit(_qat(tmp_path, "ep8", preset_fn=ep8))
    assert (job.spec.resources.nodes, job.spec.resources.tasks_per_node) == (2, 4)
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(40)
    assert job.result()["world_size"] == 8
    assert "rank 0/8 local_rank 0 on n1" in job.log_tail(400, rank=0)
    assert "rank 7/8 local_rank 3 on n2" in job.log_tail(400, rank=7)
    _curve_matches(job, ref)


@pytest.mark.slurm
def test_preempted_qat_resumes_on_the_same_curve(slurm_cluster, local_run, tmp_path):
    ref, _ = local_run
    job = submit(_qat(tmp_path, "pre"))
    end = time.monotonic() + WAIT_S
    while len(job.metrics()) < 3:
        assert time.monotonic() < end and job.state in {"PENDING", "RUNNING"}, job.log_tail(40)
        time.sleep(0.2)
    job._job._interrupt()  # submitit's own preemption simulation: SIGTERM, then USR2, to every task
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(40)
    log = job.log_tail(2000, rank=0)
    resumed = [ln for ln in log.splitlines() if ln.startswith("[train] resumed from")]
    assert len(resumed) == 1, log
    stop_step = int(resumed[0].rsplit("step ", 1)[1].rstrip(")"))
    assert 3 <= stop_step < STEPS
    assert (job.folder / "checkpoints").is_dir()
    states = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job.job_id],
                            capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert states == ["REQUEUED", "COMPLETED"], states
    assert job.result()["step"] == STEPS
    _curve_matches(job, ref)  # continuous, and the resumed half is the same training



@pytest.mark.slurm
def test_outside_requeue_restarts_the_trainer_with_resume(slurm_cluster, local_run, tmp_path):
    """`scontrol requeue` from outside (what a node failure does) bypasses the job's preemption
    handler, so Slurm restarts the original submission (resume=False). The second attempt must
    still pass --resume: it continues from the newest checkpoint instead of failing on the
    trainer's refusal to start a fresh run over one that has checkpoints."""
    from workbench.train.checkpointing import list_complete

    ref, _ = local_run
    job = submit(_qat(tmp_path, "requeue", ckpt_every=2))
    end = time.monotonic() + WAIT_S
    while not list_complete(job.folder):
        assert time.monotonic() < end and job.state in {"PENDING", "RUNNING"}, job.log_tail(40)
        time.sleep(0.2)
    assert len(job.metrics()) < STEPS, "the run ended before it could be requeued"
    subprocess.run(["scontrol", "requeue", job.job_id], check=True, timeout=60)
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(60)
    log = job.log_tail(2000, rank=0)
    assert "resume=False restart=1" in log, log  # the original pickle, second attempt
    assert len([ln for ln in log.splitlines() if ln.startswith("[train] resumed from")]) == 1, log
    assert "FileExistsError" not in log
    states = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-o", "State", "-j", job.job_id],
                            capture_output=True, text=True, timeout=30, check=True).stdout.split()
    assert states == ["REQUEUED", "COMPLETED"], states
    assert job.result()["step"] == STEPS
    _curve_matches(job, ref)
