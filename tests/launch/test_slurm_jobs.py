"""submitit jobs on the real local Slurm cluster: distributed rank wiring, cancel, arrays and
re-attach. Preemption on Slurm is tested with the real trainer in test_launch_qat.py, and with a
toy loop on the local executor in test_launch_local.py."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from workbench.launch import JobFailedError, JobHandle, LaunchSpec, submit, sweep

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.slow]
WAIT_S = 240


def _spec(targets_path, tmp_path, target, **kw):
    return LaunchSpec.build(executor="slurm", folder=tmp_path / "run", wandb="disabled",
                            time_min=10, target=f"launch_targets:{target}",
                            stop_hook="launch_targets:request_stop", pythonpath=targets_path, **kw)


@pytest.mark.parametrize("nodes,tpn", [(1, 4), (2, 2)])
def test_gloo_all_reduce_over_tasks(slurm_cluster, targets_path, tmp_path, nodes, tpn):
    job = submit(_spec(targets_path, tmp_path, "rank_info", ep=nodes * tpn, nodes=nodes, seed=7))
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(30)
    res = job.result()
    ranks = res["ranks"]
    world = nodes * tpn
    assert res["seed"] == 7
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["world_size"] == world and r["backend"] == "gloo" for r in ranks)
    assert all(r["all_reduce_sum"] == world * (world + 1) / 2 for r in ranks)
    # Slurm placed tpn tasks on each of `nodes` nodes, local ranks 0..tpn-1 on each.
    # (which nodes is Slurm's choice: a busy n1 sends a one-node job to n2)
    placed = Counter(r["slurmd"] for r in ranks)
    assert set(placed) <= {"n1", "n2"} and sorted(placed.values()) == [tpn] * nodes
    for node in {r["slurmd"] for r in ranks}:
        assert sorted(r["local_rank"] for r in ranks if r["slurmd"] == node) == list(range(tpn))
    assert {r["master_addr"] for r in ranks} == {min(placed)}  # the job's first node
    assert len({r["pid"] for r in ranks}) == world
    assert f"rank {world - 1}/{world}" in job.log_tail(50, rank=world - 1)

    # A new kernel re-attaches by folder or by job id and sees the same job.
    for key in (job.folder, job.job_id):
        again = JobHandle.attach(key)
        assert (again.job_id, again.state, again.result()) == (job.job_id, "COMPLETED", res)
        assert again.spec.ep == world


def test_cancel_is_seen_as_cancelled(slurm_cluster, targets_path, tmp_path):
    job = submit(_spec(targets_path, tmp_path, "sleeper", ep=2, nodes=2))
    end = time.monotonic() + WAIT_S
    while job.state != "RUNNING":
        assert time.monotonic() < end, job.state
        time.sleep(0.5)
    job.cancel()
    assert job.wait(timeout=60) == "CANCELLED"
    with pytest.raises(JobFailedError, match="CANCELLED"):
        job.result()


def test_sweep_is_one_array_that_finishes(slurm_cluster, targets_path, tmp_path):
    jobs = sweep(_spec(targets_path, tmp_path, "single", ep=1), seeds=[0, 1, 2])
    array_ids = {j.job_id.split("_")[0] for j in jobs}
    assert len(array_ids) == 1 and [j.job_id.split("_")[1] for j in jobs] == ["0", "1", "2"]
    assert [j.wait(timeout=WAIT_S) for j in jobs] == ["COMPLETED"] * 3
    assert [j.result()["seed"] for j in jobs] == [0, 1, 2]
    assert len({j.folder for j in jobs}) == 3
    assert {j.spec.train.run_group for j in jobs} == {"run"}  # the sweep folder's name
    assert JobHandle.attach(jobs[2].job_id).folder == jobs[2].folder

