"""Under torchrun (2 ranks): rank 1 holds a large ballast, then both ranks run one train_step.
Writes REPORT.<rank>.json with the logged peak_mem_gib and this rank's own peak RSS."""

import json
import resource
import sys

import torch

from workbench.train import distributed
from workbench.train.args import config_from_args
from workbench.train.build import build
from workbench.train.data import load_corpus
from workbench.train.loop import train_step

out, report = sys.argv[1], sys.argv[2]
info = distributed.setup()
cfg = config_from_args(["--preset", "tiny", "--batch", "4", "--seq", "32", "--wandb", "disabled",
                        "--out", out])
torch.manual_seed(cfg.seed + info.rank)
b = build(cfg, info)
ballast = None
if info.rank == 1:
    ballast = torch.ones(192 * 2**20)  # 768 MiB, touched, so resident
own_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
rec = train_step(b.model, b.opt, b.sched, load_corpus().train, cfg, info, 1)
own_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
with open(f"{report}.{info.rank}.json", "w") as f:
    json.dump({"logged": rec["peak_mem_gib"], "own_before": own_before,
               "own_after": own_after}, f)
distributed.teardown(info)
distributed.exit_process(0)  # as the trainer's entry points end (see its docstring)
