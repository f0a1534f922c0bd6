"""The suite's own rule that no test hangs it: pyproject's pytest-timeout setting, exercised.

A hang that never returns to the interpreter (a gloo collective waiting for a dead rank, a
compile stuck in C++) is what once held a CI run until its limit with no name in the log. The
check runs pytest on a test that hangs with SIGALRM blocked (so only a watchdog thread can end
it, not a signal handler), under xdist as `.ci/test.sh` runs it and with SIGINT ignored as in a
background job, using this repository's pytest configuration with only the 15-minute limit
shortened.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANG = '''
import signal, time

def test_hangs_in_native_code():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as C++ code would: no handler runs
    waits_for_a_dead_rank()


def waits_for_a_dead_rank():
    time.sleep(600)

def test_after_it_still_runs():
    pass
'''


def test_pyproject_limits_every_test():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout_method"] == "thread"
    assert 60 <= int(ini["timeout"]) <= 1800


def ci_dist_mode() -> str:
    """The xdist scheduling `.ci/test.sh` runs the suite with."""
    code = [ln for ln in (ROOT / ".ci" / "test.sh").read_text().splitlines()
            if not ln.lstrip().startswith("#")]
    found = re.findall(r"--dist[ =](\S+)", "\n".join(code))
    assert len(found) == 1, ".ci/test.sh should pass one --dist"
    return found[0]


def _pytest(tmp_path, tests: str, timeout: int, extra_env: dict | None = None):
    """This repository's pytest configuration and suite-wide conftest on `tests`, under xdist as
    `.ci/test.sh` runs it and with SIGINT ignored as in a background job; only the per-test
    limit changed."""
    text = (ROOT / "pyproject.toml").read_text()
    short, n = re.subn(r"(?m)^timeout = \d+$", f"timeout = {timeout}", text)
    assert n == 1, "pyproject.toml has no `timeout = N` line under [tool.pytest.ini_options]"
    (tmp_path / "pyproject.toml").write_text(short)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_it.py").write_text(tests)
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORKBENCH_TEST_STACKS", "WORKBENCH_SUITE_LIMIT_S")}
    (tmp_path / "tmp").mkdir()
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the conftest keeps the workers' stacks
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "--dist", ci_dist_mode(), "-p",
         "no:cacheprovider", "test_it.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**env, **(extra_env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    return proc, proc.stdout + proc.stderr, time.monotonic() - start


def test_a_hung_test_is_named_with_its_stack_and_the_suite_goes_on(tmp_path):
    proc, out, _ = _pytest(tmp_path, HANG, timeout=3)
    assert proc.returncode == 1, out[-3000:]
    # the watchdog ends the worker; xdist reports the test by name and starts a new worker
    assert "crashed while running 'test_it.py::test_hangs_in_native_code'" in out, out[-3000:]
    assert "1 passed" in out, out[-3000:]  # the test after it ran on a fresh worker
    # ... and the conftest said so at once, with where it hung, before the run went on
    said = out.find("died running test_it.py::test_hangs_in_native_code")
    assert 0 <= said < out.find("replacing crashed worker"), out[-3000:]
    assert re.search(r"test_it\.py\", line \d+ in waits_for_a_dead_rank", out[said:]), out[-3000:]
    assert not list((tmp_path / "tmp").glob("pytest-stacks-*"))  # removed at the end


SLOW = '''
import time

def test_quick():
    pass

def test_takes_all_night():
    time.sleep(600)
'''


def test_the_suite_limit_names_what_still_runs_and_ends_with_a_summary(tmp_path):
    # 45 s: on a loaded machine the worker alone took 16 s to start, and a 6 s limit ended the
    # run before any test ran; the run still ends far before the test's 600 s or the 300 s limit
    proc, out, took = _pytest(tmp_path, SLOW, timeout=300,
                              extra_env={"WORKBENCH_SUITE_LIMIT_S": "45"})
    assert proc.returncode == 2, out[-3000:]  # pytest's "interrupted"
    assert took < 150, out[-3000:]
    assert re.search(r"suite stopped by SIGTERM; tests still running: "
                     r"test_it\.py::test_takes_all_night \(\d+ s\)", out), out[-3000:]
    assert "1 passed" in out, out[-3000:]  # the summary was printed


FORKS = re.compile(r"""start_method\s*=\s*["']fork["']|get_context\(\s*["']fork["']|os\.fork\(""")


def test_no_test_forks_the_pytest_worker():
    """A fork of the worker (pytest-timeout's watchdog, execnet's reader, torch's pools are
    threads) can leave the child waiting on a lock that no thread of it will ever release: the
    hang this file's limit would then have to end."""
    here = Path(__file__).resolve()
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}"
             for p in sorted((ROOT / "tests").rglob("*.py")) if p != here
             for text in [p.read_text()] for m in FORKS.finditer(text)]
    assert not found, found
