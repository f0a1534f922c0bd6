"""Token dispatchers: route token copies to experts and combine the weighted results.

Legend: T local tokens, D hidden, K top-k, A = T*K assignments, E experts (global unless noted),
L local experts per rank, R ranks of the EP group.

A dispatcher is a plain callable `(x_TD, experts_TK, weights_TK, GroupedExperts) -> y_TD`; the MoE
block holds one and expert parallelism is a dispatcher swap. Both dispatchers sort assignments
by global expert id with a stable sort, so rows of one expert keep token order, and combine in
the same order as transformers' per-expert loop (weight multiply after the down projection,
then `index_add_`).

No atomics (docs/determinism.md): `index_add_` and the backward of `x_TD[token_A]` accumulate with
atomic adds on CUDA, whose order changes from run to run. Both are replaced by gathers: every
token has exactly K assignments, so its sum is K gathered rows added one after another in
sorted-assignment order (`slots_TK`), which is the order the CPU's sequential `index_add_` and
index backward use, so CPU results are the same bits as before.

Under CUDA autocast the rows are gathered (and sent) in the GEMM's dtype: the grouped GEMM
casts them anyway, and casting the T tokens before copying them K times moves half the bytes;
the gradient is still summed in the tokens' own dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.model.collectives import all_to_all
from workbench.model.experts import GroupedExperts
from workbench.model.index_ops import inverse, permute, sorted_counts


def _sort_assignments(experts_TK: torch.Tensor, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order_A, token_A, counts_E): assignment order sorted by expert, its token, per-expert counts."""
    flat_A = experts_TK.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)
    token_A = order_A // experts_TK.shape[1]
    # not bincount: a static output shape, so torch.compile does not break the graph here
    return order_A, token_A, sorted_counts(flat_A[order_A], num_experts)


def _slots(pos_A: torch.Tensor, k: int) -> torch.Tensor:
    """slots_TK: the sorted positions (``pos_A = inverse(order_A)``) of token t's K assignments,
    ascending (= expert order)."""
    return pos_A.view(-1, k).sort(dim=1).values


def _sum_slots(y_AD: torch.Tensor, slots_TK: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out[t] = ((0 + y[slots[t, 0]]) + y[slots[t, 1]]) + ...: a fixed order, no atomics."""
    out_TD = torch.zeros(slots_TK.shape[0], y_AD.shape[1], dtype=out_dtype, device=y_AD.device)
    for k in range(slots_TK.shape[1]):
        out_TD = out_TD + y_AD[slots_TK[:, k]].to(out_dtype)
    return out_TD


class _GatherRows(torch.autograd.Function):
    """``x_TD.to(dtype)[token_A]`` whose backward sums each token's K row gradients with
    ``_sum_slots`` in x's dtype."""

    @staticmethod
    def forward(ctx, x_TD, token_A, slots_TK, dtype):
        ctx.save_for_backward(slots_TK)
        ctx.dtype = x_TD.dtype
        return x_TD.to(dtype)[token_A]

    @staticmethod
    def backward(ctx, g_AD):
        (slots_TK,) = ctx.saved_tensors
        return _sum_slots(g_AD, slots_TK, ctx.dtype), None, None, None


class _SumSlots(torch.autograd.Function):
    """``_sum_slots`` whose backward is the gather ``g_TD[token_A]`` (each row used once)."""

    @staticmethod
    def forward(ctx, y_AD, slots_TK, token_A, out_dtype):
        ctx.save_for_backward(token_A)
        ctx.dtype = y_AD.dtype
        return _sum_slots(y_AD, slots_TK, out_dtype)

    @staticmethod
    def backward(ctx, g_TD):
        (token_A,) = ctx.saved_tensors
        return g_TD[token_A].to(ctx.dtype), None, None, None


def _gather_tokens(x_TD: torch.Tensor, token_A: torch.Tensor, slots_TK: torch.Tensor
                   ) -> torch.Tensor:
    dt = x_TD.dtype
    if x_TD.is_cuda and torch.is_autocast_enabled("cuda") and x_TD.is_floating_point():
        dt = torch.get_autocast_dtype("cuda")  # what workbench.model.grouped casts rows to
    return _GatherRows.apply(x_TD, token_A, slots_TK, dt)


def _combine(x_TD: torch.Tensor, y_AD: torch.Tensor, weights_TK: torch.Tensor,
             order_A: torch.Tensor, pos_A: torch.Tensor, token_A: torch.Tensor,
             slots_TK: torch.Tensor) -> torch.Tensor:
    y_AD = y_AD * permute(weights_TK.reshape(-1), order_A, pos_A)[:, None]
    return _SumSlots.apply(y_AD, slots_TK, token_A, x_TD.dtype)


class LocalDispatcher:
    """All experts on this process: sort, one grouped GEMM pass, scatter back weighted."""

    def __call__(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        if experts.num_experts != experts.num_global_experts:
            raise ValueError(f"LocalDispatcher needs all {experts.num_global_experts} experts on this"
                             f" process, the module holds {experts.num_experts}; use "
                             "AllToAllDispatcher for sharded experts")
        order_A, token_A, counts_E = _sort_assignments(experts_TK, experts.num_experts)
        pos_A = inverse(order_A)
        slots_TK = _slots(pos_A, experts_TK.shape[1])
        offs_E = counts_E.cumsum(0).to(torch.int32)
        x_AD = _gather_tokens(x_TD, token_A, slots_TK)
        # every assignment is routed: the counts sum to the gathered rows
        y_AD = experts(x_AD, offs_E, end=x_AD.shape[0])
        return _combine(x_TD, y_AD, weights_TK, order_A, pos_A, token_A, slots_TK)

    def __repr__(self) -> str:
        return "LocalDispatcher()"


class AllToAllDispatcher:
    """Experts sharded contiguously over `group`: rank r holds global experts [r*L, (r+1)*L).

    1. exchange per-expert counts (all_to_all_single on an [R, L] int64 tensor);
    2. send token rows, grouped by destination rank (sorted by global expert id does that);
    3. regroup the received rows (grouped by source rank, then local expert) by local expert,
       run the grouped GEMM, undo the regrouping;
    4. send results back with the splits reversed, weight and sum into the local tokens.
    Autograd flows through both all-to-alls (`workbench.model.collectives`).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def __call__(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        R, L = self.size, experts.num_experts
        if L * R != experts.num_global_experts or experts.expert_offset != self.rank * L:
            raise ValueError(f"AllToAllDispatcher on rank {self.rank}/{R} expects local experts "
                             f"[{self.rank * L}, {(self.rank + 1) * L}) of {L * R}, the module holds "
                             f"[{experts.expert_offset}, {experts.expert_offset + L}) of "
                             f"{experts.num_global_experts}")
        order_A, token_A, counts_E = _sort_assignments(experts_TK, experts.num_global_experts)
        pos_A = inverse(order_A)
        slots_TK = _slots(pos_A, experts_TK.shape[1])
        send_RL = counts_E.view(R, L)
        recv_RL = torch.empty_like(send_RL)
        dist.all_to_all_single(recv_RL, send_RL, group=self.group)
        in_splits = send_RL.sum(1).tolist()
        out_splits = recv_RL.sum(1).tolist()
        x_recv = all_to_all(_gather_tokens(x_TD, token_A, slots_TK), out_splits, in_splits, self.group)

        local_expert = torch.arange(L, device=x_TD.device).repeat(R)
        local_expert = local_expert.repeat_interleave(recv_RL.reshape(-1))
        perm = torch.argsort(local_expert, stable=True)
        inv = inverse(perm)
        offs_L = recv_RL.sum(0).cumsum(0).to(torch.int32)
        # the received counts sum to the received rows
        y_recv = experts(permute(x_recv, perm, inv), offs_L, end=x_recv.shape[0])
        y_recv = permute(y_recv, inv, perm)

        y_AD = all_to_all(y_recv, in_splits, out_splits, self.group)
        return _combine(x_TD, y_AD, weights_TK, order_A, pos_A, token_A, slots_TK)

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(rank={self.rank}, size={self.size})"
