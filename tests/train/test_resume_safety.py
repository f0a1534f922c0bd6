"""--resume over a run folder that is not trusted: crafted or damaged checkpoints, another
configuration. Every case runs jobs/qat.py as a user would (one process; the two-rank cases
are in test_resume_faults.py).

Oracle for the fall-back cases: the uninterrupted run that wrote the checkpoints. Resumed from
its step-4 checkpoint, steps 5..8 must repeat that run's losses exactly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, TINY, command, env, metrics

from workbench.train.checkpointing import COMPLETE

ARGS = [*TINY, "--recipe", "bf16", "--steps", "8", "--ckpt-every", "4", "--val-every", "0",
        "--keep", "2"]


def _qat(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command(1, args), env=env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    p = _qat([*ARGS, "--out", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture
def run_dir(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def _ck(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"


def _set_file(ck: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file AND its digest in COMPLETE, as someone who can write the
    folder would: the digests catch accidents, the allow-listed reader catches intent."""
    (ck / name).write_bytes(data)
    meta = json.loads((ck / COMPLETE).read_text())
    if "files" in meta:  # (a marker without digests has nothing to update)
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / COMPLETE).write_text(json.dumps(meta))


class _Touch:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _curve(out: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"], r["aux_loss"]) for r in metrics(out)]


def _one_line_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr and "CheckpointException" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_crafted_metadata_is_refused_and_the_older_checkpoint_used(run_dir, base_run):
    pwned = run_dir.parent / "pwned"
    _set_file(_ck(run_dir, 8), ".metadata", pickle.dumps(_Touch(pwned)))
    p = _qat([*ARGS, "--out", str(run_dir), "--resume"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert not pwned.exists(), "--resume ran code from the run folder"
    assert "skipping an unusable checkpoint" in p.stdout and ".metadata" in p.stdout
    assert "refused" in p.stdout and "system" in p.stdout  # the global it refused
    assert f"resumed from {_ck(run_dir, 4)}" in p.stdout
    assert _curve(run_dir) == _curve(base_run)


def test_all_checkpoints_crafted_is_one_line_and_exit_2(run_dir):
    pwned = run_dir.parent / "pwned"
    for step in (4, 8):
        _set_file(_ck(run_dir, step), ".metadata", pickle.dumps(_Touch(pwned)))
    result = (run_dir / "result.json").read_bytes()
    p = _qat([*ARGS, "--out", str(run_dir), "--resume"])
    line = _one_line_error(p)
    assert not pwned.exists()
    assert str(_ck(run_dir, 8) / ".metadata") in line and str(_ck(run_dir, 4) / ".metadata") in line
    assert (run_dir / "result.json").read_bytes() == result  # it did not train


def _flip(ck: Path) -> None:
    f = next(ck.glob("*.distcp"))
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
    f.write_bytes(bytes(b))


def _truncate(ck: Path) -> None:
    f = next(ck.glob("*.distcp"))
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 3)


@pytest.mark.parametrize("damage", ["flip-16-bytes", "truncate-distcp", "delete-metadata",
                                    "garbage-metadata", "truncate-without-digests"])
def test_damaged_newest_checkpoint_falls_back_and_the_good_one_is_kept(run_dir, base_run,
                                                                        damage):
    ck8 = _ck(run_dir, 8)
    if damage == "flip-16-bytes":
        _flip(ck8)
    elif damage == "truncate-distcp":
        _truncate(ck8)
    elif damage == "delete-metadata":
        (ck8 / ".metadata").unlink()
    elif damage == "truncate-without-digests":  # a marker from before digests: DCP's load fails
        meta = json.loads((ck8 / COMPLETE).read_text())
        del meta["files"]
        (ck8 / COMPLETE).write_text(json.dumps(meta))
        _truncate(ck8)
    else:
        (ck8 / ".metadata").write_bytes(os.urandom(2000))
    # --ckpt-every 2 (bookkeeping: no flag needed) writes steps 6 and 8; keep=2 would prune 4
    p = _qat([*ARGS, "--out", str(run_dir), "--resume", "--ckpt-every", "2"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipping an unusable checkpoint" in p.stdout, p.stdout
    assert str(ck8) in p.stdout  # the reason names the damaged folder's file
    assert f"fell back to {_ck(run_dir, 4)}" in p.stdout
    resumed = metrics(run_dir)
    assert all(math.isfinite(r["loss"]) for r in resumed)
    assert _curve(run_dir) == _curve(base_run)  # the same training as the undamaged run
    steps = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert steps == [4, 6, 8]  # 4, the checkpoint it resumed from, survives keep=2


def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flag, value, field, old", [
    ("--recipe", "mxfp4", "recipe", "'bf16'"), ("--preset", "small", "preset", "'tiny'"),
    ("--seed", "1", "seed", "0"), ("--batch", "8", "batch", "4"),
])
def test_another_configuration_is_refused_before_the_folder_is_touched(run_dir, flag, value,
                                                                        field, old):
    before = _snapshot(run_dir)
    p = _qat([*ARGS, "--out", str(run_dir), "--resume", flag, value])
    line = _one_line_error(p)
    new = repr(value) if field in ("recipe", "preset") else value
    assert f"{field}: checkpoint step_00000008 has {old}, this run asks for {new}" in line, line
    assert _snapshot(run_dir) == before


def test_a_safe_change_needs_the_flag(run_dir):
    before = _snapshot(run_dir)
    longer = [*ARGS, "--out", str(run_dir), "--resume", "--steps", "10", "--lr", "0.001"]
    line = _one_line_error(_qat(longer))
    assert "steps: checkpoint step_00000008 has 8, this run asks for 10" in line
    assert "lr: checkpoint step_00000008 has 0.003, this run asks for 0.001" in line
    assert "--allow-config-change lr,steps" in line
    assert _snapshot(run_dir) == before
    p = _qat([*longer, "--allow-config-change", "steps,lr"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 11))
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 0.001
    # fields that define the run cannot be allowed
    p = _qat([*longer, "--allow-config-change", "preset"])
    assert p.returncode == 2 and "only steps, lr" in p.stderr, p.stderr
