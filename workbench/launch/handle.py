"""Job handles for notebooks: fresh state, logs, live metrics, result, cancel, re-attach.

Everything a handle needs is persisted as JSON in the run folder (`launch.json`) and in a small
index (`~/.cache/workbench/launch/jobs/<job_id>.json`, or `$WORKBENCH_LAUNCH_INDEX`), so a new
kernel re-attaches with `JobHandle.attach(folder_or_job_id)`; nothing of ours is pickled.
State is read fresh on every access (sacct, falling back to squeue while accounting lags), never
from submitit's watcher cache, which keeps a finished state forever and polls only every 10 min.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from .spec import LaunchSpec

LAUNCH_FILE = "launch.json"
RESULT_FILE = "job_result.json"
FORMAT = "workbench.launch/1"
# States after which a job never runs again (a requeued job shows REQUEUED/PENDING instead).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                      "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})


class LaunchError(RuntimeError):
    """A job could not be found, queried, or did not produce a result."""


class JobFailedError(LaunchError):
    """The job ended in a state other than COMPLETED."""


def index_dir() -> Path:
    env = os.environ.get("WORKBENCH_LAUNCH_INDEX")
    return Path(env) if env else Path.home() / ".cache" / "workbench" / "launch" / "jobs"


def write_json_atomic(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


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


def slurm_state(job_id: str) -> str:
    """Fresh Slurm state of one job (or array element `123_4`), e.g. 'RUNNING', 'CANCELLED'."""
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"])
    for line in out.splitlines():
        jid, _, state = line.partition("|")
        if jid.strip() == job_id and state:
            return state.split()[0]  # "CANCELLED by 0" -> "CANCELLED"
    # Accounting can lag a second or two behind the controller right after submission.
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    states = out.split()
    return states[0] if states else "UNKNOWN"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited child of this very process is a zombie until reaped: not running
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


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

    # --- persistence ---------------------------------------------------------------------------
    def _save(self) -> None:
        write_json_atomic(self.folder / LAUNCH_FILE, self._record)
        write_json_atomic(index_dir() / f"{self.job_id}.json",
                          {"folder": str(self.folder.resolve())})

    @classmethod
    def attach(cls, folder_or_id: str | Path) -> JobHandle:
        """Re-attach from a new kernel by run folder or job id (e.g. '4242' or '4242_3')."""
        p = Path(folder_or_id)
        if not (p / LAUNCH_FILE).is_file():
            entry = index_dir() / f"{folder_or_id}.json"
            if not entry.is_file():
                raise LaunchError(f"no run folder with {LAUNCH_FILE} at {str(p)!r} and no job "
                                  f"{str(folder_or_id)!r} in the launch index {index_dir()}")
            p = Path(json.loads(entry.read_text())["folder"])
        try:
            record = json.loads((p / LAUNCH_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LaunchError(f"cannot read {p / LAUNCH_FILE}: {e}") from e
        if record.get("format") != FORMAT:
            raise LaunchError(f"{p / LAUNCH_FILE}: format {record.get('format')!r}, "
                              f"expected {FORMAT!r}")
        return cls(p, record)

    # --- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """Fresh state, Slurm names: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ..."""
        if self.executor == "slurm":
            return slurm_state(self.job_id)
        if _pid_running(int(self.job_id)):
            return "RUNNING"
        if (self.folder / RESULT_FILE).is_file():
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
        so a resumed run that re-logged steps shows one continuous curve)."""
        from .metrics import read_metrics

        return read_metrics(self.folder)

    def result(self, timeout: float | None = None) -> object:
        """Wait, then return rank 0's return value (the trainer's result dict)."""
        state = self.wait(timeout)
        path = self.folder / RESULT_FILE
        if state != "COMPLETED" or not path.is_file():
            raise JobFailedError(f"job {self.job_id} ended {state} without a result in {path}\n"
                                 f"{self.log_tail(30)}")
        return json.loads(path.read_text())["result"]

    def cancel(self) -> None:
        if self.executor == "slurm":
            _run(["scancel", self.job_id])
        else:
            self._record["cancelled"] = True
            self._save()
            try:  # submitit's local controller turns SIGINT into killing its tasks
                os.kill(int(self.job_id), signal.SIGINT)
            except ProcessLookupError:
                pass

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
        tasks = _children(int(self.job_id))
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
