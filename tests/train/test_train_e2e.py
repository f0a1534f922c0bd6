"""End-to-end tiny runs: metrics.jsonl content, LR schedule, EP1 == EP2 == EP4, QAT recipes, wandb."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, env, metrics, run

from workbench.train.checkpointing import list_complete
from workbench.train.cli import main
from workbench.train.runfolder import RunFolderError

KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "aux_loss",
        "peak_mem_gib", "fake_quant_share"}


def expected_lr(step: int, peak: float, warmup: int, steps: int, floor: float) -> float:
    # Written from the schedule's definition (linear warmup to the peak, then half a cosine
    # down to peak*floor at the last step), not from the trainer's code.
    if step <= warmup:
        return peak * step / warmup
    t = (step - 1 - warmup) / (steps - warmup)
    return peak * (floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2)


def test_world1_bf16_run_writes_metrics_config_checkpoints(tmp_path):
    out = tmp_path / "run"
    res = main([*TINY, "--recipe", "bf16", "--steps", "12", "--out", str(out), "--val-every", "4",
                "--ckpt-every", "3", "--keep", "2", "--lr", "0.004"])
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        assert KEYS <= set(r), r
        assert ("val_loss" in r) == (r["step"] % 4 == 0)
        assert r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_time_s"])
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["peak_mem_gib"] > 0
        assert r["lr"] == pytest.approx(expected_lr(r["step"], 0.004, 2, 12, 0.1), rel=1e-12)
    # byte-level loss starts near ln(256) and falls on real text
    assert abs(rows[0]["loss"] - math.log(256)) < 0.3
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.8
    assert sorted(f.step for f in list_complete(out)) == [9, 12]  # keep=2
    result = json.loads((out / "result.json").read_text())
    assert result == {k: v for k, v in res.items()} and result["stopped"] is False
    assert result["final_loss"] == rows[-1]["loss"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["steps"], cfg["world_size"], cfg["lr"], cfg["batch"]) == (12, 1, 0.004, 4)


def test_world1_qat_recipes_change_the_loss_a_little(reference_runs):
    bf16 = reference_runs(1, "bf16", 4)
    for recipe in ("mxfp4", "nvfp4"):
        q = reference_runs(1, recipe, 4)
        for a, b in zip(bf16, q):
            assert a["loss"] != b["loss"]  # the fake quantization is really on
            assert abs(a["loss"] - b["loss"]) < 0.05
            assert a["fake_quant_share"] == 0.0  # nothing is fake-quantized in the baseline
            assert 0.0 < b["fake_quant_share"] < 1.0


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, recipe", [(2, "bf16"), (2, "mxfp4"),
                                           pytest.param(4, "mxfp4+mxfp8", marks=pytest.mark.slow),
                                           pytest.param(4, "bf16", marks=pytest.mark.slow),
                                           pytest.param(8, "mxfp4", marks=pytest.mark.slow)])
def test_expert_parallel_matches_world1(reference_runs, nproc, recipe):
    # EP8: tiny has 8 experts, one per rank; the global batch must hold a sequence per rank.
    batch = 8 if nproc == 8 else 4
    ref = reference_runs(1, recipe, 4, batch)
    ep = reference_runs(nproc, recipe, 4, batch)
    assert [r["step"] for r in ep] == [1, 2, 3, 4]
    for a, b in zip(ref, ep):
        # same global batch, experts sharded: equal up to float summation order
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["lr"] == a["lr"]


def test_wandb_offline_history_equals_metrics(tmp_path):
    from workbench.track.offline import find_runs

    out = tmp_path / "run"
    args = [a for a in TINY if a not in ("--wandb", "disabled")]
    run(1, [*args, "--wandb", "offline", "--steps", "3", "--out", str(out), "--run-group", "g1",
            "--ckpt-every", "0", "--val-every", "3"])
    rows = metrics(out)
    runs = find_runs(out / "wandb", group="g1")
    assert len(runs) == 1
    hist = runs[0].history.sort_values("_step")
    assert list(hist["_step"]) == [1, 2, 3]
    assert list(hist["loss"]) == [r["loss"] for r in rows]
    assert hist["val_loss"].iloc[-1] == rows[-1]["val_loss"]
    assert runs[0].config["recipe"] == "bf16" and runs[0].config["world_size"] == 1
    # The final summary reaches the run (it is sent before the run is finished).
    result = json.loads((out / "result.json").read_text())
    assert runs[0].summary["final_loss"] == rows[-1]["loss"] == result["final_loss"]
    assert runs[0].summary["step"] == 3 and runs[0].summary["recipe"] == "bf16"


def test_fresh_start_refuses_a_directory_with_checkpoints(tmp_path):
    out = tmp_path / "run"
    main([*TINY, "--steps", "1", "--out", str(out), "--val-every", "0"])
    with pytest.raises(RunFolderError, match="--resume"):
        main([*TINY, "--steps", "2", "--out", str(out), "--val-every", "0"])


@pytest.mark.distributed
def test_ep2_cli_run_exports_packed_checkpoint(tmp_path):
    from workbench.checkpoint import open_checkpoint

    out = tmp_path / "run"
    run(2, [*TINY, "--recipe", "mxfp4", "--steps", "2", "--out", str(out), "--val-every", "0",
            "--export", "compressed-tensors"])
    result = json.loads((out / "result.json").read_text())
    assert result["export"] == str(out / "export") and result["world_size"] == 2
    shards = sorted(p.name for p in (out / "export").glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    ck = open_checkpoint(out / "export")
    assert ck.layout == "compressed-tensors" and ck.num_experts(0) == 8
    assert not list(tmp_path.glob(".tmp-*")) and not list(out.glob(".tmp-*"))


def test_resumed_run_continues_the_same_wandb_run(tmp_path):
    """The wandb run id drawn on the first start is stored in the run folder and reused on
    --resume: the offline folder holds one run (two segments) whose history is steps 1..4."""
    from workbench.track.offline import find_runs, run_files

    out = tmp_path / "run"
    args = [a for a in TINY if a not in ("--wandb", "disabled")]
    args += ["--wandb", "offline", "--out", str(out), "--ckpt-every", "0", "--val-every", "0"]
    run(1, [*args, "--steps", "2"])
    stored = (out / "wandb_run_id").read_text().strip()
    run(1, [*args, "--steps", "4", "--resume", "--allow-config-change", "steps"])
    assert (out / "wandb_run_id").read_text().strip() == stored
    assert len(run_files(out / "wandb")) == 2  # one segment per attempt
    runs = find_runs(out / "wandb")
    assert [r.id for r in runs] == [stored]
    hist = runs[0].history.sort_values("_step")
    assert list(hist["_step"]) == [1, 2, 3, 4]
    assert list(hist["loss"]) == [r["loss"] for r in metrics(out)]


def test_fresh_start_keeps_the_stored_wandb_run_id(tmp_path):
    """A refused fresh start (checkpoints present) leaves config.json and the run id alone."""
    out = tmp_path / "run"
    main([*TINY, "--steps", "1", "--out", str(out), "--val-every", "0"])
    stored = (out / "wandb_run_id").read_text()
    config = (out / "config.json").read_text()
    with pytest.raises(RunFolderError, match="--resume"):
        main([*TINY, "--steps", "2", "--out", str(out), "--val-every", "0", "--seed", "5"])
    assert (out / "wandb_run_id").read_text() == stored
    assert (out / "config.json").read_text() == config


@pytest.mark.distributed
def test_peak_mem_is_the_max_over_ranks(tmp_path):
    """Rank 1 holds a 768 MiB ballast: the peak both ranks log is rank 1's, above rank 0's own."""
    worker = Path(__file__).with_name("peak_mem_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", str(worker), str(tmp_path / "run"),
                        str(tmp_path / "report")], env=env(), cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    r0, r1 = (json.loads((tmp_path / f"report.{r}.json").read_text()) for r in (0, 1))
    assert r0["logged"] == r1["logged"]
    assert r1["own_before"] <= r0["logged"] <= max(r0["own_after"], r1["own_after"])
    assert r0["logged"] > r0["own_after"] + 0.5  # rank 0 alone would log its own, smaller peak
