"""`--init CKPT`: start from a BF16 or packed HF Qwen3-MoE checkpoint through the DCP reader.

`workbench.checkpoint.dcp.CheckpointStorageReader` serves dense tensors under their HF names and
routed experts as stacks `layers.{L}.experts.{gate|up|down}` [E, out, in], decoded to BF16.
Each rank asks only for its local experts (`LocalChunkLoadPlanner` with the rank's expert
offset), so no rank reads, decodes or holds experts it does not own. Values land in the model's
parameters in place (the parameters stay the same objects).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from workbench.checkpoint import Checkpoint
from workbench.checkpoint.dcp import CheckpointStorageReader, LocalChunkLoadPlanner
from workbench.model.experts import GroupedExperts
from workbench.train.distributed import DistInfo, all_reduce_sum

_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


class InitError(ValueError):
    """The --init checkpoint does not fit the model; the message names the tensor."""


def init_state_dict(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(DCP state dict of parameter storages, expert-stack offsets) for this rank."""
    sd: dict[str, torch.Tensor] = {}
    offsets: dict[str, tuple] = {}
    tied = getattr(model.config, "tie_embeddings", False)
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, GroupedExperts):
                # mod_name = model.layers.{L}.mlp.experts
                layer = int(mod_name.split(".")[2])
                key = f"layers.{layer}.experts.{_PROJ[p_name]}"
                sd[key] = p.data
                offsets[key] = (module.expert_offset, 0, 0)
            elif tied and name == "lm_head.weight":
                continue
            else:
                sd[name] = p.data
    return sd, offsets


@torch.no_grad()
def load_init(path: str | Path | Checkpoint, model: nn.Module, info: DistInfo) -> dict:
    """Collective: fill `model` from the HF checkpoint at `path` (or an opened one, e.g.
    `workbench.train.init_source.init_checkpoint`); returns read statistics."""
    reader = CheckpointStorageReader(path)
    path = reader.ck.source.label()
    md = reader.read_metadata().state_dict_metadata
    sd, offsets = init_state_dict(model)
    for name, t in sd.items():
        if name not in md:
            raise InitError(f"--init {path}: the checkpoint has no tensor {name!r}")
        size = tuple(md[name].size)
        want = tuple(t.shape) if name not in offsets else (size[0], *t.shape[1:])
        if size != want:
            raise InitError(f"--init {path}: {name} is {size} in the checkpoint, the model needs "
                            f"{want}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(sd, storage_reader=reader, planner=LocalChunkLoadPlanner(offsets),
                 process_group=info.group, no_dist=info.group is None)
    _refuse_nonfinite(path, sd, offsets, info)
    return {"bytes_read": reader.bytes_read, "items_read": reader.items_read}


def _refuse_nonfinite(path, sd: dict[str, torch.Tensor], offsets: dict[str, tuple],
                      info: DistInfo) -> None:
    """Collective: InitError on every rank when any rank's loaded weights hold NaN/Inf (one
    isfinite pass over what this rank loaded; the flag is all-reduced so no rank trains on)."""
    found = ""
    for name, t in sd.items():
        bad = ~torch.isfinite(t)
        if not bool(bad.any()):
            continue
        n = int(bad.sum())
        if name in offsets:  # an expert stack [E_local, out, in]: name the expert
            e = int(bad.flatten(1).any(1).nonzero()[0]) + offsets[name][0]
            found = f"{name} expert {e} holds {n} NaN/Inf values"
        else:
            found = f"{name} holds {n} NaN/Inf values"
        break
    flag = all_reduce_sum(torch.tensor([1.0 if found else 0.0], dtype=torch.float64,
                                       device=info.device), info)
    if found or float(flag.item()) > 0:
        raise InitError(f"--init {path}: {found or 'another rank found NaN/Inf weights'}; "
                        "refusing to train from non-finite weights")
