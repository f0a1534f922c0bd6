"""Where --init comes from: a folder, a hub id (``org/name[@revision]``) or a URL, resolved once
(`workbench.source.resolve`) and, when remote, downloaded before training.

Each rank downloads the shards holding what it reads (every tensor but the routed experts, and of
those only its own under expert parallelism; `workbench.checkpoint.fetch`) with resumable,
size-checked downloads into the Hugging Face cache, then opens the checkpoint with network reads
of tensor data off: a run never waits on, or dies of, the network between steps.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from workbench.checkpoint import Checkpoint, RemoteOptions
from workbench.checkpoint.fetch import open_prefetched
from workbench.model.experts import GroupedExperts
from workbench.source import Source, SourceError, resolve


def local_experts(model: nn.Module) -> range | None:
    """The global experts this rank's model holds (EP: a contiguous block), or None when it
    has no routed experts; ValueError when layers disagree (no loader for that)."""
    spans = {(m.expert_offset, m.num_experts) for m in model.modules()
             if isinstance(m, GroupedExperts)}
    if not spans:
        return None
    if len(spans) > 1:
        raise ValueError(f"the model's layers hold different expert ranges {sorted(spans)}")
    (offset, n), = spans
    return range(offset, offset + n)


def init_config_folder(spec: str) -> Path:
    """The local folder holding --init's config.json (a hub id's cache snapshot, the config
    downloaded into it when missing and allowed)."""
    src = resolve(spec, need="config")
    if src.path is None:
        raise SourceError(f"--init {spec}: a URL has no local config.json; pass a folder or a "
                          "hub id")
    return src.path


def init_checkpoint(spec: str, model: nn.Module, *, progress: bool = True) -> Checkpoint:
    """--init opened for this rank: a local folder as it is; a remote one with this rank's shards
    downloaded first (see the module docstring)."""
    return open_prefetched(spec, experts=local_experts(model),
                           options=RemoteOptions(progress=progress))


def pin_init(cfg):
    """(cfg, record): a hub id in --init pinned to the commit it resolves to now, so every rank
    and every restart of the run reads one commit even if the branch moves; the record (what
    --init resolved to, or None without --init) goes into the run's config.json."""
    if not cfg.init:
        return cfg, None
    src: Source = resolve(cfg.init)
    if src.kind == "hub":
        pinned = f"{src.repo_id}@{src.revision}"
        if cfg.init != pinned:
            cfg = cfg.replace(init=pinned)
    return cfg, src.record()
