"""Real wandb offline runs, written once per session by a subprocess (see track_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from track_runs import (
    attempt_runs,
    big_run,
    exact_run,
    group_runs,
    judge_run,
    resume_runs,
    write_runs,
)


@pytest.fixture(scope="session")
def wandb_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wandb_runs")
    runs = [exact_run(), big_run(), *resume_runs(), *attempt_runs(), judge_run(), *group_runs()]
    return write_runs(tmp, runs)
