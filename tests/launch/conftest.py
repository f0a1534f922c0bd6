"""Fixtures for the launch tests: the real local Slurm cluster, and an isolated job index."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "jobs" / "slurm" / "local-cluster.sh"
HERE = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """Start (or find running) the two-node local Slurm cluster; returns its ready line.

    Skips with the reason when not root / not Debian, or when the script fails (its output is in
    the skip reason). Set WORKBENCH_REQUIRE_SLURM=1 (as CI does) to turn those skips into failures.
    """
    require = os.environ.get("WORKBENCH_REQUIRE_SLURM") == "1"
    give_up = pytest.fail if require else pytest.skip
    if os.geteuid() != 0:
        give_up(f"the local Slurm cluster needs root "
                f"({CLUSTER_SCRIPT} installs and starts daemons)")
    if not Path("/etc/debian_version").is_file():
        give_up(f"the local Slurm cluster needs Debian ({CLUSTER_SCRIPT} uses apt packages)")
    try:
        proc = subprocess.run([str(CLUSTER_SCRIPT)], capture_output=True, text=True, timeout=900,
                              check=False)
    except subprocess.TimeoutExpired as e:
        give_up(f"{CLUSTER_SCRIPT} did not finish in 900 s:\n{e.stdout}\n{e.stderr}")
    ready = [ln for ln in proc.stdout.splitlines() if ln.startswith("local-cluster: ready")]
    if proc.returncode != 0 or not ready:
        give_up(f"{CLUSTER_SCRIPT} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return ready[-1]


@pytest.fixture(autouse=True)
def launch_index(tmp_path, monkeypatch) -> Path:
    """Keep JobHandle's job-id index inside the test's tmp folder."""
    index = tmp_path / "launch-index"
    monkeypatch.setenv("WORKBENCH_LAUNCH_INDEX", str(index))
    return index


@pytest.fixture
def targets_path() -> tuple[str, ...]:
    """LaunchSpec.pythonpath that lets jobs import tests/launch/launch_targets.py."""
    return (HERE,)
