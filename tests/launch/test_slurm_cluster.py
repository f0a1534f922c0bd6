"""The local two-node Slurm cluster is real: nodes, accounting, idempotent start."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
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
    # completing ("comp"): a job of a test running beside this one is ending on the node
    assert all(s in {"idle", "mix", "alloc", "comp"} for s in states.values()), states
    cpus = dict(line.split() for line in _run("sinfo", "-h", "-N", "-o", "%N %c").splitlines())
    # Declared through config_overrides: more CPUs than the machine has.
    assert cpus == {"n1": "8", "n2": "8"}
    # sacct answers from slurmdbd (it exits non-zero when accounting is down).
    _run("sacct", "-n", "-X", "-S", "now-1hours", "-o", "JobID,State")
    clusters = _run("sacctmgr", "-n", "-P", "list", "cluster", "format=Cluster").split()
    assert "workbench" in clusters


def _daemons(state: Path) -> dict[str, tuple[str, str]]:
    """pid and start time (field 22 of /proc/PID/stat) of each daemon with a pid file."""
    out = {}
    for pidfile in sorted((state / "run").glob("*.pid")):
        pid = pidfile.read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
        out[pidfile.stem] = (pid, stat.rsplit(")", 1)[1].split()[19])
    return out


def test_second_start_is_a_no_op(slurm_cluster):
    """On a healthy cluster the script only checks and prints the ready line: the very same
    daemon processes (pid and start time) serve before and after."""
    state = Path(re.search(r"state=(\S+)", slurm_cluster).group(1))
    before = _daemons(state)
    assert {"slurmctld", "slurmdbd"} <= set(before), before
    out = subprocess.run([str(CLUSTER_SCRIPT)], capture_output=True, text=True, timeout=600,
                         check=True)
    assert out.stdout.strip().startswith("local-cluster: ready")
    assert _daemons(state) == before
    assert "UP" in _run("scontrol", "ping")


def test_scripts_refuse_non_root_with_a_clear_message():
    """Run as `nobody` from a world-readable copy: the clone itself may live where `nobody`
    cannot go (a 0700 folder, /root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to an unprivileged user")
    shared = Path(tempfile.mkdtemp(prefix="wb-nonroot-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        for script in (CLUSTER_SCRIPT, CLUSTER_SCRIPT.with_name("stop-local-cluster.sh")):
            copy = shared / script.name
            shutil.copyfile(script, copy)
            copy.chmod(0o755)
            out = subprocess.run(["runuser", "-u", "nobody", "--", str(copy)],
                                 capture_output=True, text=True, timeout=30, check=False,
                                 cwd="/")
            assert out.returncode != 0
            assert "must run as root" in out.stderr, out.stderr
    finally:
        shutil.rmtree(shared)
