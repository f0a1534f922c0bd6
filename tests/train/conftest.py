"""Helpers for the trainer tests: run jobs/qat.py in-process, as a subprocess, or under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QAT = REPO / "jobs" / "qat.py"
# Tiny and quick: 4 sequences of 32 bytes per step (every world size in {1, 2, 4} divides 4).
TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--wandb", "disabled", "--warmup", "2"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1",
             PYTHONPATH=str(REPO) + os.pathsep + e.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)
    return e


def command(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [sys.executable, str(QAT), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(QAT), *args]


def run(nproc: int, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run(command(nproc, args), env=env(), cwd=REPO, capture_output=True, text=True,
                       check=False,
                       timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"{command(nproc, args)} failed ({p.returncode}):\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """Uninterrupted runs, cached per (world size, recipe, steps): the oracles for EP and resume."""
    cache: dict[tuple, list[dict]] = {}

    def get(nproc: int, recipe: str, steps: int, batch: int = 4) -> list[dict]:
        key = (nproc, recipe, steps, batch)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref_w{nproc}_{recipe.replace('+', '_')}_{steps}")
            run(nproc, [*TINY, "--recipe", recipe, "--steps", str(steps), "--out", str(out),
                        "--ckpt-every", "0", "--val-every", "0", "--batch", str(batch)])
            cache[key] = metrics(out)
        return cache[key]

    return get
