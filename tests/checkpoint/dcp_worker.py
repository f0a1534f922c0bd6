"""Body of one gloo rank in test_dcp_distributed (a module, so spawned processes can import it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def run(rank: int, world: int, workdir: str, ckpt_paths: list[str]) -> None:
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from workbench.checkpoint import open_checkpoint
    from workbench.checkpoint.dcp import (
        CheckpointStorageReader,
        LocalChunkLoadPlanner,
        local_expert_state_dict,
    )

    dist.init_process_group("gloo", init_method=f"file://{workdir}/pg", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        report = {}
        for i, path in enumerate(ckpt_paths):
            # plain local tensors + LocalChunkLoadPlanner
            ck = open_checkpoint(path)
            reader = CheckpointStorageReader(ck)
            state, offsets = local_expert_state_dict(ck, rank, world)
            dcp.load(state, storage_reader=reader, planner=LocalChunkLoadPlanner(offsets))
            save_file({k: v.contiguous() for k, v in state.items()},
                      f"{workdir}/ck{i}-plain-rank{rank}.safetensors")
            touched = sorted(ck.index.stats.per_tensor)
            report[f"ck{i}-plain"] = {
                "reader_bytes": reader.bytes_read, "index_bytes": ck.index.stats.bytes_read,
                "touched": touched, "offsets": {k: list(v) for k, v in offsets.items()},
                "max_local_experts": max(v.shape[0] for v in state.values()),
            }
            # the same through DTensors sharded on the expert dim
            ck = open_checkpoint(path)
            reader = CheckpointStorageReader(ck)
            md = reader.read_metadata().state_dict_metadata
            dstate = {}
            for name, local in state.items():
                full = md[name].size
                dstate[name] = DTensor.from_local(torch.zeros_like(local), mesh, [Shard(0)],
                                                  run_check=False, shape=full,
                                                  stride=torch.empty(full, device="meta").stride())
            dcp.load(dstate, storage_reader=reader)
            save_file({k: v.to_local().contiguous() for k, v in dstate.items()},
                      f"{workdir}/ck{i}-dtensor-rank{rank}.safetensors")
            report[f"ck{i}-dtensor"] = {"reader_bytes": reader.bytes_read,
                                        "index_bytes": ck.index.stats.bytes_read,
                                        "touched": sorted(ck.index.stats.per_tensor)}
        Path(f"{workdir}/report-rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()

