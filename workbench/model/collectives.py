"""Differentiable collectives for expert parallelism (torch.distributed underneath; gloo or NCCL).

Two small autograd Functions instead of `torch.distributed.nn.functional`, so the backward
rule each one uses is visible here:
- all-to-all: the backward is the reverse all-to-all (splits swapped), which routes each
  gradient row back to the rank that sent the row;
- all-reduce (sum): the backward is again an all-reduce sum, i.e. every rank receives the sum
  of all ranks' upstream gradients. Combined with a final division of every gradient by the
  world size this is the gradient of the mean of the ranks' losses.
Every rank must call these in the same order, in forward and therefore in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows x[sum(in_splits[:r]):sum(in_splits[:r+1])] go to rank r; out_splits[r] rows come back."""
    if len(out_splits) != len(in_splits) or len(in_splits) != dist.get_world_size(group):
        raise ValueError(f"all_to_all needs one split per rank of the group "
                         f"({dist.get_world_size(group)}), got {len(in_splits)} / {len(out_splits)}")
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all in_splits sum to {sum(in_splits)} but x has {x.shape[0]} rows")
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad = grad_out.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)
