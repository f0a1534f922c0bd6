"""`--init CKPT`: start from a BF16 or packed checkpoint of any supported family.

The model is built from the checkpoint's config.json (`workbench.train.build.model_config`),
EP-sliced, then filled here by `workbench.model.load_pretrained_`, the path `from_pretrained`
takes: each rank reads and decodes only its own experts (packed experts decoded exactly by the
checkpoint reader), values land in the model's parameters in place (the parameters stay the
same objects), before QAT and FSDP. A remote --init arrives opened, its shards for this rank
downloaded (`workbench.train.init_source`). Weights holding NaN/Inf stop the run on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from workbench.checkpoint import Checkpoint, open_checkpoint
from workbench.model import GroupedExperts, PretrainedError, check_pretrained, load_pretrained_
from workbench.model.hf import hf_name
from workbench.train.distributed import DistInfo, all_reduce_sum

_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}


class InitError(ValueError):
    """The --init checkpoint does not fit the model; the message names the tensor."""


def _opened(path: str | Path | Checkpoint) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else open_checkpoint(path)


def check_init_shapes(path: str | Path | Checkpoint, model: nn.Module) -> None:
    """InitError unless every parameter of `model` (a meta-device model is fine) has its tensor,
    of its shape, in the checkpoint; reads only the index."""
    try:
        check_pretrained(model, _opened(path))
    except PretrainedError as e:
        raise InitError(f"--init {e}") from e


@torch.no_grad()
def load_init(path: str | Path | Checkpoint, model: nn.Module, info: DistInfo) -> dict:
    """Collective: fill `model` from the checkpoint at `path` (or an opened one, e.g.
    `workbench.train.init_source.init_checkpoint`); returns read statistics ({"bytes_read":
    stored bytes this rank read, "items_read": tensors})."""
    ck = _opened(path)
    try:
        stats = load_pretrained_(model, ck, progress=info.is_main)
    except PretrainedError as e:
        raise InitError(f"--init {e}") from e
    _refuse_nonfinite(ck.source.label(), model, info)
    return stats


def _refuse_nonfinite(path, model: nn.Module, info: DistInfo) -> None:
    """Collective: InitError on every rank when any rank's loaded weights hold NaN/Inf (one
    isfinite pass over what this rank loaded; the flag is all-reduced so no rank trains on)."""
    found = ""
    for name, t in model.named_parameters():
        bad = ~torch.isfinite(t.detach())
        if not bool(bad.any()):
            continue
        n = int(bad.sum())
        module = model.get_submodule(name.rpartition(".")[0])
        leaf = name.rpartition(".")[2]
        if isinstance(module, GroupedExperts):  # a local expert stack: name the global expert
            e = int(bad.flatten(1).any(1).nonzero()[0]) + module.expert_offset
            layer = name.split(".")[2]
            found = (f"layers.{layer}.experts.{_PROJ.get(leaf, leaf)} expert {e} holds {n} "
                     "NaN/Inf values")
        else:
            found = f"{hf_name(name, model.config.family)} holds {n} NaN/Inf values"
        break
    flag = all_reduce_sum(torch.tensor([1.0 if found else 0.0], dtype=torch.float64,
                                       device=info.device), info)
    if found or float(flag.item()) > 0:
        raise InitError(f"--init {path}: {found or 'another rank found NaN/Inf weights'}; "
                        "refusing to train from non-finite weights")
