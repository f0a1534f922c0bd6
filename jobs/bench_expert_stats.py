"""Cost of the per-expert telemetry: one record against the training steps it describes.

    python jobs/bench_expert_stats.py [--preset qwen3_30b_a3b_like] [--recipe mxfp4+mxfp8]
        [--steps 12] [--batch 8] [--seq 512] [--every 50]

Builds the trainer's model and optimizer (`workbench.train.build`), times `train_step` (median
after two warm-up steps) and `ExpertStatsRecorder.record` (median of 3, after one warm-up), with
the device synchronised around each. The share is record / (every x step): the telemetry's cost
averaged over an interval of `--every` steps, the budget's measure (goal: at most 2% at 50 steps
on the GPU preset). Prints one table; with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from workbench.train import distributed
from workbench.train.args import config_from_args
from workbench.train.build import build
from workbench.train.data import load_corpus
from workbench.train.expert_stats import ExpertStatsRecorder
from workbench.train.loop import train_step


def _sync(info) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--recipe", default="mxfp4+mxfp8")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--every", type=int, default=50)
    a = ap.parse_args()
    info = distributed.setup()
    tokens = load_corpus().train
    rows = []
    for recipe in a.recipe.split(","):
        with tempfile.TemporaryDirectory() as out:
            cfg = config_from_args(["--preset", a.preset, "--recipe", recipe, "--steps",
                                    str(a.steps), "--batch", str(a.batch), "--seq", str(a.seq),
                                    "--out", out])
            b = build(cfg, info)
            rec = ExpertStatsRecorder(b.model, info, Path(out))
            steps = []
            for step in range(1, a.steps + 1):
                _sync(info)
                t0 = time.perf_counter()
                train_step(b.model, b.opt, b.sched, tokens, cfg, info, step)
                _sync(info)
                steps.append(time.perf_counter() - t0)
            records = []
            for i in range(4):
                _sync(info)
                t0 = time.perf_counter()
                rec.record(a.steps + i)
                _sync(info)
                records.append(time.perf_counter() - t0)
            rec.close()
            step_s = statistics.median(steps[2:])
            record_s = statistics.median(records[1:])
            rows.append({"preset": a.preset, "recipe": recipe, "device": str(info.device),
                         "stacks": len(rec.stacks), "step_s": step_s, "record_s": record_s,
                         "every": a.every, "share": record_s / (a.every * step_s)})
    print(f"\n{'recipe':<14} {'device':<8} {'stacks':>6} {'step ms':>9} {'record ms':>10} "
          f"{'share @ every':>14}")
    for r in rows:
        print(f"{r['recipe']:<14} {r['device']:<8} {r['stacks']:>6} {1e3 * r['step_s']:>9.1f} "
              f"{1e3 * r['record_s']:>10.1f} {100 * r['share']:>9.2f}% @{r['every']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_expert_stats.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
