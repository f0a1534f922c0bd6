"""`torch.distributed.checkpoint` reader over a packed checkpoint: logical BF16 tensors, decoded
slice by slice, so `dcp.load` fills an expert-parallel state dict without any rank reading,
decoding or holding experts it does not own.

What the reader advertises (`read_metadata`):
- every name of `ck.logical_names()` (HF names, e.g. `model.layers.0.self_attn.q_proj.weight`,
  and per-expert names where the layout has them), one chunk covering the tensor;
- routed experts ALSO as per-layer stacks `layers.{L}.experts.{gate|up|down}` of shape
  [E, out, in], advertised as E chunks of one expert each. DCP's resharding
  (`create_read_items_for_chunk_list`) intersects a rank's chunk with these, so every `ReadItem`
  names one expert plus a row/column window, and `read_data` decodes exactly that window.

How a rank asks for only its experts -- two ways, both tested on gloo:
1. A DTensor sharded on dim 0 (`Shard(0)`), as torchtitan-style EP models hold experts: the
   default planner already knows its global offsets.
2. Plain local tensors [E_local, out, in] with `LocalChunkLoadPlanner({name: (e0, 0, 0)})`.
   The default planner rejects a plain tensor whose size differs from the checkpoint's ("Size
   mismatch"), and its lookup only accepts offset 0 for plain tensors; this planner states where
   each local tensor sits in the global one, so no DeviceMesh or DTensor is needed.

Bytes read per rank are counted (`reader.bytes_read`) from the checkpoint index's own counter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, StorageReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from .errors import CheckpointError

PROJS = ("gate", "up", "down")


def stack_name(layer: int, proj: str) -> str:
    """DCP name of layer `layer`'s routed-expert stack [E, out, in] for `proj`."""
    if proj not in PROJS:
        raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
    return f"layers.{layer}.experts.{proj}"


@dataclass(frozen=True)
class _Stack:
    layer: int
    proj: str
    num_experts: int


class CheckpointStorageReader(StorageReader):
    """A DCP `StorageReader` serving logical BF16 tensors of an opened packed checkpoint.

    `ck` is what `workbench.checkpoint.open_checkpoint` returns, or a path to open.
    Each process builds its own reader; opening reads only shard headers.
    """

    def __init__(self, ck) -> None:
        super().__init__()
        if isinstance(ck, (str, os.PathLike)):
            from . import open_checkpoint

            ck = open_checkpoint(ck)
        self.ck = ck
        self.bytes_read = 0  # packed/scale bytes this reader pulled from the shards
        self.items_read = 0
        self._stacks: dict[str, _Stack] = {}
        self._stacks_ready = False
        self._metadata: Metadata | None = None

    # -- StorageReader protocol -------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != os.fspath(self.ck.path):
            raise CheckpointError(f"this reader serves {self.ck.path}, not {checkpoint_id}",
                                  path=self.ck.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(checkpoint_id, "config.json"))

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = self._build_metadata()
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        stats = getattr(getattr(self.ck, "index", None), "stats", None)
        before = stats.bytes_read if stats is not None else 0
        for item in plan.items:
            value = self._decode(item)
            target = planner.resolve_tensor(item).detach()
            if target.shape != value.shape:
                raise CheckpointError(
                    f"DCP asked for {tuple(target.shape)} but the decoded window is "
                    f"{tuple(value.shape)}", path=self.ck.path, tensor=item.storage_index.fqn)
            target.copy_(value)
            planner.commit_tensor(item, target)
            self.items_read += 1
        if stats is not None:
            self.bytes_read += stats.bytes_read - before
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- internals ------------------------------------------------------------------------
    def _build_stacks(self) -> dict[str, tuple[int, int, int]]:
        """Stack name -> (E, out, in) from the expert records; fills `self._stacks` once."""
        shapes: dict[tuple[int, str], dict[int, tuple[int, ...]]] = {}
        for r in self.ck.experts():
            shapes.setdefault((r.layer, r.proj), {})[r.expert] = tuple(r.shape)
        sizes = {}
        for (layer, proj), per_expert in sorted(shapes.items()):
            n_exp = max(per_expert) + 1
            if sorted(per_expert) != list(range(n_exp)) or len(set(per_expert.values())) != 1:
                raise CheckpointError(
                    f"layer {layer} {proj}: experts {sorted(per_expert)} with shapes "
                    f"{sorted(set(per_expert.values()))} do not form one [E, out, in] stack",
                    path=self.ck.path)
            name = stack_name(layer, proj)
            self._stacks[name] = _Stack(layer, proj, n_exp)
            sizes[name] = (n_exp, *per_expert[0])
        self._stacks_ready = True
        return sizes

    def _build_metadata(self) -> Metadata:
        md: dict[str, TensorStorageMetadata] = {}
        for name in self.ck.logical_names():
            view = self.ck.tensor(name)
            size = torch.Size(view.shape)
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(view, "dtype", torch.bfloat16)),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
        for name, (n_exp, out, inp) in self._build_stacks().items():
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch.bfloat16),
                size=torch.Size([n_exp, out, inp]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size([e, 0, 0]),
                                             sizes=torch.Size([1, out, inp]))
                        for e in range(n_exp)],
            )
        return Metadata(state_dict_metadata=md, planner_data={}, storage_data={})

    def _decode(self, item: ReadItem) -> torch.Tensor:
        """Decode the window a ReadItem names: chunk offset + storage offsets, item lengths."""
        fqn = item.storage_index.fqn
        if not self._stacks_ready:
            self._build_stacks()  # set_up_storage_reader was handed another reader's Metadata
        chunk = item.storage_index.offset or torch.Size([0] * len(item.lengths))
        start = [c + o for c, o in zip(chunk, item.storage_offsets)]
        window = tuple(slice(s, s + n) for s, n in zip(start, item.lengths))
        stack = self._stacks.get(fqn)
        if stack is not None:
            # chunks are single experts, so the first dim is always [e, e+1)
            expert = start[0]
            view = self.ck.expert_weight(stack.layer, expert, stack.proj)
            return view[window[1], window[2]].unsqueeze(0)
        view = self.ck.tensor(fqn)
        if not window:
            return view.materialize()
        return view[window]


class LocalChunkLoadPlanner(DefaultLoadPlanner):
    """Load plain tensors that are chunks of larger checkpoint tensors.

    `offsets[name]` is where `state_dict[name]` starts inside the checkpoint tensor `name`
    (e.g. `(ep_rank * E_local, 0, 0)` for a rank's experts). Names without an offset are loaded
    whole, as by `DefaultLoadPlanner`.
    """

    def __init__(self, offsets: Mapping[str, Sequence[int]], **kwargs) -> None:
        kwargs.setdefault("flatten_state_dict", False)
        super().__init__(**kwargs)
        self.offsets = {k: torch.Size(v) for k, v in offsets.items()}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        chunks = {k: v for k, v in self.state_dict.items() if k in self.offsets}
        others = {k: v for k, v in self.state_dict.items() if k not in self.offsets}
        items = list(create_default_local_load_plan(others, self.metadata,
                                                    not self.allow_partial_load).items)
        for name, tensor in chunks.items():
            md = self.metadata.state_dict_metadata.get(name)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"{name!r} is not a tensor in the checkpoint metadata")
            off = self.offsets[name]
            if len(off) != tensor.dim() or len(md.size) != tensor.dim() or any(
                    o < 0 or o + n > full for o, n, full in zip(off, tensor.shape, md.size)):
                raise ValueError(f"{name}: local tensor {tuple(tensor.shape)} at offset "
                                 f"{tuple(off)} does not fit in {tuple(md.size)}")
            local = ChunkStorageMetadata(offsets=off, sizes=tensor.size())
            items += create_read_items_for_chunk_list(name, md, [local])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.offsets:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


def local_expert_state_dict(
    ck, ep_rank: int, ep_size: int, *, layers: Sequence[int] | None = None,
    projs: Sequence[str] = PROJS, dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int, int]]]:
    """Empty per-rank expert stacks and their offsets, for `LocalChunkLoadPlanner`.

    Rank r owns experts [r*E/ep_size, (r+1)*E/ep_size) of every layer (contiguous EP sharding).
    """
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} outside [0, {ep_size})")
    shapes: dict[tuple[int, str], tuple[int, tuple[int, ...]]] = {}
    for r in ck.experts():
        n, shape = shapes.get((r.layer, r.proj), (0, tuple(r.shape)))
        shapes[(r.layer, r.proj)] = (max(n, r.expert + 1), shape)
    state: dict[str, torch.Tensor] = {}
    offsets: dict[str, tuple[int, int, int]] = {}
    for (layer, proj), (n_exp, (out, inp)) in sorted(shapes.items()):
        if (layers is not None and layer not in layers) or proj not in projs:
            continue
        if n_exp % ep_size:
            raise ValueError(f"layer {layer}: {n_exp} experts do not split over {ep_size} ranks")
        local = n_exp // ep_size
        name = stack_name(layer, proj)
        state[name] = torch.empty(local, out, inp, dtype=dtype)
        offsets[name] = (ep_rank * local, 0, 0)
    return state, offsets
