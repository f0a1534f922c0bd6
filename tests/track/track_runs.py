"""The metrics that go into the test runs (the oracle the reader and the budgets are checked
against), and a writer of real wandb offline runs from them (a subprocess)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("wandb_writer.py")
N_STEPS = 40
VAL_EVERY = 5


def curve_rows(scale: float = 1.0, step_time: float = 1.0, fq_share: float | None = None,
               nan_from: int | None = None, n: int = N_STEPS) -> list[dict]:
    """A decaying loss times `scale` (val too), so a QAT run's gap to a baseline of scale 1
    is `scale - 1` at every step by construction."""
    rows = []
    for s in range(n):
        base = 3.0 * math.exp(-s / 15) + 1.0
        t = 10.0 * step_time if s < 2 else step_time  # warm-up steps are slow
        m = {"loss": base * scale, "lr": 1e-3, "step_time_s": t, "tokens_per_s": 4096.0 / t}
        if s % VAL_EVERY == VAL_EVERY - 1:
            m["val_loss"] = (base + 0.05) * scale
        if fq_share is not None:
            m["fake_quant_share"] = fq_share
        if nan_from is not None and s >= nan_from:
            m["loss"] = math.nan
            if "val_loss" in m:
                m["val_loss"] = math.nan
        rows.append({"step": s, "metrics": m})
    return rows


def group_runs() -> list[dict]:
    def r(name, recipe, seed, **kw):
        return {"name": name, "group": "cmp", "config": {"recipe": recipe, "seed": seed},
                "rows": curve_rows(**kw)}
    return [
        r("bf16-s0", "bf16", 0),
        r("mxfp4-s0", "mxfp4", 0, scale=1.01, step_time=1.5, fq_share=0.2),
        r("nvfp4-s0", "nvfp4", 0, scale=1.20, step_time=3.0, fq_share=0.6),
        r("nan-s0", "mxfp4", 0, nan_from=25, fq_share=0.2),
        r("bf16-s1", "bf16", 1, scale=1.3),
        r("mxfp4-s1", "mxfp4", 1, scale=1.3 * 1.01, step_time=1.2, fq_share=0.2),
    ]


def exact_run() -> dict:
    rows = []
    for s in range(8):
        rows.append({"step": s, "metrics": {
            "loss": 1.0 / (s + 1), "third": s / 3.0, "count": 7 * s, "flag": s % 2 == 0,
            "name": f"step-{s}", "tiny": 1e-300 * (s + 1), "huge": 2.0 ** 60 + s,
            "router": {"load_e0": 0.25 + s / 100, "load_e1": 0.75 - s / 100},
            "train/grad_norm": 0.5 + s}})
    rows[5]["metrics"]["loss"] = math.nan
    rows[6]["metrics"]["loss"] = math.inf
    rows[7]["metrics"]["loss"] = -math.inf
    return {"name": "exact", "group": "exact", "tags": ["qat", "tiny"],
            "config": {"preset": "tiny", "recipe": "mxfp4:rceil", "lr": 3e-4, "steps": 8,
                       "model": {"experts": 4, "dims": [64, 128]}, "note": None},
            "config_update": {"ep": 4, "lr": 1e-4},
            "rows": rows, "summary": {"best_loss": 0.125, "verdict": {"ok": True, "n": 3}},
            "alerts": [["first", "hello"], ["second", "world"]], "table_at": 2, "image_at": 3}


def big_run() -> dict:
    rows = [{"step": s, "metrics": {f"expert_{e}_sqnr": 20.0 + e + s / 1000 for e in range(24)}}
            for s in range(200)]
    rows[100]["metrics"]["blob"] = "".join(chr(ord("a") + i % 26) for i in range(100_000))
    return {"name": "big", "group": "big", "config": {}, "rows": rows}


def resume_runs() -> list[dict]:
    first = [{"step": s, "metrics": {"loss": 10.0 + s}} for s in range(6)]
    second = [{"step": s, "metrics": {"loss": 20.0 + s}} for s in range(3, 8)]
    return [{"name": "resumed", "group": "resume", "id": "resume01", "rows": first,
             "config": {"attempt": 1}},
            {"name": "resumed", "group": "resume", "id": "resume01", "rows": second,
             "config": {"attempt": 2}}]


def attempt_runs() -> list[dict]:
    """A preempted job whose second attempt started a new wandb run (new id), same name."""
    first = [{"step": s, "metrics": {"loss": 10.0 + s}} for s in range(1, 7)]
    second = [{"step": s, "metrics": {"loss": 20.0 + s}} for s in range(5, 9)]
    cfg = {"recipe": "mxfp4", "seed": 0}
    return [{"name": "attempts", "group": "attempts", "rows": rows, "config": cfg}
            for rows in (first, second)]


def judge_run() -> dict:
    rows = curve_rows(scale=1.2, step_time=3.0)
    return {"name": "judged", "group": "judge", "config": {"recipe": "nvfp4"}, "rows": rows,
            "publish": {"baseline": curve_rows(), "alert_twice": True}}


def wandb_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp), WANDB_SILENT="true",
               WANDB_CONFIG_DIR=str(tmp / "cfg"), WANDB_CACHE_DIR=str(tmp / "cache"),
               WANDB_DATA_DIR=str(tmp / "data"), WANDB_ARTIFACT_DIR=str(tmp / "art"),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg")
    env.pop("WANDB_API_KEY", None)
    return env


def write_runs(tmp: Path, runs: list[dict]) -> Path:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"dir": str(tmp), "runs": runs}))
    proc = subprocess.run([sys.executable, str(WRITER), str(spec)], env=wandb_env(tmp),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "wandb"


def find_group_run(wandb_dir: Path, group: str, name: str):
    from workbench.track import find_runs

    (run,) = [r for r in find_runs(wandb_dir, group=group) if r.name == name]
    return run
