"""An eval job chained after training jobs on the real local Slurm cluster: it waits on the
training job (afterok), evaluates the run's export with the group's BF16 and PTQ baselines,
computed once for the group and reused by the group's second run, and its results land in the
run group (notebook 03's reader finds them)."""

from __future__ import annotations

import json
import subprocess

import pytest
from builders import env

from workbench.eval.launch import CACHE_FOLDER, EvalRequest, chain_eval
from workbench.launch import JobHandle, LaunchSpec, sweep
from workbench.track import group_eval, read_eval

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
WAIT_S = 540


def _times(job_id: str) -> tuple[str, str]:
    out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "Start,End"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    start, end = out.strip().splitlines()[0].split("|")
    return start, end


def test_chained_eval_runs_after_training_and_lands_in_the_group(slurm_cluster, group, tmp_path,
                                                                 monkeypatch):
    for k, v in env(tmp_path).items():  # sbatch exports the submitter's environment
        if k.startswith(("HF_", "WANDB_", "TRANSFORMERS_", "OMP_", "TORCHAO_")):
            monkeypatch.setenv(k, v)
    spec = LaunchSpec.build(executor="slurm", init=str(group["bf16_model"]),
                            data=(str(group["root"] / "code.jsonl"),), recipe="mxfp4", steps=4,
                            wandb="offline", export="compressed-tensors", time_min=20,
                            folder=tmp_path / "sweep-group", batch=4, seq=64, lr=1e-3,
                            val_every=0)
    runs = sweep(spec, seeds=[0, 1])
    request = EvalRequest(tasks=("wb_code_choice", "wb_code_complete"), limit=8)
    evals = [chain_eval(r, request) for r in runs]
    # held by the dependency while training has not completed
    assert [e.state for e in evals] == ["PENDING", "PENDING"]
    assert [r.wait(timeout=WAIT_S) for r in runs] == ["COMPLETED"] * 2, runs[0].log_tail(30)
    assert [e.wait(timeout=WAIT_S) for e in evals] == ["COMPLETED"] * 2, evals[0].log_tail(40)
    for r, e in zip(runs, evals):
        assert _times(e.job_id)[0] >= _times(r.job_id)[1]  # started after training ended
        assert e.folder == r.folder / "eval"
        assert JobHandle.attach(e.job_id).folder == e.folder
        assert e.result()["eval"] == str(r.folder / "eval" / "eval.json")
        ev = read_eval(e.folder)
        roles = sorted(m["role"] for m in ev["models"])
        assert roles == ["bf16", "ptq", "qat"]
        (q,) = [m for m in ev["models"] if m["role"] == "qat"]
        assert q["ref"]["kind"] == "run-export" and q["run"] == str(r.folder)
        assert q["n_samples"] == {"wb_code_choice": 8, "wb_code_complete": 8}
    # the baselines were evaluated once for the group: one cache entry each, reused once
    cache = runs[0].folder.parent / CACHE_FOLDER
    assert len(list(cache.glob("*.json"))) == 2
    logs = [e.log_tail(400) for e in evals]
    assert sum(log.count("reused from the group's cache") for log in logs) == 2
    firsts = [[m for m in read_eval(e.folder)["models"] if m["role"] != "qat"] for e in evals]
    for a, b in zip(*firsts):
        assert a["results"] == b["results"]
    # the group's table: both runs, the shared baselines once, recovery per run
    g = group_eval(runs[0].folder.parent)
    assert sorted(g.files) == sorted(str(e.folder / "eval.json") for e in evals)
    assert sorted(set(g.results["model"])) == sorted(
        [r.folder.name for r in runs] + [m["label"] for m in firsts[0]])
    assert sorted(set(g.recovery["model"])) == sorted(r.folder.name for r in runs)
    # the launch record says what the job ran and after which job
    rec = json.loads((evals[1].folder / "launch.json").read_text())
    assert (rec["kind"], rec["after"]) == ("eval", runs[1].job_id)


def test_a_failed_training_job_cancels_its_eval(slurm_cluster, group, tmp_path, monkeypatch):
    for k, v in env(tmp_path).items():
        if k.startswith(("HF_", "WANDB_", "TRANSFORMERS_", "OMP_", "TORCHAO_")):
            monkeypatch.setenv(k, v)
    bad = tmp_path / "broken.jsonl"
    bad.write_text("{not json\n")
    spec = LaunchSpec.build(executor="slurm", init=str(group["bf16_model"]), data=(str(bad),),
                            recipe="mxfp4", steps=2, wandb="disabled", time_min=10,
                            folder=tmp_path / "failing", batch=4, seq=64)
    from workbench.launch import submit

    train = submit(spec)
    ev = chain_eval(train, EvalRequest(tasks=("wb_code_choice",), limit=2))
    assert train.wait(timeout=WAIT_S) == "FAILED"
    assert ev.wait(timeout=120) == "CANCELLED"
