"""Checkpoint/resume: SIGKILL mid-run and mid-checkpoint, resume in a fresh process, bit-exact.

Oracle: an uninterrupted run with the same arguments and no checkpoints at all. The resumed
curve must equal it exactly (==, not approx) at every step, including the steps recomputed after
the last complete checkpoint.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, command, env, free_port, metrics, run

from workbench.train.checkpointing import list_complete

STEPS = 16


def _kill_after(nproc: int, args: list[str], out: Path, step: int, timeout: float = 240) -> None:
    """Start the ranks as plain processes (RANK/WORLD_SIZE/MASTER_* env, the trainer's contract)
    and SIGKILL every one of them once `step` is logged. (Killing a torchrun agent would leave
    its workers running: they live in their own sessions.)"""
    port = free_port()
    procs: list[subprocess.Popen] = []
    for rank in range(nproc):
        e = env()
        if nproc > 1:
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(command(1, args), env=e, cwd=REPO,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait(30)

    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    try:
        while time.monotonic() < deadline:
            if path.is_file() and any(f'"step": {step},' in line
                                      for line in path.read_text().splitlines()):
                kill_all()
                return
            if any(p.poll() is not None for p in procs):
                raise AssertionError(f"a rank ended before step {step}: "
                                     + " | ".join(p.stderr.read()[-2000:] for p in procs
                                                  if p.poll() is not None))
            time.sleep(0.01)
        raise AssertionError(f"step {step} not reached in {timeout} s")
    finally:
        kill_all()


def _assert_same_curve(resumed: list[dict], ref: list[dict]) -> None:
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(ref, resumed):
        assert (a["step"], a["loss"], a["grad_norm"], a["lr"], a["aux_loss"]) == \
            (b["step"], b["loss"], b["grad_norm"], b["lr"], b["aux_loss"])


@pytest.mark.parametrize("nproc, recipe", [(1, "mxfp4"),
                                           pytest.param(2, "mxfp4", marks=pytest.mark.distributed),
                                           pytest.param(2, "bf16", marks=[pytest.mark.distributed,
                                                                          pytest.mark.slow])])
def test_sigkill_then_resume_is_bit_exact(tmp_path, reference_runs, nproc, recipe):
    out = tmp_path / "run"
    args = [*TINY, "--recipe", recipe, "--steps", str(STEPS), "--out", str(out),
            "--ckpt-every", "4", "--val-every", "0", "--keep", "3"]
    _kill_after(nproc, args, out, step=6)
    assert not (out / "result.json").exists(), "the run finished before the kill"
    last = list_complete(out)[-1].step
    assert last in (4, 8)
    assert metrics(out)[-1]["step"] >= 6
    p = run(nproc, [*args, "--resume"])
    assert f"resumed from {out / 'checkpoints' / f'step_{last:08d}'}" in p.stdout
    _assert_same_curve(metrics(out), reference_runs(nproc, recipe, STEPS))


def test_sigkill_inside_checkpoint_write_leaves_no_complete_checkpoint(tmp_path, reference_runs):
    out = tmp_path / "run"
    args = [*TINY, "--recipe", "bf16", "--steps", str(STEPS), "--out", str(out),
            "--ckpt-every", "4", "--val-every", "0"]
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("crash_in_save.py")), *args],
                       env={**env(), "CRASH_STEP": "8"}, cwd=REPO, capture_output=True, text=True,
                       timeout=240, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    root = out / "checkpoints"
    tmp = root / ".tmp-step_00000008"
    assert (tmp / ".metadata").is_file()  # DCP had finished writing ...
    assert not (root / "step_00000008").exists()  # ... but nothing looks complete
    assert [f.step for f in list_complete(out)] == [4]
    r = run(1, [*args, "--resume"])
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    assert not tmp.exists()  # the torn folder is cleaned up by the next save
    _assert_same_curve(metrics(out), reference_runs(1, "bf16", STEPS))


def test_request_stop_checkpoints_and_returns(tmp_path, reference_runs):
    from workbench.train import distributed
    from workbench.train.args import config_from_args
    from workbench.train.cli import main
    from workbench.train.loop import clear_stop, request_stop, train

    out = tmp_path / "run"
    args = [*TINY, "--recipe", "bf16", "--steps", str(STEPS), "--out", str(out),
            "--ckpt-every", "0", "--val-every", "0"]
    cfg = config_from_args(args)
    info = distributed.setup()
    clear_stop()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference subprocess (OMP_NUM_THREADS=1): same reductions
    try:
        res = train(cfg, info, on_step=lambda rec: request_stop() if rec["step"] == 5 else None)
        assert res["stopped"] is True and res["step"] == 5
        assert [f.step for f in list_complete(out)] == [5]
        assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5]
        clear_stop()  # train() leaves the flag set (main clears it once train returns)
        res = main([*args, "--resume"])
    finally:
        torch.set_num_threads(threads)
    assert res["stopped"] is False and res["step"] == STEPS
    _assert_same_curve(metrics(out), reference_runs(1, "bf16", STEPS))


def test_stop_requested_before_main_is_honoured_at_the_first_step_boundary(tmp_path):
    """A launcher's stop that lands while the trainer is still starting up is not lost: main
    checkpoints at the first step boundary (step 0), returns stopped, and clears the flag."""
    from workbench.train import loop
    from workbench.train.cli import main

    out = tmp_path / "run"
    args = [*TINY, "--recipe", "bf16", "--steps", "3", "--out", str(out), "--ckpt-every", "0",
            "--val-every", "0"]
    loop.clear_stop()
    loop.request_stop()
    try:
        res = main(args)
    finally:
        stuck = loop._stop_requested
        loop.clear_stop()
    assert res["stopped"] is True and res["step"] == 0
    assert [f.step for f in list_complete(out)] == [0]
    assert not stuck  # main cleared it after train returned
    res = main([*args, "--resume"])  # the requeued attempt trains from the step-0 checkpoint
    assert res["stopped"] is False and res["step"] == 3
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]


def test_resume_without_checkpoint_starts_fresh_and_truncates_nothing(tmp_path):
    out = tmp_path / "run"
    res = run(1, [*TINY, "--steps", "2", "--out", str(out), "--resume", "--ckpt-every", "0",
                  "--val-every", "0"])
    assert "resumed" not in res.stdout
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_sigterm_checkpoints_at_the_step_boundary(tmp_path):
    """The CLI turns SIGTERM into request_stop(): the run saves a checkpoint and exits 0."""
    out = tmp_path / "run"
    args = [*TINY, "--recipe", "bf16", "--steps", "400", "--out", str(out), "--ckpt-every", "0",
            "--val-every", "0"]
    p = subprocess.Popen(command(1, args), env=env(), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").is_file() and
                   (out / "metrics.jsonl").read_text().count("\n") >= 3):
            assert time.monotonic() < deadline and p.poll() is None, p.stderr
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        assert p.wait(120) == 0, p.stderr.read()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    result = json.loads((out / "result.json").read_text())
    assert result["stopped"] is True and 3 <= result["step"] < 400
    assert [f.step for f in list_complete(out)] == [result["step"]]
    assert metrics(out)[-1]["step"] == result["step"]


@pytest.mark.distributed
def test_checkpoint_from_ep2_resumes_at_ep1(tmp_path):
    """Experts are saved as DTensor shards of one global tensor, so EP1 can continue an EP2 run
    (same global batches; equal to the EP2 curve up to float summation order)."""
    out = tmp_path / "run"
    args = [*TINY, "--recipe", "bf16", "--steps", "8", "--out", str(out), "--val-every", "0"]
    run(2, [*args, "--ckpt-every", "4"])
    ep2 = metrics(out)
    shutil.rmtree(out / "checkpoints" / "step_00000008")  # continue from step 4 at EP1
    p = run(1, [*args, "--ckpt-every", "0", "--resume"])
    assert "step_00000004" in p.stdout
    ep1 = metrics(out)
    assert [r["step"] for r in ep1] == list(range(1, 9))
    for a, b in zip(ep2[4:], ep1[4:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
