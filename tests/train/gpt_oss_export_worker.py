"""torchrun worker for test_export_families.py: the gpt-oss exports of a model the trainer built
from an --init checkpoint at a layout (`ep`: EP = world; `fsdp`: EP1 x FSDP over the world), the
same weights at every layout, written to OUT/<layout>-<fmt>. Then the gpt-oss export again into
the same folder with rank 0's first expert shard meeting a full disk: each rank records the error
it got in OUT/<layout>-full-rank<r>.json (the test checks the first export is intact).

Usage: torchrun --nproc-per-node W gpt_oss_export_worker.py OUT INIT LAYOUT
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from workbench.train import distributed, export_gpt_oss
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
        if fmt == "gpt-oss":
            failed_export(built.model, out, layout, recipe, info)
    distributed.teardown(info)


def failed_export(model, out: Path, layout: str, recipe: str, info) -> None:
    real, calls = export_gpt_oss.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # the dense shard is written; the first expert shard meets a full disk
            Path(filename).write_bytes(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tensors, filename, metadata=metadata)

    export_gpt_oss.save_file = save_file
    try:
        export_model(model, out / f"{layout}-gpt-oss", fmt="gpt-oss", recipe=recipe,
                     group=info.group)
        got = {"error": None, "type": None}  # the test then fails naming what was expected
    except (OSError, distributed.PeerFailed) as e:
        got = {"error": str(e), "type": type(e).__name__}
    finally:
        export_gpt_oss.save_file = real
    got["writes"] = len(calls)
    (out / f"{layout}-full-rank{info.rank}.json").write_text(json.dumps(got))
    dist.barrier()


if __name__ == "__main__":
    main()
    distributed.exit_process(0)  # as the trainer's entry points end (gloo threads under FSDP)
