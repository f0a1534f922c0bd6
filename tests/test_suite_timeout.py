"""The suite's own rule that no test hangs it: pyproject's pytest-timeout setting, exercised.

A hang that never returns to the interpreter (a gloo collective waiting for a dead rank, a
compile stuck in C++) is what once held a CI run until its limit with no name in the log. The
check runs pytest on a test that hangs with SIGALRM blocked (so only a watchdog thread can end
it, not a signal handler), under xdist as `.ci/test.sh` runs it and with SIGINT ignored as in a
background job, using this repository's pytest configuration with only the 15-minute limit
shortened.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANG = '''
import signal, time

def test_hangs_in_native_code():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # as C++ code would: no handler runs
    time.sleep(600)

def test_after_it_still_runs():
    pass
'''


def test_pyproject_limits_every_test():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout_method"] == "thread"
    assert 60 <= int(ini["timeout"]) <= 1800


def test_a_hung_test_is_named_and_the_suite_goes_on(tmp_path):
    text = (ROOT / "pyproject.toml").read_text()
    short, n = re.subn(r"(?m)^timeout = \d+$", "timeout = 3", text)
    assert n == 1, "pyproject.toml has no `timeout = N` line under [tool.pytest.ini_options]"
    (tmp_path / "pyproject.toml").write_text(short)
    (tmp_path / "test_hang.py").write_text(HANG)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "test_hang.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    # the watchdog ends the worker; xdist reports the test by name and starts a new worker
    assert "crashed while running 'test_hang.py::test_hangs_in_native_code'" in out, out[-3000:]
    assert "1 passed" in out, out[-3000:]  # the test after it ran on a fresh worker
