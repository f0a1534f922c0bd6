"""Trainer benchmark: tokens/s of bf16 vs mxfp4+mxfp8 QAT on one preset, in one run; and memory
per rank when loading a packed (MXFP4 compressed-tensors) checkpoint under EP1/EP2/EP4.

    python jobs/bench_train.py [--preset tiny] [--steps 12] [--batch 8] [--seq 64] [--ep 1 2 4]

Throughput: both recipes stepped alternately (the trainer's own `train_step`) on the same global
batches, median over the steps after the first two (warm-up); `tokens_per_s` = global tokens /
step wall time, as the trainer logs it.
Memory: a model with large experts is exported once, then loaded with `--init`'s code path under
torchrun with N ranks; each rank reports the expert bytes it holds, the checkpoint bytes it read
and its peak RSS growth while building the model and loading (ru_maxrss - RSS before).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Expert-heavy model for the memory part: 2 MoE layers x 32 experts x 3 x 512x512 = 50M expert
# parameters (200 MB fp32 at EP1), small dense part.
MEM_MODEL = {"hidden_size": 512, "expert_ffn": 512, "num_experts": 32, "num_layers": 2,
             "dense_ffn": 512}


def throughput(preset: str, steps: int, batch: int, seq: int) -> list[dict]:
    """Both recipes built side by side and stepped alternately on the same global batches, so a
    machine shared with other work slows both alike; medians over steps 3..N."""
    from workbench.train import distributed
    from workbench.train.args import config_from_args
    from workbench.train.build import build
    from workbench.train.data import load_corpus
    from workbench.train.loop import train_step

    info = distributed.setup()
    tokens = load_corpus().train
    recipes = ("bf16", "mxfp4+mxfp8")
    runs = {}
    for recipe in recipes:
        cfg = config_from_args(["--preset", preset, "--recipe", recipe, "--steps", str(steps),
                                "--batch", str(batch), "--seq", str(seq), "--out", "unused"])
        b = build(cfg, info)
        runs[recipe] = (cfg, b, [])
    for step in range(1, steps + 1):
        for recipe in recipes:
            cfg, b, recs = runs[recipe]
            recs.append(train_step(b.model, b.opt, b.sched, tokens, cfg, info, step))
    rows = []
    for recipe in recipes:
        m = runs[recipe][2][2:]
        rows.append({"recipe": recipe,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in m),
                     "step_time_s": statistics.median(r["step_time_s"] for r in m),
                     "final_loss": m[-1]["loss"]})
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_bf16"] = r["tokens_per_s"] / base
    return rows


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def mem_worker(ckpt: str, report: str) -> None:
    import torch

    from workbench.model import GroupedExperts, MoEForCausalLM, tiny
    from workbench.train import distributed
    from workbench.train.init import load_init

    info = distributed.setup()
    before = _rss_bytes()
    model = MoEForCausalLM(tiny(**MEM_MODEL), seed=1, ep_group=info.group)
    stats = load_init(ckpt, model, info)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    expert = sum(p.numel() * p.element_size() for m in model.modules()
                 if isinstance(m, GroupedExperts) for p in m.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with open(f"{report}.{info.rank}.json", "w") as f:
        json.dump({"rank": info.rank, "world": info.world, "expert_param_mib": expert / 2**20,
                   "all_param_mib": total / 2**20, "ckpt_read_mib": stats["bytes_read"] / 2**20,
                   "peak_rss_growth_mib": (peak - before) / 2**20,
                   "peak_rss_mib": peak / 2**20}, f)
    torch.distributed.barrier() if info.group is not None else None
    distributed.teardown(info)


def memory(eps: list[int]) -> list[dict]:
    from workbench.model import MoEForCausalLM, tiny
    from workbench.train.export import export_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "packed"
        export_model(MoEForCausalLM(tiny(**MEM_MODEL), seed=0), ckpt, fmt="compressed-tensors",
                     recipe="mxfp4")
        size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        for ep in eps:
            report = Path(tmp) / f"mem{ep}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ep}", __file__, "--mem-worker", str(ckpt), str(report)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True)
            for r in range(ep):
                row = json.loads(Path(f"{report}.{r}.json").read_text())
                row["ckpt_file_mib"] = size / 2**20
                rows.append(row)
    return rows


def _table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(fmt(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--mem-worker":
        mem_worker(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    a = p.parse_args()
    import platform

    import torch

    print(f"# machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"cuda {torch.cuda.is_available()}")
    print(f"# throughput: preset {a.preset}, global batch {a.batch} x {a.seq} tokens, "
          f"{a.steps} steps (median of steps 3..{a.steps}), world size 1")
    print(_table(throughput(a.preset, a.steps, a.batch, a.seq),
                 ["recipe", "tokens_per_s", "step_time_s", "vs_bf16", "final_loss"]))
    print(f"\n# packed-checkpoint load (MXFP4 compressed-tensors), model tiny({MEM_MODEL})")
    print(_table(memory(a.ep), ["world", "rank", "expert_param_mib", "all_param_mib",
                                "ckpt_file_mib", "ckpt_read_mib", "peak_rss_growth_mib"]))


if __name__ == "__main__":
    main()
