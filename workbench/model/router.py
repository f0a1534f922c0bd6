"""Top-k softmax router and the Switch-style load-balancing loss of transformers' Qwen3-MoE.

Legend: T tokens, D hidden, E experts (global), K top-k, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.model.cast import autocast_operand
from workbench.model.collectives import all_reduce_sum


class TopKRouter(nn.Module):
    """HF `Qwen3MoeTopKRouter`: softmax over all experts in fp32, top-k, optional renormalise."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits_TE, weights_TK in x's dtype, experts_TK int64)."""
        logits_TE = F.linear(x_TD, autocast_operand(self.weight))
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        top_TK, idx_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return logits_TE, top_TK.to(logits_TE.dtype), idx_TK


def load_balancing_loss(logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (no attention mask), optionally over a group.

    As in transformers, assignment counts and probability sums are accumulated over *all* MoE
    layers before the product: loss = E * sum_e (count_e / N) * (prob_e / N), N = tokens * layers.

    With `group`, counts, probability sums and N are summed over the group's ranks first, so each
    rank returns the loss of the concatenated batch (what one EP1 process would compute on all
    the data). The probability sum goes through a differentiable all-reduce whose backward sums
    the ranks' gradients; `workbench.model.parallel.sync_gradients` then divides by the world size
    like every other gradient, which yields the gradient of the mean of the ranks' losses.
    """
    if not logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for logits_TE in logits:
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        _, idx_TK = torch.topk(probs_TE, top_k, dim=-1)
        flat = idx_TK.reshape(-1)  # scatter_add, not bincount: static shape for torch.compile
        counts_E = counts_E.scatter_add(0, flat, torch.ones(flat.shape, device=flat.device))
        probs_E = probs_E + probs_TE.sum(dim=0)
        rows += logits_TE.shape[0]
    rows_t = torch.tensor(float(rows), device=counts_E.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_E, group=group)
        dist.all_reduce(rows_t, group=group)
        probs_E = all_reduce_sum(probs_E, group)
    return (counts_E / rows_t * (probs_E / rows_t)).sum() * num_experts
