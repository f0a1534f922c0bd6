"""FSDP2 alongside expert parallelism (workbench.train.fsdp): layouts, losses, resharding resume.

Oracle for the losses: the EP1 run (one process, no FSDP) on the same global batches. Another
layout trains the same function of the same data; what differs is only the order of float
sums: the mean over ranks of per-rank mean losses instead of one mean, gradients summed by a
reduce-scatter or all-reduce instead of one backward, the grad norm summed from shards. In fp32
that moves the 4-step tiny losses and grad norms by ~1e-8 relative (seen at world 2 and 4), so
1e-5 relative (the tolerance the EP tests of test_train_e2e.py use) leaves room for a noisy
kernel and still fails on the semantic errors it guards, measured by mutating the code at EP2 x
FSDP2 (world 4): an expert gradient factor of 1/dp instead of 1/W puts step 1's `grad_norm` 0.3%
high (AdamW and clipping hide it from the loss: step 3 moves by 2e-7, which is why `grad_norm`
is compared too); a grad norm that sums only this rank's FSDP shards is 43% low at step 1 and,
through clipping, moves the step-3 loss by 5e-4.

Resume at the same layout must be bitwise (==), as in test_resume.py. Resume at another layout
continues the run with losses within the same 1e-5 of the uninterrupted run: the checkpoint
holds the same global tensors at every layout, only the summation order changes after it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, env, metrics, run

from workbench.model import preset
from workbench.train.args import config_from_args, trainer_argv
from workbench.train.build import build_model
from workbench.train.config import TrainConfig, tiny
from workbench.train.distributed import DistInfo, Layout
from workbench.train.memory import rank_memory
from workbench.train.resume_config import ResumeConfigError, check_resume_config

STEPS = 4
BASE = [*TINY, "--recipe", "bf16", "--steps", str(STEPS), "--val-every", "0"]
REL = 1e-5  # see the module docstring


def _close(ref: list[dict], got: list[dict], keys=("loss", "grad_norm", "aux_loss")) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=REL), (a["step"], k, a[k], b[k])


def _layout_run(tmp_path: Path, nproc: int, flags: list[str], recipe: str = "bf16") -> list[dict]:
    out = tmp_path / f"w{nproc}_{recipe}_{'_'.join(f.strip('-') for f in flags)}"
    run(nproc, [*BASE, "--recipe", recipe, "--out", str(out), "--ckpt-every", "0", *flags])
    return metrics(out)


# ---------------------------------------------------------------------------------------------
# Layout configuration: errors, CLI round trip, resume rules (no processes).


def test_layout_errors_name_the_field(tmp_path):
    cfg = tiny(str(tmp_path), batch=8)
    with pytest.raises(ValueError, match=r"TrainConfig\.ep.*does not divide the world size 4"):
        cfg.replace(ep=3, fsdp=True).check_world(4)
    with pytest.raises(ValueError, match=r"--ep 2.*< world size 4 needs --fsdp"):
        cfg.replace(ep=2).check_world(4)
    cfg.replace(ep=2, fsdp=True).check_world(4)  # EP2 x FSDP2
    cfg.replace(fsdp=True).check_world(4)  # EP4 (+FSDP over dp = 1)
    cfg.check_world(4)  # today's layout: EP = world, no FSDP
    with pytest.raises(ValueError, match=r"TrainConfig\.ep must be a positive int"):
        cfg.replace(ep=0)
    with pytest.raises(ValueError, match=r"TrainConfig\.fsdp must be a bool"):
        cfg.replace(fsdp=1)


def test_experts_that_do_not_split_over_ep_are_refused(tmp_path):
    import torch

    cfg = tiny(str(tmp_path), ep=3)  # the tiny preset has 8 experts
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, False)
    with pytest.raises(ValueError, match=r"8 experts, which do not split over EP size 3 "
                                         r"\(TrainConfig\.ep\)"):
        build_model(cfg, info, layout=Layout(3, 1, False, None, None))


def test_trainer_argv_round_trips_the_layout(tmp_path):
    for kw in ({}, {"ep": 2, "fsdp": True}, {"fsdp": True}):
        cfg = tiny(str(tmp_path), **kw)
        argv = trainer_argv(cfg)
        assert config_from_args(argv) == cfg
        assert ("--fsdp" in argv) == cfg.fsdp
        assert (f"--ep={cfg.ep}" in argv) == (cfg.ep is not None)


def _fake_checkpoint(out: Path, cfg: TrainConfig) -> None:
    """A COMPLETE marker recording `cfg`: all check_resume_config reads."""
    from workbench.train.resume_config import checkpoint_meta

    d = out / "checkpoints" / "step_00000002"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 4, **checkpoint_meta(cfg)}))


def test_resume_may_change_the_layout_but_not_the_run(tmp_path):
    saved = tiny(str(tmp_path), ep=2, fsdp=True, resume=True)
    _fake_checkpoint(tmp_path, saved)
    check_resume_config(saved.replace(ep=None, fsdp=False))  # EP2 x FSDP2 -> EP = world
    check_resume_config(saved.replace(ep=1))
    for change in ({"seed": 1}, {"batch": 4}, {"recipe": "mxfp4"}, {"preset": "small"}):
        with pytest.raises(ResumeConfigError, match=next(iter(change))):
            check_resume_config(saved.replace(ep=None, fsdp=False, **change))


# ---------------------------------------------------------------------------------------------
# World 2 (the machine is slow: these first).


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [["--ep", "1", "--fsdp"], ["--fsdp"]],
                         ids=["ep1xfsdp2", "ep2+fsdp"])
def test_world2_fsdp_layouts_match_ep1(tmp_path, reference_runs, flags):
    got = _layout_run(tmp_path, 2, flags)
    _close(reference_runs(1, "bf16", STEPS), got)
    # What a rank holds is the planner's sharded layout, to the byte: dense parameters over
    # both ranks, experts over EP x dp (fp32 masters, grads, AdamW m and v; nothing else).
    ep = 1 if "--ep" in flags else 2
    want = rank_memory(preset("tiny"), world=2, ep=ep, fsdp=2 // ep, batch=4, seq=32,
                       device="cpu", sharded=True)
    assert (got[0]["mem_masters_bytes"], got[0]["mem_grads_bytes"],
            got[0]["mem_optimizer_bytes"]) == (want.masters, want.grads, want.optimizer)
    replicated = rank_memory(preset("tiny"), world=2, ep=2, batch=4, seq=32, device="cpu")
    assert want.masters < replicated.masters  # the check can tell the layouts apart


@pytest.mark.distributed
def test_world2_fsdp_nvfp4_matches_ep1(tmp_path, reference_runs):
    """NVFP4 (one amax per expert) under EP1 x FSDP2: the experts are split between the two ranks,
    so a quantizer that saw only a shard would change the loss from step 1 on, where the weights
    are still the same: there only summation order differs (1e-6). After an update, weights that
    differ by float rounding (~1e-7) can sit on either side of an FP4 rounding boundary and move
    a weight by a whole FP4 step; seen: 1.3e-5 relative at step 3, so later steps get 1e-4."""
    ref = reference_runs(1, "nvfp4", STEPS)
    got = _layout_run(tmp_path, 2, ["--ep", "1", "--fsdp"], recipe="nvfp4")
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-6)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_fake_quantized_experts_are_those_of_the_whole_model(tmp_path, recipe):
    out = tmp_path / "fq.json"
    import subprocess

    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", str(Path(__file__).with_name("fsdp_fq_worker.py")),
                        str(out), recipe], env=env(), cwd=REPO, capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert [r["placements"] for r in res] == [["(Shard(dim=1),)"]] * 2  # really split
    assert all(r["equal"] and r["n"] == 6 for r in res), res  # 2 layers x (w1, w3, w2)
    assert all(r["seams_untouched"] for r in res), res  # FSDP re-binds no QAT seam
    if recipe == "nvfp4":  # the comparison can fail: a shard's own amax gives other values
        assert any(r["shard_differs"] for r in res), res


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [["--ep", "1", "--fsdp"], ["--fsdp"]],
                         ids=["ep1xfsdp2", "ep2+fsdp"])
def test_world2_fsdp_resume_at_the_same_layout_is_bitwise(tmp_path, flags):
    out = tmp_path / "run"
    args = [*BASE, "--out", str(out), *flags]
    run(2, [*args, "--ckpt-every", "2"])
    whole = metrics(out)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")  # continue from step 2
    p = run(2, [*args, "--ckpt-every", "0", "--resume"])
    assert "step_00000002" in p.stdout
    resumed = metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(whole, resumed):
        assert (a["loss"], a["grad_norm"], a["lr"], a["aux_loss"]) == \
            (b["loss"], b["grad_norm"], b["lr"], b["aux_loss"])


@pytest.mark.distributed
@pytest.mark.parametrize("save_nproc, save_flags, load_nproc, load_flags", [
    (2, [], 2, ["--ep", "1", "--fsdp"]),  # EP2 -> EP1 x FSDP2
    (2, ["--ep", "1", "--fsdp"], 1, []),  # EP1 x FSDP2 -> one process
    (2, ["--ep", "1", "--fsdp"], 2, []),  # EP1 x FSDP2 -> EP2
], ids=["ep2-to-ep1xfsdp2", "ep1xfsdp2-to-world1", "ep1xfsdp2-to-ep2"])
def test_world2_resume_at_another_layout_continues(tmp_path, reference_runs, save_nproc,
                                                   save_flags, load_nproc, load_flags):
    out = tmp_path / "run"
    args = [*BASE, "--out", str(out)]
    run(save_nproc, [*args, "--ckpt-every", "2", *save_flags])
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    p = run(load_nproc, [*args, "--ckpt-every", "0", "--resume", *load_flags])
    assert "step_00000002" in p.stdout
    _close(reference_runs(1, "bf16", STEPS), metrics(out))


# ---------------------------------------------------------------------------------------------
# World 4: EP2 x FSDP2 and EP4 (+FSDP), the layouts.


@pytest.mark.distributed
@pytest.mark.parametrize("flags", [["--ep", "2", "--fsdp"], ["--fsdp"]],
                         ids=["ep2xfsdp2", "ep4+fsdp"])
def test_world4_fsdp_layouts_match_ep1(tmp_path, reference_runs, flags):
    _close(reference_runs(1, "bf16", STEPS), _layout_run(tmp_path, 4, flags))


@pytest.mark.distributed
def test_world4_resume_ep2xfsdp2_bitwise_then_at_ep4(tmp_path, reference_runs):
    out = tmp_path / "run"
    args = [*BASE, "--out", str(out)]
    run(4, [*args, "--ckpt-every", "2", "--ep", "2", "--fsdp"])
    whole = metrics(out)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    run(4, [*args, "--ckpt-every", "0", "--resume", "--ep", "2", "--fsdp"])
    assert [(r["loss"], r["grad_norm"]) for r in metrics(out)] == \
        [(r["loss"], r["grad_norm"]) for r in whole]
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")  # again from step 2, at EP4
    run(4, [*args, "--ckpt-every", "0", "--resume"])
    _close(reference_runs(1, "bf16", STEPS), metrics(out))


# ---------------------------------------------------------------------------------------------
# World 1 with --fsdp (the H200 job's layout) and the launch check.


def test_world1_fsdp_trains_like_ep1_and_resumes_bitwise(tmp_path, reference_runs):
    """--fsdp in one process makes a one-rank group; the run is EP1's, and its checkpoint (FSDP
    DTensors saved without a process group) resumes bit for bit."""
    out = tmp_path / "run"
    args = [*BASE, "--out", str(out), "--fsdp"]
    run(1, [*args, "--ckpt-every", "2"])
    whole = metrics(out)
    _close(reference_runs(1, "bf16", STEPS), whole)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    run(1, [*args, "--ckpt-every", "0", "--resume"])
    assert [(r["loss"], r["grad_norm"]) for r in metrics(out)] == \
        [(r["loss"], r["grad_norm"]) for r in whole]


def test_launch_check_plans_fsdp_layouts_as_sharded():
    from workbench.launch import LaunchSpec
    from workbench.launch.fits import plan_for

    kw = {"preset": "qwen3_30b_a3b_like", "recipe": "mxfp4", "executor": "slurm", "batch": 8,
          "seq": 512}
    ep_only = plan_for(LaunchSpec.build(ep=2, gpus_per_node=2, **kw))
    fsdp = plan_for(LaunchSpec.build(ep=1, dp=2, fsdp=True, gpus_per_node=2, **kw))
    ep2_fsdp = plan_for(LaunchSpec.build(ep=2, fsdp=True, gpus_per_node=2, **kw))
    assert (ep_only.layout.sharded, fsdp.layout.sharded, ep2_fsdp.layout.sharded) == \
        (False, True, True)
    assert (fsdp.layout.ep, fsdp.layout.fsdp) == (1, 2)
    # Dense parameters sharded over both ranks: fewer master bytes than the replicated layout.
    assert ep2_fsdp.memory.masters < ep_only.memory.masters
    assert "(EP2 +FSDP)" in str(ep2_fsdp) and "(EP1 x FSDP2)" in str(fsdp)
    assert "not in the trainer" not in str(fsdp)
