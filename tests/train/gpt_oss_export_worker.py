"""torchrun worker for test_export_families.py: the gpt-oss exports of a model the trainer built
from an --init checkpoint at a layout (`ep`: EP = world; `fsdp`: EP1 x FSDP over the world), the
same weights at every layout, written to OUT/<layout>-<fmt>.

Usage: torchrun --nproc-per-node W gpt_oss_export_worker.py OUT INIT LAYOUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from workbench.train import distributed
from workbench.train.build import build
from workbench.train.config import from_checkpoint
from workbench.train.export import export_model


def main() -> None:
    out, init, layout = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    info = distributed.setup(single_rank_group=layout == "fsdp")
    for fmt, recipe in (("gpt-oss", "mxfp4"), ("bf16", "bf16")):
        kw = {"fsdp": True, "ep": 1} if layout == "fsdp" else {}
        cfg = from_checkpoint("/nonexistent-not-written", init, recipe=recipe, batch=4, seq=16,
                              **kw)
        built = build(cfg, info)
        export_model(built.model, out / f"{layout}-{fmt}", fmt=fmt, recipe=recipe,
                     group=info.group)
        dist.barrier()
    distributed.teardown(info)


if __name__ == "__main__":
    main()
    distributed.exit_process(0)  # as the trainer's entry points end (gloo threads under FSDP)
