"""One job per run folder: resubmission is a new attempt, a live job or trainer refuses a second,
a folder of the user's files is never written into (submitit's real local executor)."""

from __future__ import annotations

import os
import time

import pytest

from workbench.launch import JobHandle, LaunchError, LaunchSpec, submit
from workbench.train import runfolder


def _spec(targets_path, folder, target, **kw):
    kw = {"folder": folder, "wandb": "disabled", "time_min": 10, "ep": 1, **kw}
    return LaunchSpec.build(target=f"launch_targets:{target}",
                            stop_hook="launch_targets:request_stop", pythonpath=targets_path, **kw)


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resubmission_is_a_new_attempt_and_the_first_result_stays(targets_path, tmp_path):
    folder = tmp_path / "run"
    first = submit(_spec(targets_path, folder, "single", seed=11))
    assert first.wait(timeout=120) == "COMPLETED", first.log_tail(30)
    second = submit(_spec(targets_path, folder, "single", seed=22))
    assert second.wait(timeout=120) == "COMPLETED", second.log_tail(30)
    assert (first.attempt, second.attempt) == (1, 2)
    assert second.result_file == folder / "attempts" / "2" / "job_result.json"
    # each job answers with its own return value, through its handle and through its job id
    assert first.result()["seed"] == 11 and second.result()["seed"] == 22
    assert JobHandle.attach(first.job_id).result()["seed"] == 11
    assert JobHandle.attach(first.job_id).state == "COMPLETED"
    # a folder names its newest job; attempts() lists them all, oldest first
    assert JobHandle.attach(folder).job_id == second.job_id
    assert [h.job_id for h in JobHandle.attempts(folder)] == [first.job_id, second.job_id]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_live_job_refuses_a_second_submission_naming_itself(targets_path, tmp_path):
    folder = tmp_path / "run"
    live = submit(_spec(targets_path, folder, "sleeper"))
    try:
        end = time.monotonic() + 60
        while live.state != "RUNNING":
            assert time.monotonic() < end, live.log_tail(30)
            time.sleep(0.2)
        before = _tree(folder)
        with pytest.raises(LaunchError, match=rf"job {live.job_id} is RUNNING there"):
            submit(_spec(targets_path, folder, "single", seed=3))
        assert _tree(folder) == before  # the refused submission wrote nothing
    finally:  # never leave a 600 s sleeper behind
        assert live.cancel() == "CANCELLED"
    # once the job has ended, the folder takes the next attempt; the cancelled one stays so
    after = submit(_spec(targets_path, folder, "single", seed=4))
    assert after.wait(timeout=120) == "COMPLETED", after.log_tail(30)
    assert after.attempt == 2 and after.result()["seed"] == 4
    assert JobHandle.attach(live.job_id).state == "CANCELLED"
    assert JobHandle.attach(folder).job_id == after.job_id


@pytest.mark.parametrize("what", ["notes", "model"])
def test_submit_never_writes_into_a_folder_of_the_users_files(targets_path, tmp_path, what):
    folder = tmp_path / "mine"
    folder.mkdir()
    if what == "notes":
        (folder / "notes.txt").write_text("mine")
    else:  # a model folder given as the run folder: its config.json is not the run's
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    before = {p: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(LaunchError, match="not a workbench run's"):
        submit(_spec(targets_path, folder, "single"))
    assert {p: p.read_bytes() for p in folder.iterdir()} == before


def test_submit_into_a_folder_a_trainer_holds_is_refused_naming_it(targets_path, tmp_path):
    folder = tmp_path / "run"
    with runfolder.acquire(folder, role="trainer", what="a test's trainer"):
        with pytest.raises(LaunchError, match=rf"in use by a trainer \(pid {os.getpid()} on "):
            submit(_spec(targets_path, folder, "single"))
        assert _tree(folder) == [runfolder.LOCK]


def test_a_run_with_checkpoints_is_continued_only_with_resume(targets_path, tmp_path):
    folder = tmp_path / "run"
    runfolder.claim(folder, runfolder.RUN_ENTRIES)
    (folder / "checkpoints" / "step_00000004").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000004" / "COMPLETE").write_text("")
    with pytest.raises(LaunchError, match="already holds a run with checkpoints.*resume=True"):
        submit(_spec(targets_path, folder, "single"))
    assert not (folder / "launch.json").exists() and not (folder / "submitit").exists()
