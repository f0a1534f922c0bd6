"""A NaN/Inf loss or gradient never trains on silently: the trainer stops before the optimizer
step (exit 2, the step and the last good checkpoint named, nothing exported) or, when asked,
skips a bounded number of such steps and counts them; --init refuses non-finite weights."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, TINY, command, env
from realdata import write_checkpoint
from safetensors.torch import load_file, save_file

from workbench.train import distributed
from workbench.train import loop as loop_mod
from workbench.train.config import tiny as tiny_config
from workbench.train.loop import NonFiniteStep, train


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_nan_gradient_stops_the_run_with_exit_2_and_no_export(tmp_path):
    out = tmp_path / "run"
    # an absurd learning rate: step 1 is finite, its update makes the next forward overflow
    args = [*TINY, "--recipe", "bf16", "--steps", "6", "--val-every", "0", "--ckpt-every", "1",
            "--lr", "1e30", "--warmup", "0", "--export", "bf16", "--out", str(out)]
    p = subprocess.run(command(1, args), env=env(), cwd=REPO, capture_output=True, text=True,
                       timeout=600, check=False)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert "Traceback" not in p.stderr
    rows = _rows(out)
    bad = rows[-1]
    assert bad["nonfinite"] is True and bad["step"] >= 2
    assert not (math.isfinite(bad["loss"] or math.nan) and
                math.isfinite(bad["grad_norm"] or math.nan))
    assert all(r.get("nonfinite") is None for r in rows[:-1])
    good = f"step_{bad['step'] - 1:08d}"
    assert re.search(rf"step {bad['step']}: non-finite", line) and good in line
    assert (out / "checkpoints" / good).is_dir()
    assert not (out / "export").exists() and not (out / "result.json").exists()


def _run_with_nan_norm_at(tmp_path, nan_steps: set[int], skips: int):
    """An in-process tiny run whose gradient norm is NaN at `nan_steps`; counts opt.step()."""
    calls = {"norm": 0, "opt": 0}
    real_norm, real_build = loop_mod.global_grad_norm, loop_mod.build

    def norm(model, info):
        calls["norm"] += 1
        n = real_norm(model, info)
        return n * math.nan if calls["norm"] in nan_steps else n

    def build(*a, **k):
        b = real_build(*a, **k)
        step = b.opt.step

        def counted(*sa, **sk):
            calls["opt"] += 1
            return step(*sa, **sk)

        b.opt.step = counted
        return b

    cfg = tiny_config(str(tmp_path / "run"), steps=5, batch=4, seq=32, wandb="disabled",
                      warmup=0, ckpt_every=0, val_every=0, skip_nonfinite_steps=skips)
    rows: list[dict] = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loop_mod, "global_grad_norm", norm)
        m.setattr(loop_mod, "build", build)
        try:
            result = train(cfg, distributed.setup(), on_step=rows.append)
        except NonFiniteStep as e:
            result = e
    return result, rows, calls


def test_skipped_steps_update_nothing_and_are_counted(tmp_path):
    result, rows, calls = _run_with_nan_norm_at(tmp_path, {3}, skips=1)
    assert isinstance(result, dict) and result["step"] == 5
    assert calls["opt"] == 4  # steps 1, 2, 4, 5
    by = {r["step"]: r for r in rows}
    assert by[3]["nonfinite"] is True and by[3]["skipped_steps"] == 1
    assert [by[s].get("skipped_steps") for s in (1, 2, 4, 5)] == [None, None, 1, 1]
    # no LR step either: step 4 trains at the LR step 3 would have had
    assert by[4]["lr"] == by[3]["lr"] and by[3]["lr"] != by[2]["lr"]
    assert all(math.isfinite(by[s]["loss"]) for s in by)


def test_skips_are_bounded(tmp_path):
    result, rows, calls = _run_with_nan_norm_at(tmp_path, {2, 4}, skips=1)
    assert isinstance(result, NonFiniteStep)
    assert "step 4: non-finite" in str(result) and "1 skip(s) allowed" in str(result)
    assert calls["opt"] == 2  # steps 1 and 3
    assert [r["step"] for r in rows] == [1, 2, 3]  # the stopping step is written, not streamed
    assert _rows(tmp_path / "run")[-1]["step"] == 4


def test_init_refuses_non_finite_weights_naming_the_expert(tmp_path):
    ck = write_checkpoint(tmp_path / "ck")
    (f,) = list(ck.glob("*.safetensors"))
    sd = load_file(str(f))
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    w = sd[name].clone()
    w[2, 3] = float("nan")
    sd[name] = w
    save_file(sd, str(f), metadata={"format": "pt"})
    out = tmp_path / "run"
    args = ["--init", str(ck), "--batch", "2", "--seq", "16", "--steps", "2", "--wandb",
            "disabled", "--val-every", "0", "--export", "bf16", "--out", str(out)]
    p = subprocess.run(command(1, args), env=env(), cwd=REPO, capture_output=True, text=True,
                       timeout=600, check=False)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-3000:])
    (line,) = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert "layers.1.experts.up expert 5 holds 1 NaN/Inf values" in line
    assert "Traceback" not in p.stderr and not (out / "export").exists()
    assert not (out / "metrics.jsonl").exists() or not _rows(out)


def test_the_flag_round_trips_through_the_launcher_argv(tmp_path):
    from workbench.train.args import config_from_args, trainer_argv

    cfg = config_from_args([*TINY, "--out", str(tmp_path), "--skip-nonfinite-steps", "3"])
    assert cfg.skip_nonfinite_steps == 3
    assert config_from_args(trainer_argv(cfg)) == cfg
    with pytest.raises(ValueError, match="skip_nonfinite_steps"):
        cfg.replace(skip_nonfinite_steps=-1)
