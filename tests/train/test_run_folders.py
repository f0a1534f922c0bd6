"""A run writes only inside what it created, and one run at a time (workbench.train.runfolder).

Each case is an ordinary mistake, made as a user makes it: jobs/qat.py in a subprocess (the
trainer's real entry point) over a folder that is not the run's to write. The oracle is the folder
itself: a byte-for-byte snapshot of everything in it before the run, compared after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, command, env

from workbench.train import runfolder
from workbench.train.checkpointing import list_complete
from workbench.train.export import export_model
from workbench.train.export_folder import MARKER, ExportFolderError
from workbench.train.runfolder import LOCK, MANIFEST, RunFolderBusy, RunFolderError

ARGS = [*TINY, "--recipe", "bf16", "--val-every", "0"]
HERE = Path(__file__).resolve().parent


def _qat(args: list[str], extra_env: dict | None = None, worker: Path | None = None
         ) -> subprocess.CompletedProcess:
    cmd = command(1, args) if worker is None else [sys.executable, str(worker), *args]
    return subprocess.run(cmd, env={**env(), **(extra_env or {})}, cwd=REPO,
                          capture_output=True, text=True, timeout=300, check=False)


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder`: its kind, bytes and modification time."""
    snap = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else None
        snap[str(p.relative_to(folder))] = (p.is_dir(), data, st.st_mtime_ns)
    return snap


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A checkpoint transformers wrote, with a tokenizer: what a user passes as --init."""
    import realdata

    folder = tmp_path_factory.mktemp("hf") / "model"
    return realdata.model_with_tokenizer(folder, realdata.corpus_texts(60))


# -- 1. --out is the --init folder -------------------------------------------------------------


@pytest.mark.parametrize("resume", [False, True])
def test_out_equal_to_init_is_refused_and_the_model_untouched(hf_model, tmp_path, resume):
    model = tmp_path / "model"
    subprocess.run(["cp", "-a", str(hf_model), str(model)], check=True)
    before = _snapshot(model)
    line = _one_line_error(_qat([*ARGS, "--steps", "2", "--init", str(model), "--out", str(model),
                                 *(["--resume"] if resume else [])]))
    assert "is the --init checkpoint folder" in line and str(model) in line, line
    assert _snapshot(model) == before


def test_init_inside_out_is_refused(hf_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["cp", "-a", str(hf_model), str(out / "model")], check=True)
    before = _snapshot(out)
    line = _one_line_error(_qat([*ARGS, "--steps", "2", "--init", str(out / "model"),
                                 "--out", str(out)]))
    assert "lies inside --out" in line
    assert _snapshot(out) == before


# -- 2. --out holds the user's files -----------------------------------------------------------


def _users_folder(root: Path) -> Path:
    """What a user keeps in a folder that happens to be named like a run's."""
    out = root / "mine"
    (out / "export" / "sub").mkdir(parents=True)
    (out / "export" / "sub" / "weights.bin").write_bytes(os.urandom(64))
    (out / "checkpoints" / "step_00000001").mkdir(parents=True)  # no COMPLETE marker
    (out / "checkpoints" / "step_00000001" / "notes.txt").write_text("keep me")
    (out / "checkpoints" / ".tmp-scratch").mkdir()
    (out / "checkpoints" / ".tmp-scratch" / "a").write_text("a")
    (out / "config.json").write_text('{"mine": true}')
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    return out


@pytest.mark.parametrize("extra", [[], ["--resume"]])
def test_a_folder_of_the_users_files_is_refused_before_anything_is_written(tmp_path, extra):
    out = _users_folder(tmp_path)
    before = _snapshot(out)
    line = _one_line_error(_qat([*ARGS, "--steps", "2", "--export", "bf16", "--keep", "1",
                                 "--ckpt-every", "1", "--out", str(out), *extra]))
    assert "not a workbench run's" in line and str(out) in line, line
    assert "choose another --out" in line
    assert _snapshot(out) == before  # not even a lock file or a manifest


def test_an_empty_folder_and_a_new_one_are_runs_of_ours(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _ok(_qat([*ARGS, "--steps", "1", "--out", str(empty)]))
    new = tmp_path / "a" / "b"
    _ok(_qat([*ARGS, "--steps", "1", "--out", str(new)]))
    for out in (empty, new):
        owned = runfolder.owned(out)
        assert {"config.json", "metrics.jsonl", "checkpoints", "checkpoints/step_00000001",
                "export", "result.json"} <= owned
        assert (out / LOCK).read_bytes() == b""  # released cleanly: no holder recorded


@pytest.fixture
def our_run(tmp_path) -> Path:
    """A finished run of ours: checkpoints at steps 2 and 4, an export."""
    out = tmp_path / "run"
    _ok(_qat([*ARGS, "--steps", "4", "--ckpt-every", "2", "--keep", "2", "--export", "bf16",
              "--out", str(out)]))
    assert [f.step for f in list_complete(out)] == [2, 4]
    return out


def test_pruning_and_clean_up_touch_only_what_the_run_owns(our_run):
    """Files put into a run folder of ours afterwards (a checkpoint copied in, a scratch folder
    named like a leftover, a folder without a marker) survive a resume that prunes to one."""
    ck = our_run / "checkpoints"
    subprocess.run(["cp", "-a", str(ck / "step_00000002"), str(ck / "step_00000001")], check=True)
    (ck / ".tmp-step_00000003").mkdir()
    (ck / ".tmp-step_00000003" / "mine.txt").write_text("mine")
    (ck / "step_00000009").mkdir()
    (ck / "step_00000009" / "notes.txt").write_text("mine too")
    (our_run / "notes.txt").write_text("the user's")
    foreign = {n: _snapshot(ck / n) for n in ("step_00000001", ".tmp-step_00000003",
                                               "step_00000009")}
    _ok(_qat([*ARGS, "--steps", "6", "--ckpt-every", "1", "--keep", "1", "--resume",
              "--allow-config-change", "steps", "--out", str(our_run)]))
    for name, snap in foreign.items():
        assert _snapshot(ck / name) == snap, name
    assert (our_run / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in ck.iterdir()) == [
        ".tmp-step_00000003", "step_00000001", "step_00000004", "step_00000006", "step_00000009"]
    # keep 1, plus the checkpoint it resumed from; the foreign ones are not the run's
    mine = sorted(p.name for p in ck.iterdir() if runfolder.owns(our_run, f"checkpoints/{p.name}"))
    assert mine == ["step_00000004", "step_00000006"]


def test_an_export_the_user_put_in_place_is_not_replaced(our_run):
    """In a run folder of ours, export/ replaced by a folder of the user's (no marker): a resume
    that would export again is refused before step 1, and the folder stays."""
    subprocess.run(["rm", "-rf", str(our_run / "export")], check=True)
    (our_run / "export").mkdir()
    (our_run / "export" / "model.safetensors").write_bytes(b"the user's")
    before = _snapshot(our_run)
    line = _one_line_error(_qat([*ARGS, "--steps", "6", "--resume", "--allow-config-change",
                                 "steps", "--export", "bf16", "--out", str(our_run)]))
    assert f"{our_run / 'export'} exists and is not an export the workbench wrote" in line
    assert _snapshot(our_run) == before


def test_export_model_never_replaces_a_folder_it_did_not_write(tmp_path):
    from workbench.model import MoEForCausalLM, tiny

    dest = tmp_path / "hf-model"
    dest.mkdir()
    (dest / "config.json").write_text('{"model_type": "llama"}')
    before = _snapshot(tmp_path)
    with pytest.raises(ExportFolderError, match="not an export the workbench wrote"):
        export_model(MoEForCausalLM(tiny(), seed=0), dest, fmt="bf16")
    assert _snapshot(tmp_path) == before
    # a second export over its own first one is fine: the first carries the marker
    ours = export_model(MoEForCausalLM(tiny(), seed=0), tmp_path / "ours", fmt="bf16")
    assert (ours / MARKER).is_file()
    export_model(MoEForCausalLM(tiny(), seed=1), ours, fmt="bf16")


def test_a_manifest_that_is_damaged_is_refused(our_run):
    (our_run / MANIFEST).write_text('{"format": "workbench.run/1", "owned": ["../../etc"]}')
    line = _one_line_error(_qat([*ARGS, "--steps", "6", "--resume", "--allow-config-change",
                                 "steps", "--out", str(our_run)]))
    assert f"{our_run / MANIFEST}: the run folder's manifest is damaged" in line


def test_a_run_folder_of_an_older_workbench_is_adopted_on_resume(our_run):
    """Before manifests: a folder holding only what a run writes, with a complete checkpoint,
    resumes as it did; it is adopted (and pruned) as the run's."""
    (our_run / MANIFEST).unlink()
    (our_run / LOCK).unlink()
    for p in our_run.rglob(MARKER):  # exports of older trainers had no marker either
        p.unlink()
    p = _ok(_qat([*ARGS, "--steps", "6", "--ckpt-every", "2", "--keep", "1", "--resume",
                  "--allow-config-change", "steps", "--out", str(our_run)]))
    assert "adopting what it holds of a run" in p.stdout
    assert [f.step for f in list_complete(our_run)] == [4, 6]  # step 2 pruned: it was the run's


# -- 3. two runs into one --out ------------------------------------------------------------------


def test_a_second_run_into_a_live_run_folder_is_refused_naming_the_holder(tmp_path):
    """Run A sleeps before its step 2 (a slow step, or a notebook cell still running); run B
    into the same folder is refused at once with who holds it, and A finishes intact."""
    out = tmp_path / "run"
    a = subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), *ARGS, "--steps", "3",
                          "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**env(), "HANG_RANK": "0", "HANG_STEP": "2", "HANG_S": "20"})
    try:
        end = time.monotonic() + 240
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text():
            assert a.poll() is None and time.monotonic() < end, a.communicate()
            time.sleep(0.2)
        for extra in ([], ["--resume"]):
            line = _one_line_error(_qat([*ARGS, "--steps", "3", "--out", str(out), *extra]))
            assert f"{out} is in use by a trainer (pid {a.pid} on " in line, line
        _out_a, err_a = a.communicate(timeout=240)
        assert a.returncode == 0, err_a[-3000:]
    finally:
        if a.poll() is None:
            a.kill()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3]
    assert [f.step for f in list_complete(out)] == [3]


def test_a_lock_left_by_a_killed_run_is_reported_and_taken_over(tmp_path):
    out = tmp_path / "run"
    a = subprocess.Popen([sys.executable, str(HERE / "fault_worker.py"), *ARGS, "--steps", "3",
                          "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**env(), "HANG_RANK": "0", "HANG_STEP": "2", "HANG_S": "60"})
    end = time.monotonic() + 240
    while not (out / LOCK).is_file() or not (out / LOCK).read_bytes():
        assert a.poll() is None and time.monotonic() < end, a.communicate()
        time.sleep(0.2)
    a.send_signal(signal.SIGKILL)
    a.communicate()
    held = json.loads((out / LOCK).read_text())
    assert held["pid"] == a.pid and held["role"] == "trainer"
    p = _ok(_qat([*ARGS, "--steps", "3", "--out", str(out)]))  # no checkpoint yet: fresh start
    assert f"a trainer (pid {a.pid} on " in p.stdout and "ended without releasing it" in p.stdout


def test_without_working_flock_a_live_holder_on_this_host_still_counts(tmp_path, monkeypatch):
    """A file system whose flock fails with ENOLCK (some NFS set-ups): the record decides."""
    import errno
    import fcntl

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {"host": os.uname().nodename, "pid": other.pid, "role": "trainer",
                  "token": runfolder.process_token(other.pid), "since": "then"}
        (tmp_path / LOCK).write_text(json.dumps(holder))

        def no_flock(fd, op):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(fcntl, "flock", no_flock)
        with pytest.raises(RunFolderBusy, match=f"a trainer \\(pid {other.pid} on "):
            runfolder.acquire(tmp_path, role="trainer")
    finally:
        other.kill()
        other.wait()
    lock = runfolder.acquire(tmp_path, role="trainer")  # the holder is gone: stale, taken over
    assert lock.stale["pid"] == other.pid and not lock.flock
    lock.release()


def test_the_lock_is_one_writer_per_folder_and_names_the_holder(tmp_path):
    lock = runfolder.acquire(tmp_path, role="submit", what="a test")
    try:
        with pytest.raises(RunFolderBusy) as e:
            runfolder.acquire(tmp_path, role="trainer")
        assert f"a submission (pid {os.getpid()} on {os.uname().nodename}" in str(e.value)
        assert "a test" in str(e.value)
    finally:
        lock.release()
    again = runfolder.acquire(tmp_path, role="trainer")
    assert again.stale is None  # released cleanly before
    again.release()


def test_manifest_entries_stay_inside_the_folder(tmp_path):
    for bad in ("../x", "/etc/passwd", "a/../../b", "", "a\\b"):
        (tmp_path / MANIFEST).write_text(json.dumps({"format": "workbench.run/1",
                                                     "owned": [bad]}))
        with pytest.raises(RunFolderError, match="manifest is damaged"):
            runfolder.owned(tmp_path)
    (tmp_path / MANIFEST).unlink()
    (tmp_path / "theirs").mkdir()
    assert not runfolder.remove_owned(tmp_path, "theirs") and (tmp_path / "theirs").is_dir()
    runfolder.own(tmp_path, "mine")
    (tmp_path / "mine").mkdir()
    assert runfolder.remove_owned(tmp_path, "mine") and not (tmp_path / "mine").exists()
    assert runfolder.owned(tmp_path) == frozenset()


def test_every_top_level_file_of_a_run_is_declared():
    """What the trainer's modules name as their files is in the entries a run claims."""
    from workbench.train import cli, datasets, expert_stats, metrics

    for name in (cli.WANDB_RUN_ID_FILE, datasets.DATA_JSON, expert_stats.FILE,
                 metrics.METRICS_FILE, "config.json", "result.json", "export", "checkpoints"):
        assert name in runfolder.TRAINER_ENTRIES, name
    from workbench.eval.launch import EVAL_FOLDER
    from workbench.launch.handle import LAUNCH_FILE, RESULT_FILE

    assert {LAUNCH_FILE, RESULT_FILE, "submitit", "attempts", EVAL_FOLDER} == set(
        runfolder.LAUNCH_ENTRIES)
