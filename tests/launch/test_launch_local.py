"""submitit's local executor (the embedded default): several ranks on this machine, cancel."""

from __future__ import annotations

import math
import time

import pytest

from workbench.launch import JobHandle, LaunchSpec, submit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _spec(targets_path, tmp_path, target, **kw):
    kw = {"folder": tmp_path / "run", "wandb": "disabled", "time_min": 10, **kw}
    return LaunchSpec.build(target=f"launch_targets:{target}",
                            stop_hook="launch_targets:request_stop", pythonpath=targets_path, **kw)


def test_local_ranks_all_reduce(targets_path, tmp_path):
    job = submit(_spec(targets_path, tmp_path, "rank_info", ep=2))
    assert job.spec.resources.executor == "local"
    assert job.wait(timeout=120) == "COMPLETED", job.log_tail(30)
    ranks = job.result()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and [r["local_rank"] for r in ranks] == [0, 1]
    assert all(r["all_reduce_sum"] == 3.0 for r in ranks)
    assert JobHandle.attach(job.folder).state == "COMPLETED"


def test_local_cancel(targets_path, tmp_path):
    job = submit(_spec(targets_path, tmp_path, "sleeper", ep=1))
    time.sleep(1.0)
    assert job.state == "RUNNING"
    job.cancel()
    assert job.wait(timeout=60) == "CANCELLED"
    assert JobHandle.attach(job.job_id).state == "CANCELLED"


def test_local_preemption_requeues_and_resumes(targets_path, tmp_path):
    steps = 16
    job = submit(_spec(targets_path, tmp_path, "counting_loop", ep=2, steps=steps,
                       target_args=("--step-s", "0.3")))
    end = time.monotonic() + 120
    while len(job.metrics()) < 3:
        assert time.monotonic() < end and job.state == "RUNNING", job.log_tail(30)
        time.sleep(0.2)
    job.interrupt()
    assert job.wait(timeout=180) == "COMPLETED", job.log_tail(30)
    res = job.result()
    df = job.metrics()
    assert df["step"].tolist() == list(range(1, steps + 1))
    assert df["loss"].tolist() == pytest.approx([math.exp(-0.1 * s) for s in range(1, steps + 1)])
    stopped_at = res["started_at"]
    assert 3 <= stopped_at < steps
    pids = df["pid"].tolist()
    assert len(set(pids[:stopped_at])) == 1 and len(set(pids[stopped_at:])) == 1
    assert pids[0] != pids[-1]  # the controller restarted the tasks as new processes
    assert "requeueing job" in job.log_tail(200, rank=0)


def test_stop_during_start_up_is_not_lost(targets_path, tmp_path):
    """USR2 while the target is still starting (and then resets its flag, as the trainer's main
    does) must still stop the run at its first step boundary and requeue it."""
    job = submit(_spec(targets_path, tmp_path, "counting_loop", ep=2, steps=6,
                       target_args=("--start-s", "4", "--step-s", "0.2")))
    end = time.monotonic() + 120
    while not all((job.folder / f"starting{r}").exists() for r in (0, 1)):
        assert time.monotonic() < end and job.state == "RUNNING", job.log_tail(30)
        time.sleep(0.1)
    job.interrupt()
    assert job.wait(timeout=180) == "COMPLETED", job.log_tail(30)
    log = job.log_tail(200, rank=0)
    assert "requeueing job" in log and "resume=True" in log, log
    assert job.metrics()["step"].tolist() == list(range(1, 7))


def test_time_limit_requeues_until_the_budget_is_spent(targets_path, tmp_path):
    """USR2 `signal_delay_s` before the time limit: checkpoint and requeue, counted against
    max_requeues; once none are left the job ends FAILED instead of requeueing forever."""
    job = submit(_spec(targets_path, tmp_path, "counting_loop", ep=2, steps=10_000, time_min=1,
                       signal_delay_s=35, max_requeues=1, target_args=("--step-s", "0.2")))
    assert job.wait(timeout=240) == "FAILED", job.log_tail(30)
    log = job.log_tail(400, rank=0)
    assert log.count("checkpoint saved (time limit)") == 1, log
    assert "0 time-limit requeues left" in log and "too many times" in log, log
    df = job.metrics()  # two runs of the same curve, stopped at the second warning
    assert df["step"].tolist() == list(range(1, len(df) + 1)) and df["pid"].nunique() == 2
