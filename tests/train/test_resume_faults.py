"""Two ranks (gloo, one process each): disk full while checkpointing, damaged checkpoints and
another preset are `CheckpointError`s naming the file on every rank (DCP's own
`CheckpointException` derives from BaseException and used to escape as a traceback per rank),
reported in one line per run, and the fall-back to an older checkpoint is agreed by both ranks."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from conftest import TINY, metrics, one_error_line, rank_processes

from workbench.train.checkpointing import list_complete

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("resume_fault_worker.py")
ARGS = [*TINY, "--recipe", "bf16", "--steps", "8", "--ckpt-every", "4", "--val-every", "0"]


def _two_ranks(args: list[str], extra_env: dict | None = None) -> list[subprocess.CompletedProcess]:
    return rank_processes(WORKER, 2, args, extra_env)


def _assert_one_line_per_run(ps: list[subprocess.CompletedProcess]) -> str:
    return one_error_line(ps, "CheckpointException")


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    """A two-rank run that hits a full disk on its step-8 checkpoint (rank 1's writer)."""
    out = tmp_path_factory.mktemp("ep2") / "run"
    ps = _two_ranks(["cli", *ARGS, "--out", str(out)], {"ENOSPC_STEP": "8", "ENOSPC_RANK": "1"})
    return out, ps


def test_disk_full_while_checkpointing_is_one_line_per_run_and_resumable(ep2_run):
    out, ps = ep2_run
    line = _assert_one_line_per_run(ps)
    assert line.startswith("error: no space left on ") and " while writing " in line, line
    assert ".tmp-step_00000008" in line and ".distcp" in line  # the file the write failed on
    assert "older checkpoints are kept" in line
    assert [f.step for f in list_complete(out)] == [4]  # the older checkpoint is untouched
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the half-written one is gone
    ps = _two_ranks(["cli", *ARGS, "--out", str(out), "--resume"])
    assert all(p.returncode == 0 for p in ps), ps[0].stderr[-3000:] + ps[1].stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'}" in ps[0].stdout
    assert [f.step for f in list_complete(out)] == [4, 8]


def test_damaged_checkpoints_and_another_preset_are_checkpoint_errors(ep2_run):
    out, _ = ep2_run
    ps = _two_ranks(["api", str(out)])
    for p in ps:
        assert p.returncode == 0, p.stderr[-4000:]
        res = {ln.split()[1]: ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")}
        assert set(res) == {"preset-mismatch", "truncated-distcp", "garbled-distcp",
                            "garbage-metadata", "missing-metadata"}, p.stdout
        for case, line in res.items():
            assert line.split()[2] == "CheckpointError", line
            assert f"api-{case}" in line  # names the damaged checkpoint's folder or file
        assert "another preset" in res["preset-mismatch"]
        # read inside dcp.load: DCP's CheckpointException, turned into one line naming the shard
        assert ".distcp" in res["garbled-distcp"] and "CheckpointException" not in p.stdout
        assert "rank " in res["garbled-distcp"]  # which rank(s) read that shard
        assert ".distcp" in res["truncated-distcp"] and "truncated" in res["truncated-distcp"]
        assert ".metadata" in res["garbage-metadata"] and ".metadata" in res["missing-metadata"]


def test_both_ranks_fall_back_past_a_flipped_checkpoint(ep2_run):
    out, _ = ep2_run
    # The disk-full test resumes this run to the end when it ran first on this worker; xdist may
    # have sent it to the other worker (its own copy of the fixture), so finish the run here then.
    if [f.step for f in list_complete(out)] != [4, 8]:
        ps = _two_ranks(["cli", *ARGS, "--out", str(out), "--resume"])
        assert all(p.returncode == 0 for p in ps), ps[0].stderr[-3000:] + ps[1].stderr[-3000:]
    assert [f.step for f in list_complete(out)] == [4, 8]
    before = [(r["step"], r["loss"]) for r in metrics(out)]
    f = sorted((out / "checkpoints" / "step_00000008").glob("*.distcp"))[-1]
    b = bytearray(f.read_bytes())
    b[len(b) // 2:len(b) // 2 + 16] = bytes(16)  # 16 bytes of zeros in the middle of a shard
    f.write_bytes(bytes(b))
    ps = _two_ranks(["cli", *ARGS, "--out", str(out), "--resume"])
    assert all(p.returncode == 0 for p in ps), ps[0].stderr[-3000:] + ps[1].stderr[-3000:]
    assert "fell back to" in ps[0].stdout and "step_00000004" in ps[0].stdout, ps[0].stdout
    assert f.name in ps[0].stdout  # the reason names the shard
    after = [(r["step"], r["loss"]) for r in metrics(out)]
    assert all(math.isfinite(loss) for _, loss in after)
    assert after == before  # steps 5..8 retrained from step 4: the same losses
