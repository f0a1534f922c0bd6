"""`--deterministic` end to end: config, CLI, every torchrun rank, the submitit job's argv and
environment (local executor and the real local Slurm cluster), and two fresh seeded runs with
identical losses.

This file is also the torchrun worker (`__main__`) and the submitit target (`trainer_probe`):
each runs the real trainer (`workbench.train.cli.main`) and records, per rank, the
cuBLAS variable as the rank's process started, and after the run whether PyTorch's
deterministic mode was on and which cuBLAS setting was in force.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.launch import LaunchSpec, submit
from workbench.launch.submit import _job_env
from workbench.train.args import config_from_args
from workbench.train.config import TrainConfig
from workbench.train.determinism import CUBLAS_ENV, CUBLAS_VALUE, enable

HERE = str(Path(__file__).resolve().parent)
ARGS = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--wandb", "disabled", "--warmup", "2",
        "--steps", "3", "--val-every", "0", "--ckpt-every", "0"]


def _rank_state(env_at_start: str | None) -> dict:
    return {"env_at_start": env_at_start, "env_after": os.environ.get(CUBLAS_ENV),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": torch.backends.cudnn.deterministic}


def trainer_probe(argv):
    """submitit target: the real trainer, then every rank's state gathered to rank 0."""
    import torch.distributed as dist

    from workbench.train.cli import main

    start = os.environ.get(CUBLAS_ENV)
    result = main(list(argv))
    me = {"rank": dist.get_rank(), **_rank_state(start)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me)
    return {"result": result, "ranks": everyone}


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_config_and_cli_carry_the_switch(tmp_path):
    assert config_from_args(["--out", str(tmp_path)]).deterministic is True  # the default
    assert config_from_args(["--out", str(tmp_path), "--deterministic"]).deterministic is True
    assert config_from_args(["--out", str(tmp_path), "--no-deterministic"]).deterministic is False
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        TrainConfig(out=str(tmp_path), deterministic="yes")


def test_enable_refuses_a_nondeterministic_cublas_setting(monkeypatch):
    monkeypatch.setenv(CUBLAS_ENV, ":0:0")
    with pytest.raises(ValueError, match=CUBLAS_ENV):
        enable(True)


def test_launch_spec_argv_and_env():
    on, off = LaunchSpec.build(), LaunchSpec.build(deterministic=False)
    assert "--deterministic" in on.job_argv()  # on by default
    assert "--deterministic" not in off.job_argv()
    assert "--no-deterministic" in off.job_argv()
    assert _job_env(on)[CUBLAS_ENV] == CUBLAS_VALUE and CUBLAS_ENV not in _job_env(off)
    # a user's own deterministic choice wins over the default
    assert _job_env(LaunchSpec.build(deterministic=True,
                                     env={CUBLAS_ENV: ":16:8"}))[CUBLAS_ENV] == ":16:8"
    assert LaunchSpec.from_json(on.to_json()).train.deterministic is True
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        LaunchSpec.build(deterministic=1)


def _torchrun(out: Path, report: Path) -> None:
    env = dict(os.environ)
    env.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(HERE).parents[1]) + os.pathsep + env.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", CUBLAS_ENV):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, str(report), *ARGS, "--deterministic", "--out", str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.distributed
def test_torchrun_every_rank_and_two_fresh_runs_identical(tmp_path):
    runs = []
    for i in range(2):
        out, report = tmp_path / f"run{i}", tmp_path / f"report{i}"
        _torchrun(out, report)
        for rank in (0, 1):
            s = json.loads(Path(f"{report}.{rank}.json").read_text())
            # torchrun gave the rank no cuBLAS variable: the trainer set it, before CUDA/cuBLAS
            assert s == {"env_at_start": None, "env_after": CUBLAS_VALUE, "deterministic": True,
                         "cudnn_deterministic": True}, (rank, s)
        assert json.loads((out / "config.json").read_text())["deterministic"] is True
        runs.append(_losses(out))
    assert len(runs[0]) == 3 and runs[0] == runs[1]


def _spec(tmp_path, **kw) -> LaunchSpec:
    return LaunchSpec.build(preset="tiny", steps=3, wandb="disabled", time_min=10, ep=2,
                            folder=tmp_path / "run", deterministic=True,
                            target="test_deterministic_switch:trainer_probe", pythonpath=(HERE,),
                            batch=4, seq=32, warmup=2, val_every=0, **kw)


def _check_job(job) -> None:
    assert job.wait(timeout=600) == "COMPLETED", job.log_tail(40)
    ranks = job.result()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        # in the rank's environment from the job's start (the launch env), and on in the trainer
        assert r["env_at_start"] == CUBLAS_VALUE and r["deterministic"] is True, r


@pytest.mark.distributed
@pytest.mark.slow
def test_submitit_local_job_ranks_get_argv_and_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_LAUNCH_INDEX", str(tmp_path / "index"))
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    _check_job(submit(_spec(tmp_path)))


@pytest.mark.slurm
@pytest.mark.distributed
@pytest.mark.slow
def test_slurm_job_ranks_on_both_nodes_get_argv_and_env(tmp_path, monkeypatch):
    if shutil.which("sbatch") is None or subprocess.run(
            ["sinfo", "-h"], capture_output=True, check=False, timeout=60).returncode != 0:
        if os.environ.get("WORKBENCH_REQUIRE_SLURM") == "1":
            pytest.fail("no Slurm cluster answers sinfo (start jobs/slurm/local-cluster.sh)")
        pytest.skip("no Slurm cluster answers sinfo (jobs/slurm/local-cluster.sh starts one)")
    monkeypatch.setenv("WORKBENCH_LAUNCH_INDEX", str(tmp_path / "index"))
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    _check_job(submit(_spec(tmp_path, executor="slurm", nodes=2)))


if __name__ == "__main__":  # torchrun worker: REPORT then the trainer's argv
    from workbench.train.cli import main

    start = os.environ.get(CUBLAS_ENV)
    report, argv = sys.argv[1], sys.argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    main(argv)
    Path(f"{report}.{rank}.json").write_text(json.dumps(_rank_state(start)))
