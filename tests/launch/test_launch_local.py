"""submitit's local executor (the embedded default): several ranks on this machine, cancel."""

from __future__ import annotations

import time

import pytest

from workbench.launch import JobHandle, LaunchSpec, submit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _spec(targets_path, tmp_path, target, **kw):
    return LaunchSpec(folder=tmp_path / "run", wandb="disabled", time_min=10,
                      target=f"launch_targets:{target}", stop_hook="launch_targets:request_stop",
                      pythonpath=targets_path, **kw)


def test_local_ranks_all_reduce(targets_path, tmp_path):
    job = submit(_spec(targets_path, tmp_path, "rank_info", ep=2))
    assert job.spec.executor == "local"
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
