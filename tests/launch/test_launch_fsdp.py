"""FSDP2 layouts of the workbench trainer on the local Slurm cluster: world 4 as
EP2 x FSDP2 and as EP4 + FSDP on one node (1x4), world 8 as EP4 x FSDP2 over two nodes (2x4,
one EP group per node).

The oracle is the trainer's EP4 run without FSDP on submitit's local executor (the reference of
test_launch_qat.py): with the same seed and data, every layout trains the same function on the
same global batches, so its curve must retrace the reference step by step. What differs is only
float summation order (reduce-scatter instead of all-reduce, per-shard grad-norm partial sums);
the CPU tests of tests/train/test_fsdp.py see < 1e-7 relative over 4 steps, and ATOL = 1e-4 over
30 MXFP4 steps is the tolerance test_launch_qat.py already uses for EP8 against EP4.
"""

from __future__ import annotations

import pytest

from workbench.launch import JobHandle, LaunchSpec, ep4, ep4x2_fsdp, submit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, SEED, WAIT_S = 30, 3, 540
ATOL = 1e-4


def _qat(tmp, name, preset_fn=ep4, **kw) -> LaunchSpec:
    return preset_fn(preset="tiny", recipe="mxfp4", steps=STEPS, seed=SEED, wandb="disabled",
                     time_min=20, folder=tmp / name, **kw)


@pytest.fixture(scope="module")
def local_ep4(tmp_path_factory):
    """EP4 without FSDP on submitit's local executor (needs no Slurm): the reference curve."""
    job = submit(_qat(tmp_path_factory.mktemp("fsdp-ref"), "local", executor="local"))
    state = job.wait(timeout=WAIT_S)
    assert state == "COMPLETED", job.log_tail(40)
    return job


def _curve_matches(job: JobHandle, ref: JobHandle) -> None:
    got, want = job.metrics(), ref.metrics()
    assert got["step"].tolist() == list(range(1, STEPS + 1))
    assert got["loss"].tolist() == pytest.approx(want["loss"].tolist(), rel=0, abs=ATOL)


@pytest.mark.slurm
@pytest.mark.parametrize("ep, dp", [(2, 2), (4, 1)], ids=["ep2xfsdp2", "ep4+fsdp"])
def test_world4_fsdp_on_slurm_retraces_ep4(slurm_cluster, local_ep4, tmp_path, ep, dp):
    spec = _qat(tmp_path, f"ep{ep}x{dp}", ep=ep, dp=dp, fsdp=True)
    assert (spec.resources.nodes, spec.resources.tasks_per_node, spec.world_size) == (1, 4, 4)
    argv = spec.job_argv()
    assert f"--ep={ep}" in argv and "--fsdp" in argv
    job = submit(spec)
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(40)
    assert job.result()["world_size"] == 4
    _curve_matches(job, local_ep4)


@pytest.mark.slurm
def test_world8_ep4x2_fsdp_over_two_nodes_retraces_ep4(slurm_cluster, local_ep4, tmp_path):
    job = submit(_qat(tmp_path, "ep4x2", preset_fn=ep4x2_fsdp))
    assert (job.spec.resources.nodes, job.spec.resources.tasks_per_node, job.spec.ep,
            job.spec.dp) == (2, 4, 4, 2)
    assert job.wait(timeout=WAIT_S) == "COMPLETED", job.log_tail(40)
    assert job.result()["world_size"] == 8
    # Ranks 0-3 (EP group 0) on the first node, 4-7 (EP group 1) on the second.
    assert "rank 0/8 local_rank 0 on n1" in job.log_tail(400, rank=0)
    assert "rank 7/8 local_rank 3 on n2" in job.log_tail(400, rank=7)
    _curve_matches(job, local_ep4)
