"""The launcher against hostile or unlucky conditions: a test process that ignores SIGINT, damaged
or crafted launch records, a reused pid, shell-unsafe spec keys, Slurm queries that fail while the
daemons restart."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from workbench.launch import JobHandle, LaunchError, LaunchSpec, LaunchSpecError
from workbench.launch import handle as handle_mod
from workbench.launch.handle import FORMAT, LAUNCH_FILE, slurm_state

HERE = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def process_token(pid: int) -> str:
    """launch.json's identity of a process: boot id and start time (field 22 of /proc/PID/stat)."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}"


# --- cancel when SIGINT is ignored -------------------------------------------------------------

_CANCEL_SCENARIO = textwrap.dedent("""
    import json, signal, sys, time
    from pathlib import Path
    from workbench.launch import LaunchSpec, submit

    def _descendants(pid):
        kids = {}
        for st in Path("/proc").glob("[0-9]*/stat"):
            try:
                f = st.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(f[1]), []).append(int(st.parent.name))
        out, todo = [], [pid]
        while todo:
            for c in kids.get(todo.pop(), []):
                out.append(c)
                todo.append(c)
        return out

    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as in `cmd &` from a script
    run = Path(sys.argv[1])
    job = submit(LaunchSpec.build(target="launch_targets:sleeper",
                                  stop_hook="launch_targets:request_stop",
                                  pythonpath=(sys.argv[2],), folder=run, wandb="disabled",
                                  time_min=10, ep=1))
    end = time.monotonic() + 120
    while not any(Path(f"/proc/{p}/cmdline").read_bytes().find(b"submitit.core._submit") >= 0
                  for p in _descendants(int(job.job_id)) if Path(f"/proc/{p}").exists()):
        assert time.monotonic() < end, job.log_tail(20)
        time.sleep(0.2)
    tasks = _descendants(int(job.job_id))
    print(json.dumps({"controller": int(job.job_id), "tasks": tasks}), flush=True)
    returned = job.cancel()
    print(json.dumps({"returned": returned, "state": job.wait(timeout=30)}), flush=True)
""")


def test_cancel_reaches_the_tasks_when_sigint_is_ignored(tmp_path, launch_index):
    """The scenario runs in a child that inherits SIGINT ignored (what a non-interactive shell
    gives a background job): submitit's controller and its task then ignore SIGINT, and the task
    ignores SIGTERM (submitit's handler). cancel() must still end both and say CANCELLED."""
    env = {**os.environ, "WORKBENCH_LAUNCH_INDEX": str(launch_index)}
    out_path, err_path = tmp_path / "scenario.out", tmp_path / "scenario.err"
    # Files, not pipes: a controller that survives would hold a pipe open and block the reader.
    with out_path.open("w") as out, err_path.open("w") as err:
        # `trap '' INT` then exec: the child starts with SIGINT ignored, as `cmd &` does.
        proc = subprocess.Popen(["bash", "-c", 'trap "" INT; exec "$@"', "bash", sys.executable,
                                 "-c", _CANCEL_SCENARIO, str(tmp_path / "run"), str(HERE)],
                                stdout=out, stderr=err, env=env)
        proc.wait(timeout=400)
    lines = [json.loads(ln) for ln in out_path.read_text().splitlines() if ln.startswith("{")]
    pids = [lines[0]["controller"], *lines[0]["tasks"]] if lines else []
    try:
        assert proc.returncode == 0, out_path.read_text() + err_path.read_text()
        assert lines[0]["tasks"], "the scenario saw no task processes"
        assert lines[1] == {"returned": "CANCELLED", "state": "CANCELLED"}
        for pid in pids:
            assert not _alive(pid), f"pid {pid} outlived cancel()"
        assert JobHandle.attach(tmp_path / "run").state == "CANCELLED"
    finally:  # never leave a 600 s sleeper behind, whatever failed
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# --- damaged and crafted launch records --------------------------------------------------------

def _record(tmp_path: Path, **over) -> dict:
    spec = LaunchSpec.build(folder=tmp_path / "run", wandb="disabled")
    rec = {"format": FORMAT, "executor": "local", "job_id": "4242",
           "run_folder": str(tmp_path / "run"), "submitit_folder": str(tmp_path / "run/submitit"),
           "spec": spec.to_json()}
    rec.update(over)
    return rec


def _write_run(folder: Path, content: bytes | dict | list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    (folder / LAUNCH_FILE).write_bytes(data)
    return folder


@pytest.mark.parametrize("content, words", [
    ([1, 2], "JSON object"),
    (b"\xff\xfe{\x00", "cannot read"),
    (b'{"format": "workbench.launch/1", "job_id": "1"', "cannot read"),
    ("missing-executor", "missing key 'executor'"),
    ("missing-spec", "missing key 'spec'"),
    ("bad-id", "job_id"),
    ("bad-spec", "bad spec"),
    ("bad-executor", "executor"),
])
def test_attach_damaged_launch_json_is_a_launch_error(tmp_path, content, words):
    if content == "missing-executor":
        content = {k: v for k, v in _record(tmp_path).items() if k != "executor"}
    elif content == "missing-spec":
        content = {k: v for k, v in _record(tmp_path).items() if k != "spec"}
    elif content == "bad-id":
        content = _record(tmp_path, job_id="../../etc/passwd")
    elif content == "bad-spec":
        content = _record(tmp_path, spec={"ep": "eight"})
    elif content == "bad-executor":
        content = _record(tmp_path, executor="ssh")
    run = _write_run(tmp_path / "run", content)
    with pytest.raises(LaunchError, match=words) as e:
        JobHandle.attach(run)
    assert LAUNCH_FILE in str(e.value)


def test_attach_by_id_cannot_leave_the_index(tmp_path, launch_index):
    """`attach("../x")` used to read `<index>/../x.json`: any JSON file next to the index, and
    through its "folder" any launch.json anywhere."""
    run = _write_run(tmp_path / "elsewhere", _record(tmp_path))
    launch_index.mkdir(parents=True, exist_ok=True)
    (launch_index.parent / "x.json").write_text(json.dumps({"folder": str(run)}))
    with pytest.raises(LaunchError, match="not a job id"):
        JobHandle.attach("../x")
    (launch_index / "77.json").write_text(json.dumps(["not", "an", "object"]))
    with pytest.raises(LaunchError, match="JSON object"):
        JobHandle.attach("77")
    (launch_index / "78.json").write_text(json.dumps({"folder": str(run)}))
    assert JobHandle.attach("78").job_id == "4242"  # a real id still resolves


def test_a_reused_pid_is_not_the_job(tmp_path):
    """A local job's pid that now belongs to another process: not RUNNING, and cancel() leaves
    that process alone."""
    other = subprocess.Popen(["sleep", "60"])  # stands for whatever got the pid later
    try:
        # The job that had this pid started earlier: same boot, an earlier start time. (A second
        # real process cannot stand for it: two processes started within one clock tick share a
        # start time, and the kernel will not hand out a chosen pid.)
        boot, start = process_token(other.pid).rsplit(":", 1)
        token = f"{boot}:{int(start) - 1}"
        run = _write_run(tmp_path / "run", _record(tmp_path, job_id=str(other.pid),
                                                   process_token=token))
        job = JobHandle.attach(run)
        assert job.state == "FAILED"
        assert job.cancel() == "CANCELLED"
        assert other.poll() is None, "cancel() killed an unrelated process"
        # The same record with the live process's own token is that process: RUNNING.
        _write_run(run, _record(tmp_path, job_id=str(other.pid),
                                process_token=process_token(other.pid)))
        assert JobHandle.attach(run).state == "RUNNING"
    finally:
        other.kill()
        other.wait()


# --- spec keys that reach the sbatch script -----------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"env": {"A; touch /tmp/pwned": "1"}}, "env: key"),
    ({"env": {"1A": "1"}}, "env: key"),
    ({"env": {"A-B": "1"}}, "env: key"),
    ({"env": {"A": "1\ntouch /tmp/pwned"}}, "one line"),
    ({"sbatch": {"qos=x\n#SBATCH --uid": "0"}}, "sbatch: key"),
    ({"sbatch": {"qos": "high\nrm -rf /"}}, "one line"),
])
def test_spec_keys_are_validated_as_names(kwargs, words):
    with pytest.raises(LaunchSpecError, match=words):
        LaunchSpec.build(**kwargs)


def test_valid_spec_keys_pass():
    s = LaunchSpec.build(env={"MY_VAR_1": "a b", "_X": "1"},
                         sbatch={"qos": "high", "mail-type": "END"})
    assert dict(s.resources.env) == {"MY_VAR_1": "a b", "_X": "1"}


# --- Slurm queries during a daemon restart ------------------------------------------------------

def _fake_slurm(tmp_path: Path, fail_times: int, message: str) -> Path:
    """Real executables named sacct/squeue on PATH that fail `fail_times` times with `message`
    (as sacct does while slurmdbd is not connected), then answer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "calls"
    count.write_text("0")
    # The interpreter is called from a sh wrapper, not named in a shebang: a shebang ends at the
    # first space, and the clone (so the venv's python) may live in a path with spaces.
    script = textwrap.dedent(f"""\
        import sys
        from pathlib import Path
        p = Path({str(count)!r})
        n = int(p.read_text()) + 1
        p.write_text(str(n))
        if n <= {fail_times}:
            sys.stderr.write({message!r} + "\\n")
            sys.exit(1)
        print("123|RUNNING")
        """)
    (tmp_path / "fake_slurm.py").write_text(script)
    wrapper = f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "fake_slurm.py"))} "$@"\n'
    for name in ("sacct", "squeue"):
        (bin_dir / name).write_text(wrapper)
        (bin_dir / name).chmod(0o755)
    return count


def test_slurm_queries_retry_transient_failures(tmp_path, monkeypatch):
    monkeypatch.setattr(handle_mod, "QUERY_FIRST_WAIT_S", 0.01, raising=False)
    msg = ("sacct: error: slurm_persist_conn_open_without_init: failed to open persistent "
           "connection to host:localhost:6819: Connection refused")
    count = _fake_slurm(tmp_path, 2, msg)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert slurm_state("123") == "RUNNING"
    assert count.read_text() == "3" and len(caught) == 2


def test_slurm_queries_give_up_after_a_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(handle_mod, "QUERY_FIRST_WAIT_S", 0.01, raising=False)
    count = _fake_slurm(tmp_path, 1000, "sacct: error: Connection refused")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LaunchError, match="Connection refused"):
            slurm_state("123")
    assert int(count.read_text()) == getattr(handle_mod, "QUERY_TRIES", -1)


def test_slurm_queries_do_not_retry_real_errors(tmp_path, monkeypatch):
    count = _fake_slurm(tmp_path, 1000, "sacct: error: Invalid job id specified")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    with pytest.raises(LaunchError, match="Invalid job id"):
        slurm_state("123")
    assert count.read_text() == "1"
