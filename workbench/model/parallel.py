"""Expert parallelism set-up and gradient synchronisation.

Layout: the EP group is also the data-parallel group. Every rank holds a replica of the dense
parameters (attention, norms, router, shared expert, embeddings) and experts
[r*E/R, (r+1)*E/R) of every MoE layer; each rank feeds its own slice of the global batch.

Gradient meaning ("data-parallel interpretation"): after `sync_gradients` every gradient is
the gradient of the *mean of the ranks' losses*, i.e. of the EP1 loss on the concatenated batch
when every rank counts the same number of tokens. Therefore:
- dense gradients are summed over the group and divided by R (all-reduce average);
- expert gradients already hold the contributions of every rank's tokens (the reverse
  all-to-all in backward delivered them), so they are only divided by R; no all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workbench.model.dispatch import AllToAllDispatcher
from workbench.model.experts import GroupedExperts
from workbench.model.moe import MoEBlock


def install_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Swap every MoE block to the all-to-all dispatcher; experts must already be local slices."""
    group = group if group is not None else dist.group.WORLD
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    if not blocks:
        raise ValueError("install_expert_parallel: the model has no MoE block")
    for block in blocks:
        block.dispatcher = AllToAllDispatcher(group)
    model.ep_group = group


def shard_experts_(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Cut a model that holds all experts down to this rank's contiguous share and switch it to EP.

    Replaces expert parameters: call before building the optimizer."""
    group = group if group is not None else dist.group.WORLD
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            if module.num_experts != module.num_global_experts:
                raise ValueError("shard_experts_: experts are already sharded "
                                 f"({module.num_experts} of {module.num_global_experts})")
            if module.num_global_experts % size:
                raise ValueError(f"shard_experts_: {module.num_global_experts} experts do not split "
                                 f"over {size} ranks")
            local = module.num_global_experts // size
            module.narrow_(rank * local, local)
    install_expert_parallel(model, group)


def is_expert_param(model: nn.Module, name: str) -> bool:
    module_name, _, _ = name.rpartition(".")
    return isinstance(model.get_submodule(module_name), GroupedExperts)


@torch.no_grad()
def sync_gradients(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Average dense gradients over `group` and scale expert gradients by 1/R (see module doc).

    A parameter without a gradient on some rank takes part with zeros, so the collective has
    the same shape on every rank."""
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size == 1:
        return
    dense, experts = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        (experts if is_expert_param(model, name) else dense).append(param.grad)
    for grad in experts:
        grad.div_(size)
    # One flat buffer per dtype: a single all-reduce instead of one per tensor.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in dense:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
