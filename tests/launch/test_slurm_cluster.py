"""The local two-node Slurm cluster is real: nodes, accounting, idempotent start."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

CLUSTER_SCRIPT = Path(__file__).resolve().parents[2] / "jobs" / "slurm" / "local-cluster.sh"

pytestmark = pytest.mark.slurm


def _run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout


def test_two_nodes_up_with_accounting(slurm_cluster):
    assert slurm_cluster.startswith("local-cluster: ready")
    states = dict(line.split() for line in _run("sinfo", "-h", "-N", "-o", "%N %t").splitlines())
    assert set(states) == {"n1", "n2"}
    assert all(s in {"idle", "mix", "alloc"} for s in states.values()), states
    cpus = dict(line.split() for line in _run("sinfo", "-h", "-N", "-o", "%N %c").splitlines())
    # Declared through config_overrides: more CPUs than the machine has.
    assert cpus == {"n1": "8", "n2": "8"}
    # sacct answers from slurmdbd (it exits non-zero when accounting is down).
    _run("sacct", "-n", "-X", "-S", "now-1hours", "-o", "JobID,State")
    clusters = _run("sacctmgr", "-n", "-P", "list", "cluster", "format=Cluster").split()
    assert "workbench" in clusters


def test_second_start_is_a_quick_no_op(slurm_cluster):
    ctld = _run("scontrol", "ping")
    t = time.monotonic()
    out = subprocess.run([str(CLUSTER_SCRIPT)], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().startswith("local-cluster: ready")
    assert time.monotonic() - t < 10
    assert "UP" in ctld and "UP" in _run("scontrol", "ping")


def test_scripts_refuse_non_root_with_a_clear_message():
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    for script in (CLUSTER_SCRIPT, CLUSTER_SCRIPT.with_name("stop-local-cluster.sh")):
        out = subprocess.run(["runuser", "-u", "nobody", "--", str(script)], capture_output=True,
                             text=True, timeout=30, check=False)
        assert out.returncode != 0
        assert "must run as root" in out.stderr
