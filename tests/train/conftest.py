"""Helpers for the trainer tests: run jobs/qat.py in-process, as a subprocess, or under torchrun."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
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


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_processes(worker: Path, n: int, args: list[str], extra_env: dict | None = None,
                   timeout: float = 400) -> list[subprocess.CompletedProcess]:
    """`worker` in `n` processes, one per rank, wired as torchrun wires them (without its agent,
    so each rank's own exit code and stderr come back); a single process when n is 1.

    Each rank writes to files, not pipes: a rank blocked on a full pipe that nobody reads yet
    would hold the others in their next collective. One deadline covers all ranks."""
    port = free_port()
    procs, logs, late = [], [], []
    with tempfile.TemporaryDirectory(prefix="ranks-") as d:
        try:
            for rank in range(n):
                e = {**env(), **(extra_env or {})}
                if n > 1:
                    e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                out, err = (open(Path(d) / f"{rank}.{k}", "w+") for k in ("out", "err"))
                logs.append((out, err))
                procs.append(subprocess.Popen([sys.executable, str(worker), *args], env=e,
                                              cwd=REPO, stdout=out, stderr=err, text=True))
            deadline = time.monotonic() + timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
        finally:
            late = [i for i, p in enumerate(procs) if p.poll() is None]
            for i in late:
                procs[i].kill()
                procs[i].wait()
        done = []
        for p, (out, err) in zip(procs, logs):
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()))
            out.close(), err.close()
    assert not late, f"ranks {late} still ran after {timeout} s: " + \
        " | ".join(p.stderr[-2000:] for p in done)
    return done


def one_error_line(ps: list[subprocess.CompletedProcess], *never: str) -> str:
    """Every rank exits 2 without a traceback (nor any of `never` in its stderr); one `error:`
    line in all of their stderr, the trainer's ("error: ...") or its command line's, in
    argparse's form ("PROG: error: ...")."""
    for p in ps:
        assert p.returncode == 2, (p.returncode, p.stderr[-4000:])
        for word in ("Traceback", *never):
            assert word not in p.stderr, p.stderr[-4000:]
    lines = [ln for p in ps for ln in p.stderr.splitlines() if re.match(r"(\S+: )?error: ", ln)]
    assert len(lines) == 1, [p.stderr[-2000:] for p in ps]
    return lines[0]


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
