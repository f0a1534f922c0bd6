"""`--init CKPT`: start from a BF16 or packed checkpoint of any supported family.

The model is built from the checkpoint's config.json (`workbench.train.build.model_config`),
EP-sliced, then filled here by `workbench.model.load_pretrained_`, the path `from_pretrained`
takes: each rank reads and decodes only its own experts (packed experts decoded exactly by the
checkpoint reader), values land in the model's parameters in place (the parameters stay the
same objects), before QAT and FSDP.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from workbench.model import PretrainedError, load_pretrained_
from workbench.train.distributed import DistInfo


class InitError(ValueError):
    """The --init checkpoint does not fit the model; the message names the tensor."""


def load_init(path: str | Path, model: nn.Module, info: DistInfo) -> dict:
    """Fill `model` from the checkpoint at `path`; returns read statistics ({"bytes_read":
    stored bytes this rank read, "items_read": tensors}). Not a collective."""
    try:
        return load_pretrained_(model, path, progress=info.is_main)
    except PretrainedError as e:
        raise InitError(f"--init {e}") from e
