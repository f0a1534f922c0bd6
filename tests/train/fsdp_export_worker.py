"""torchrun worker for test_export_fsdp.py: the streamed FSDP export and its reference.

Builds the trainer's FSDP model (`build`, tiny preset, seeded init: the same weights at every
layout) at `--ep EP --fsdp` and exports it to OUT/fsdp-<fmt>; then the same seeded weights
without FSDP at EP = EP (the ranks 0..EP-1 as the EP group; one process at EP 1) export to
OUT/ref-<fmt> through the unchanged non-FSDP path. Formats: bf16 (recipe bf16, not prepared),
and compressed-tensors for each QAT recipe given (prepared: packed through convert()).

Usage: torchrun --nproc-per-node W fsdp_export_worker.py OUT EP RECIPE[,RECIPE...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.model import MoEForCausalLM
from workbench.train import distributed
from workbench.train.build import build, model_config, prepare_qat
from workbench.train.config import tiny
from workbench.train.export import export_model


def main() -> None:
    out, ep, recipes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    info = distributed.setup(single_rank_group=True)
    ref_group = None
    if ep > 1:  # the non-FSDP reference's EP group: ranks 0..ep-1 (a collective to create)
        ref_group = dist.new_group(list(range(ep))) if ep < info.world else dist.group.WORLD
    for recipe in recipes:
        fmt = "bf16" if recipe == "bf16" else "compressed-tensors"
        tag = f"{fmt}-{recipe}"
        cfg = tiny("/nonexistent-not-written", recipe=recipe, fsdp=True, ep=ep, batch=4, seq=16)
        b = build(cfg, info)
        export_model(b.model, out / f"fsdp-{tag}", fmt=fmt, recipe=recipe)
        if info.rank < ep:
            ref = MoEForCausalLM(model_config(cfg), seed=cfg.seed, ep_group=ref_group,
                                 device=info.device, dtype=torch.float32)
            prepare_qat(ref, cfg)
            export_model(ref, out / f"ref-{tag}", fmt=fmt, recipe=recipe, group=ref_group)
        dist.barrier()
    distributed.teardown(info)


if __name__ == "__main__":
    main()
    # FSDP leaves gloo threads alive past teardown; a normal interpreter exit can then abort
    # (exit -6) after a run that passed. exit_process is what the trainer's entry points use.
    distributed.exit_process(0)
