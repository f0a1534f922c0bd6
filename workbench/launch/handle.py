"""Job handles for notebooks: fresh state, logs, live metrics, result, cancel, re-attach.

Everything a handle needs is persisted as JSON in the run folder (`launch.json`, or
`attempts/N/launch.json` for the N-th submission into one folder) and in a small index
(`~/.cache/workbench/launch/jobs/<job_id>.json`, or `$WORKBENCH_LAUNCH_INDEX`), so a new kernel
re-attaches with `JobHandle.attach(folder_or_job_id)`: a folder gives its newest job, a job id
that job; nothing of ours is pickled. Each job reads its own record and result file, so a later
submission into the folder never changes what an earlier job's handle reports.
State is read fresh on every access (sacct, falling back to squeue while accounting lags), never
from submitit's watcher cache, which keeps a finished state forever and polls only every 10 min.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import warnings
from pathlib import Path

from workbench._io import atomic_write_json

from .spec import LaunchSpec

LAUNCH_FILE = "launch.json"
RESULT_FILE = "job_result.json"
# /2: the spec is {"train": TrainConfig fields, "resources": ...}; /1 held a flat copy of them.
FORMAT = "workbench.launch/2"
# States after which a job never runs again (a requeued job shows REQUEUED/PENDING instead).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                      "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})


# A Slurm job id ("4242") or array element ("4242_3"); a local job id is the controller's pid.
JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")
# Where a job's record and result live in its run folder: at the top for the first submission,
# in attempts/N/ for the N-th.
_RECORD_FILE = re.compile(r"^(?:attempts/(?P<n>[1-9][0-9]{0,5})/)?launch\.json$")
_RESULT_FILE = re.compile(r"^(?:attempts/[1-9][0-9]{0,5}/)?job_result\.json$")
MAX_RECORD_BYTES = 1 << 20  # launch.json and index entries are a few KiB; refuse anything huge
# Transient failures of Slurm's client commands: accounting (slurmdbd) or the controller not
# answering yet (a restart), or answering slowly under load. Retried, with a bound.
_TRANSIENT = re.compile(r"persistent connection|slurm_persist_conn|Connection refused|"
                        r"Unable to contact slurm controller|Socket timed out|"
                        r"Zero Bytes were transmitted|Transport endpoint|"
                        r"slurmdbd|try again|Resource temporarily unavailable", re.IGNORECASE)
QUERY_TRIES = 6
QUERY_FIRST_WAIT_S = 1.0


class LaunchError(RuntimeError):
    """A job could not be found, queried, or did not produce a result."""


class JobFailedError(LaunchError):
    """The job ended in a state other than COMPLETED."""


def index_dir() -> Path:
    env = os.environ.get("WORKBENCH_LAUNCH_INDEX")
    return Path(env) if env else Path.home() / ".cache" / "workbench" / "launch" / "jobs"


def write_json_atomic(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # the index folder may not exist yet
    atomic_write_json(path, obj, default=str)


def _run(cmd: list[str], timeout: float = 30) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except FileNotFoundError as e:
        raise LaunchError(f"{cmd[0]} not found: is this a Slurm login node? "
                          "(locally: sudo jobs/slurm/local-cluster.sh)") from e
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"{' '.join(cmd)} failed ({e.returncode}): {e.stderr.strip()}") from e
    except subprocess.TimeoutExpired as e:
        raise LaunchError(f"{' '.join(cmd)} did not answer within {timeout}s") from e
    return out.stdout


def _query(cmd: list[str]) -> str:
    """`_run` for read-only queries (sacct, squeue): a transient failure (daemon restarting,
    accounting not connected yet, a timeout under load) is retried with a doubling wait, at most
    QUERY_TRIES times (about half a minute in all); any other failure, or the last one, raises."""
    tries, wait = QUERY_TRIES, QUERY_FIRST_WAIT_S
    for attempt in range(1, tries + 1):
        try:
            return _run(cmd)
        except LaunchError as e:
            cause = e.__cause__
            transient = isinstance(cause, subprocess.TimeoutExpired) or (
                isinstance(cause, subprocess.CalledProcessError)
                and _TRANSIENT.search(cause.stderr or ""))
            if not transient or attempt == tries:
                raise
            warnings.warn(f"{e} (attempt {attempt} of {tries}; retrying in {wait:.0f}s)",
                          RuntimeWarning, stacklevel=2)
            time.sleep(wait)
            wait = min(2 * wait, 16.0)
    raise AssertionError("unreachable")


def slurm_state(job_id: str) -> str:
    """Fresh Slurm state of one job (or array element `123_4`), e.g. 'RUNNING', 'CANCELLED'."""
    out = _query(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"])
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid.strip() == job_id and state:
            return state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    # Accounting can lag a second or two behind the controller right after submission.
    out = _query(["squeue", "-h", "-j", job_id, "-o", "%T"])
    states = out.split()
    return states[0] if states else "UNKNOWN"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, ...]; None if there is no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_running(pid: int, token: str | None = None) -> bool:
    """The process `pid` is alive (not a zombie) and, when `token` is given, is still the very
    process that token was taken from, not a newer one that got the same pid."""
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return token is None
        return token is None  # alive but /proc unreadable: identity cannot be checked
    if fields[0] == "Z":  # an exited child of this very process is a zombie until reaped
        return False
    return token is None or f"{_boot_id()}:{fields[19]}" == token


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (the controller's tasks and anything they started)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _read_record(path: Path, what: str) -> dict:
    """A small JSON object from `path`, or LaunchError naming the file."""
    try:
        if path.is_symlink() or not path.is_file():
            raise LaunchError(f"{path}: {what} is not a regular file")
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise LaunchError(f"{path}: {what} is larger than {MAX_RECORD_BYTES} bytes")
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise LaunchError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(obj, dict):
        raise LaunchError(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_record(path: Path, record: dict) -> None:
    if record.get("format") != FORMAT:
        old = " (written by an older workbench; its run folder reads with workbench.track)" \
            if record.get("format") == "workbench.launch/1" else ""
        raise LaunchError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}{old}")
    for key in ("executor", "job_id", "submitit_folder", "spec"):
        if key not in record:
            raise LaunchError(f"{path}: missing key {key!r}")
    if record["executor"] not in ("local", "slurm"):
        raise LaunchError(f"{path}: executor {record['executor']!r}, expected 'local' or 'slurm'")
    jid = record["job_id"]
    if not isinstance(jid, str) or not JOB_ID.match(jid) or (
            record["executor"] == "local" and "_" in jid):
        raise LaunchError(f"{path}: job_id {jid!r} is not a job id")
    if not isinstance(record["submitit_folder"], str):
        raise LaunchError(f"{path}: submitit_folder must be a string")
    token = record.get("process_token")
    if token is not None and not isinstance(token, str):
        raise LaunchError(f"{path}: process_token must be a string")
    for key, pattern in (("record_file", _RECORD_FILE), ("result_file", _RESULT_FILE)):
        value = record.get(key)
        if value is not None and not (isinstance(value, str) and pattern.match(value)):
            raise LaunchError(f"{path}: {key} {value!r} is not a file of the run folder")
    if not isinstance(record["spec"], dict):
        raise LaunchError(f"{path}: spec must be a JSON object")
    try:
        LaunchSpec.from_json(record["spec"])
    except Exception as e:  # a LaunchSpecError, or a TypeError for an unknown field
        raise LaunchError(f"{path}: bad spec: {e}") from e


class JobHandle:
    """A submitted run: `.state`, `.wait()`, `.log_tail()`, `.metrics()`, `.result()`,
    `.cancel()`, `.interrupt()`; `JobHandle.attach(folder_or_id)` from a new kernel."""

    def __init__(self, folder: str | Path, record: dict, submitit_job: object | None = None):
        self.folder = Path(folder)
        self._record = record
        self._job = submitit_job  # only in the submitting process; never needed for correctness

    def __repr__(self) -> str:
        return f"JobHandle({self.job_id!r}, {self.executor}, folder={str(self.folder)!r})"

    @property
    def job_id(self) -> str:
        return self._record["job_id"]

    @property
    def executor(self) -> str:
        return self._record["executor"]

    @property
    def spec(self) -> LaunchSpec:
        return LaunchSpec.from_json(self._record["spec"])

    @property
    def submitit_folder(self) -> Path:
        return Path(self._record["submitit_folder"])

    @property
    def record_file(self) -> str:
        """This job's record, relative to the run folder."""
        return self._record.get("record_file", LAUNCH_FILE)

    @property
    def result_file(self) -> Path:
        """Where this job's rank 0 writes its return value."""
        return self.folder / self._record.get("result_file", RESULT_FILE)

    @property
    def attempt(self) -> int:
        """1 for the first job submitted into the folder, N for the N-th."""
        m = _RECORD_FILE.match(self.record_file)
        return int(m["n"]) if m and m["n"] else 1

    # --- persistence ---------------------------------------------------------------------------
    def _save(self) -> None:
        write_json_atomic(self.folder / self.record_file, self._record)
        write_json_atomic(index_dir() / f"{self.job_id}.json",
                          {"folder": str(self.folder.resolve()), "record": self.record_file})

    @classmethod
    def _load(cls, folder: Path, record_file: str) -> JobHandle:
        path = folder / record_file
        record = _read_record(path, LAUNCH_FILE)
        _check_record(path, record)
        if record.get("record_file", LAUNCH_FILE) != record_file:
            raise LaunchError(f"{path}: record_file {record.get('record_file')!r} is not where "
                              "the record lies")
        return cls(folder, record)

    @classmethod
    def attach(cls, folder_or_id: str | Path) -> JobHandle:
        """Re-attach from a new kernel by run folder (its newest job) or job id (e.g. '4242' or
        '4242_3': that job, whichever attempt in its folder it was)."""
        p = Path(folder_or_id)
        if (p / LAUNCH_FILE).exists():
            return latest_attempt(p)
        key = str(folder_or_id)
        # Only a job id names an index entry, so "../x" cannot reach outside the index.
        if not JOB_ID.match(key):
            raise LaunchError(f"no run folder with {LAUNCH_FILE} at {key!r}, and {key!r} is "
                              "not a job id")
        entry = index_dir() / f"{key}.json"
        if not entry.exists():
            raise LaunchError(f"no run folder with {LAUNCH_FILE} at {key!r} and no job "
                              f"{key!r} in the launch index {index_dir()}")
        rec = _read_record(entry, "launch index entry")
        folder, record_file = rec.get("folder"), rec.get("record", LAUNCH_FILE)
        if not isinstance(folder, str):
            raise LaunchError(f"{entry}: 'folder' must be a string, got {folder!r}")
        if not (isinstance(record_file, str) and _RECORD_FILE.match(record_file)):
            raise LaunchError(f"{entry}: 'record' {record_file!r} is not a job record's path")
        return cls._load(Path(folder), record_file)

    @classmethod
    def attempts(cls, folder: str | Path) -> list[JobHandle]:
        """Every job submitted into the run folder, oldest first."""
        folder = Path(folder)
        found = [LAUNCH_FILE] if (folder / LAUNCH_FILE).exists() else []
        root = folder / "attempts"
        if root.is_dir():
            nums = sorted(int(p.name) for p in root.iterdir()
                          if p.name.isdigit() and (p / LAUNCH_FILE).is_file())
            found += [f"attempts/{n}/{LAUNCH_FILE}" for n in nums]
        return [cls._load(folder, f) for f in found if _RECORD_FILE.match(f)]

    # --- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """Fresh state, Slurm names: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ..."""
        if self.executor == "slurm":
            return slurm_state(self.job_id)
        if _pid_running(int(self.job_id), self._record.get("process_token")):
            return "RUNNING"
        if self.result_file.is_file():
            return "COMPLETED"
        return "CANCELLED" if self._record.get("cancelled") else "FAILED"

    def done(self) -> bool:
        return self.state in TERMINAL

    def wait(self, timeout: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the job reaches a final state; returns it. TimeoutError after `timeout` s."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.state
            if state in TERMINAL:
                return state
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {self.job_id} ({self.folder}) still {state} after "
                                   f"{timeout}s\n{self.log_tail(10)}")
            time.sleep(poll_s)

    # --- outputs -------------------------------------------------------------------------------
    def log_paths(self, rank: int = 0) -> tuple[Path, Path]:
        from submitit.core.utils import JobPaths

        paths = JobPaths(self.submitit_folder, job_id=self.job_id, task_id=rank)
        return paths.stdout, paths.stderr

    def log_tail(self, n: int = 20, rank: int = 0) -> str:
        """Last `n` lines of the rank's stdout and stderr (submitit's per-task log files)."""
        chunks = []
        for path in self.log_paths(rank):
            text = path.read_text(errors="replace") if path.is_file() else "(no file yet)"
            chunks.append(f"==> {path} <==\n" + "\n".join(text.splitlines()[-n:]))
        return "\n".join(chunks)

    def metrics(self):
        """The run's metrics.jsonl as a DataFrame, one row per step (the last entry of a step wins,
        so a resumed run that re-logged steps shows one continuous curve); before the first
        step is logged, an empty frame. `workbench.track.read_metrics` is the reader."""
        from workbench.track.metrics import read_metrics  # pandas: only when asked

        return read_metrics(self.folder, missing_ok=True)

    def result(self, timeout: float | None = None) -> object:
        """Wait, then return rank 0's return value (the trainer's result dict)."""
        state = self.wait(timeout)
        path = self.result_file
        if state != "COMPLETED" or not path.is_file():
            raise JobFailedError(f"job {self.job_id} ended {state} without a result in {path}\n"
                                 f"{self.log_tail(30)}")
        return json.loads(path.read_text())["result"]

    def cancel(self, grace_s: float = 10.0, timeout_s: float = 60.0) -> str:
        """Stop the job; returns its state afterwards.

        Slurm: `scancel`, then the state as Slurm reports it (CANCELLED once accounting has it).
        Local: submitit's controller turns SIGINT into stopping its tasks, but a process started
        with SIGINT ignored (any background job of a non-interactive shell) keeps ignoring it, and
        the tasks ignore the SIGTERM it forwards. So: SIGINT to the controller and SIGTERM to the
        tasks, up to `grace_s` to exit, then SIGKILL to the tasks (and their children) and the
        controller; LaunchError if anything is still alive after `timeout_s`."""
        if self.executor == "slurm":
            _run(["scancel", self.job_id])
            return self.state
        self._record["cancelled"] = True
        self._save()
        pid, token = int(self.job_id), self._record.get("process_token")
        if not _pid_running(pid, token):  # finished, or the pid is another process's by now
            return self.state
        tasks = _descendants(pid)
        _signal([pid], signal.SIGINT)
        _signal(tasks, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and (_pid_running(pid, token)
                                          or any(_pid_running(t) for t in tasks)):
            time.sleep(0.1)
        end = time.monotonic() + timeout_s
        while _pid_running(pid, token) or any(_pid_running(t) for t in tasks):
            if time.monotonic() > end:
                raise LaunchError(f"local job {self.job_id} is still alive {timeout_s}s after "
                                  f"SIGKILL\n{self.log_tail(10)}")
            tasks = sorted(set(tasks) | set(_descendants(pid) if _pid_running(pid, token) else []))
            _signal([t for t in tasks if _pid_running(t)], signal.SIGKILL)
            if _pid_running(pid, token):
                _signal([pid], signal.SIGKILL)
            time.sleep(0.1)
        if self._job is not None:  # reap our own child, so it does not linger as a zombie
            proc = getattr(self._job, "_process", None)
            if proc is not None:
                proc.poll()
        return self.state

    def interrupt(self) -> None:
        """Simulate preemption: the job checkpoints at the next step boundary, requeues itself and
        resumes (see workbench.launch.job)."""
        if self.executor == "slurm":
            # What submitit's SlurmJob._interrupt() sends: SIGTERM (ignored by submitit) then USR2.
            _run(["scancel", self.job_id, "--signal", "SIGTERM"])
            _run(["scancel", self.job_id, "--signal", "USR2"])
            return
        # submitit's LocalJob._interrupt() signals its controller, which has no USR2 handler and
        # dies; the tasks (the controller's children) are the ones that must get it.
        pid = int(self.job_id)
        tasks = _children(pid) if _pid_running(pid, self._record.get("process_token")) else []
        if not tasks:
            raise LaunchError(f"local job {self.job_id} has no running tasks to interrupt")
        for pid in tasks:
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def latest_attempt(folder: str | Path) -> JobHandle | None:
    """The newest job submitted into the run folder (None: none was)."""
    found = JobHandle.attempts(folder)
    return found[-1] if found else None
