"""Routers (softmax top-k, gpt-oss's top-k softmax, DeepSeek's sigmoid with groups) and the
Switch-style load-balancing loss of transformers.

Legend: T tokens, D hidden, E experts (global), K top-k, L MoE layers, N groups.

Every router returns (logits_TE, weights_TK, experts_TK): the logits feed the balancing loss,
the weights multiply the expert outputs, the experts are global indices. Parameter names are
transformers' (`weight`, gpt-oss's `bias`, DeepSeek's `e_score_correction_bias`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.arch import MoEConfig
from workbench.model.cast import autocast_operand
from workbench.model.collectives import all_reduce_sum
from workbench.model.index_ops import counts, mark, pick


class TopKRouter(nn.Module):
    """A router that picks K of E experts per token; this class is HF `Qwen3MoeTopKRouter`:
    softmax over all experts in fp32, top-k, optional renormalise. The other families'
    routers subclass it and replace the scoring."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits_TE, weights_TK in x's dtype, experts_TK int64)."""
        logits_TE = F.linear(x_TD, autocast_operand(self.weight))
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float)
        idx_TK = torch.topk(probs_TE.detach(), self.top_k, dim=-1).indices
        top_TK = pick(probs_TE, idx_TK)  # topk's values, whose backward would be a scatter
        if self.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return logits_TE, top_TK.to(logits_TE.dtype), idx_TK


class TopKSoftmaxRouter(TopKRouter):
    """HF `GptOssTopKRouter`: logits with a bias, the top-k of the logits, a softmax over those k
    (computed in fp32 here; transformers keeps the logits' dtype, the same in fp32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, bias: bool = True) -> None:
        super().__init__(hidden, num_experts, top_k, norm_topk_prob=False)
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits_TE = F.linear(x_TD, autocast_operand(self.weight), autocast_operand(self.bias))
        idx_TK = torch.topk(logits_TE.detach(), self.top_k, dim=-1).indices
        weights_TK = torch.softmax(pick(logits_TE, idx_TK), dim=-1, dtype=torch.float)
        return logits_TE, weights_TK.to(logits_TE.dtype), idx_TK


class SigmoidRouter(TopKRouter):
    """HF `DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`, in fp32 (transformers keeps the weight
    and the correction bias in fp32 and casts the input): scores = sigmoid(logits); choice on
    scores + e_score_correction_bias, first the topk_group best of n_group groups (a group
    scores the sum of its two best), then the top-k inside them; weights = the chosen unbiased
    scores, renormalised (+1e-20) if norm_topk_prob, times routed_scaling_factor.

    `e_score_correction_bias` is a parameter that never takes a gradient (so checkpoints and
    exports carry it, and the optimizer leaves it alone); `update_correction_bias_` applies
    DeepSeek-V3's auxiliary-loss-free balancing update from the expert loads."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, *,
                 n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0) -> None:
        super().__init__(hidden, num_experts, top_k, norm_topk_prob)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        scores_TE, idx_TK = self.select(logits_TE, self.e_score_correction_bias)
        weights_TK = pick(scores_TE, idx_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return logits_TE, weights_TK * self.routed_scaling_factor, idx_TK

    def select(self, logits_TE: torch.Tensor, bias_E: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores_TE, experts_TK): the sigmoid scores and the experts picked on scores + bias
        within the best groups."""
        scores_TE = logits_TE.float().sigmoid()
        choice_TE = scores_TE + bias_E.float()
        E, N = choice_TE.shape[-1], self.n_group
        if N > 1:
            group_TN = choice_TE.view(-1, N, E // N).topk(2, dim=-1)[0].sum(dim=-1)
            keep_TN = mark(torch.topk(group_TN, k=self.topk_group, dim=-1, sorted=False)[1], N)
            keep_TE = keep_TN.unsqueeze(-1).expand(-1, N, E // N).reshape(-1, E)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        return scores_TE, torch.topk(choice_TE, k=self.top_k, dim=-1, sorted=False)[1]

    @torch.no_grad()
    def loads(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """int64 [E]: how many of these tokens (their router logits, from the forward) each
        expert received."""
        _, idx_TK = self.select(logits_TE, _full(self.e_score_correction_bias))
        return counts(idx_TK, logits_TE.shape[-1])

    @torch.no_grad()
    def update_correction_bias_(self, load_E: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3 (arXiv 2412.19437, section 2.1.2): after a step, lower the bias of every
        overloaded expert and raise that of every underloaded one by `rate`
        (bias += rate * sign(mean load - load)). `load_E`: the step's routed-token counts of
        this layer over the whole batch (every rank passes the same, so replicas stay equal)."""
        bias = self.e_score_correction_bias
        delta = rate * torch.sign(load_E.float().mean() - load_E.float())
        local = bias.to_local() if hasattr(bias, "to_local") else bias
        if local.shape != delta.shape:  # an FSDP shard: this rank's rows of the vector
            start = _shard_offset(bias)
            delta = delta[start:start + local.shape[0]]
        local.add_(delta.to(local.device, local.dtype))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP-sharded parameter (a collective), else `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_offset(t) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0])


def make_router(cfg: MoEConfig) -> TopKRouter:
    r = cfg.router
    if r.kind == "topk_softmax":
        return TopKSoftmaxRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, r.bias)
    if r.kind == "sigmoid":
        return SigmoidRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob,
                             n_group=r.n_group, topk_group=r.topk_group,
                             routed_scaling_factor=r.routed_scaling_factor)
    return TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)


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
        counts_E = counts_E + counts(idx_TK, num_experts)  # exact: integers below 2^24
        probs_E = probs_E + probs_TE.sum(dim=0)
        rows += logits_TE.shape[0]
    rows_t = torch.tensor(float(rows), device=counts_E.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts_E, group=group)
        dist.all_reduce(rows_t, group=group)
        probs_E = all_reduce_sum(probs_E, group)
    return (counts_E / rows_t * (probs_E / rows_t)).sum() * num_experts
