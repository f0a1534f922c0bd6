"""The EP2 protocol script (`jobs/gpu/ep2_protocol.sh`): its pieces, and the whole protocol as a
CPU dry run (2 gloo ranks, tiny preset), which is what guards the one-shot GPU call against typos.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "jobs" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"ep2_jobs_{name}", JOBS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


driver = _load("ep2_driver")


def test_preset_variant_keeps_expert_shapes():
    from workbench import arch as mc
    from workbench.train.config import preset_config

    name = driver.ensure_preset("qwen3_30b_a3b_like-L2-V256")
    try:
        got, base = mc.preset(name), mc.qwen3_30b_a3b_like()
        assert (got.num_layers, got.vocab_size) == (2, 256)
        for field in ("hidden_size", "expert_ffn", "num_experts", "top_k", "num_heads",
                      "num_kv_heads", "head_dim"):
            assert getattr(got, field) == getattr(base, field), field
        # the trainer resolves the registered name to its GPU training preset
        assert preset_config(name, "/tmp/x").preset == name
    finally:
        mc.PRESETS.pop(name, None)


@pytest.mark.parametrize("bad", ["nope-L2-V256", "qwen3_30b_a3b_like-L2", "tiny-Lx-V3"])
def test_preset_variant_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="BASE-L<layers>-V<vocab>"):
        driver.ensure_preset(bad)


# A stand-in trainer: writes a metrics line per step and a complete checkpoint at step 2, and
# starts a grandchild in a new session (as torchrun starts its workers) that would outlive a
# process-group kill. Its pid goes to grandchild.pid.
_FAKE = textwrap.dedent("""
    import json, os, subprocess, sys, time
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)  # as the trainer makes its run folder
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
    open(os.path.join(out, "grandchild.pid"), "w").write(str(g.pid))
    for step in range(1, 1000):
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\\n")
        if step == 2:
            ck = os.path.join(out, "checkpoints", "step_00000002")
            os.makedirs(ck)
            open(os.path.join(ck, "COMPLETE"), "w").write(json.dumps({"step": 2}))
        time.sleep(0.05)
""")


def test_kill_at_sigkills_the_whole_tree(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(_FAKE)
    out = tmp_path / "run"
    rec = driver.main(["kill-at", "--out", str(out), "--step", "4", "--timeout", "60", "--",
                       sys.executable, str(script), str(out)])
    grandchild = int((out / "grandchild.pid").read_text())
    assert grandchild in rec["killed_pids"]
    assert rec["survivors"] == []
    assert rec["rc"] == -9
    assert rec["last_metrics_step"] >= 4
    assert rec["complete_checkpoints"] == [2]
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(
        f"/proc/{grandchild}/stat").read_text().split(")")[1][:3]
    before = Path(f"{out}.metrics_before_kill.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in before][:4] == [1, 2, 3, 4]
    time.sleep(0.3)  # nothing writes after the kill
    assert len((out / "metrics.jsonl").read_text().splitlines()) == rec["last_metrics_step"]


def test_kill_at_fails_when_the_run_ends_first(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match="ended"):
        driver.main(["kill-at", "--out", str(out), "--step", "4", "--timeout", "60", "--",
                     sys.executable, "-c", "pass"])


@pytest.mark.slow
@pytest.mark.distributed
def test_protocol_cpu_dry_run_nvfp4(tmp_path):
    """The protocol with NVFP4 QAT: resume bit for bit, and the export's grids equal each
    expert's own quantization of the DCP masters (one NVFP4 per-tensor scale per expert; a
    quantization of the whole stack, which shares one, would not match)."""
    out = tmp_path / "out"
    proc = subprocess.run([str(JOBS / "ep2_protocol.sh"), "--cpu", "--steps", "16", "--recipe",
                           "nvfp4", "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=REPO, text=True, capture_output=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert all(p["rc"] == 0 for p in s["phases"].values()), s["phases"]
    assert s["resume"]["bit_exact"] and s["resume"]["steps_recomputed"] >= 1, s["resume"]
    ex = s["export"]
    assert ex["recipe"].startswith("nvfp4") and ex["bit_exact"], ex
    assert ex["compared_with_dcp_masters"] == ex["routed_expert_weights"] == 2 * 8 * 3


@pytest.mark.parametrize("bad", ["nvfp4;true", "mxfp4+mxfp8 --steps 1", "$(id)", ""])
def test_protocol_takes_only_a_recipe_name(bad, tmp_path):
    proc = subprocess.run([str(JOBS / "ep2_protocol.sh"), "--cpu", "--recipe", bad, "--out",
                           str(tmp_path)], cwd=REPO, text=True, capture_output=True, timeout=60,
                          check=False)
    assert proc.returncode == 2 and "--recipe must be a recipe name" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())  # refused before any phase ran


@pytest.mark.slow
@pytest.mark.distributed
def test_protocol_cpu_dry_run(tmp_path):
    """The whole protocol, as the GPU call runs it, on 2 gloo ranks with the tiny preset."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "KEEP_WORK": "1"}
    proc = subprocess.run([str(JOBS / "ep2_protocol.sh"), "--cpu", "--steps", "16", "--out",
                           str(out), "--work", str(work)], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert all(p["rc"] == 0 for p in s["phases"].values()), s["phases"]
    for run in ("run_bf16", "run_qat"):
        assert s[run]["last_step"] == 16 and s[run]["steps_contiguous"], s[run]
    # the same init and data: both runs start from nearly the same loss (the init is MXFP4
    # already, so only the MXFP8 activation fake quantization tells them apart at step 1)
    assert s["run_qat"]["first_loss"] == pytest.approx(s["run_bf16"]["first_loss"], rel=1e-3)
    r = s["resume"]
    assert r["survivors"] == [] and r["resumed_from_step"] == 8
    assert r["steps_recomputed"] >= 1 and r["bit_exact"], r
    ex = s["export"]
    assert ex["layout"] == "compressed-tensors" and ex["bit_exact"], ex
    assert ex["compared_with_dcp_masters"] == ex["routed_expert_weights"] == 2 * 8 * 3
    # each rank read the dense tensors plus exactly its half of the packed experts
    assert s["load"]["bytes_read_over_expected"] == [1.0, 1.0]
    budgets = {b["budget"]: b for b in s["budgets"]["table"]}
    assert budgets["loss finite"]["passed"] is True
    assert s["fake_quant"]["fake_quant_ms_per_step"] > 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["init_config.json", "protocol.log", "runs.tar.gz", "summary.json", "summary.md"])
