"""Routed experts as stacked parameters behind one grouped-GEMM seam.

Legend: T routed rows (token copies sorted by expert), D hidden, F expert FFN, E local experts.

`w1` (gate) and `w3` (up) are [E, F, D], `w2` (down) is [E, D, F]: Linear convention
[E, out, in], so each block-scaled format blocks the last (reduction) dim of every weight.
The forward calls only `self.grouped_mm(x_TD, w_EOI, offs_E)` and `self.swiglu(g_TF, u_TF)`; QAT
replaces those attributes on the instance (never the parameters), so masters, state_dict and
optimizer state stay untouched. The SwiGLU is a seam of its own because it sits between two
GEMMs: QAT fuses the down projection's activation fake quantization into it on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.model.grouped import grouped_mm


def swiglu(g_TF: torch.Tensor, u_TF: torch.Tensor) -> torch.Tensor:
    """The experts' activation: silu(gate) * up."""
    return F.silu(g_TF) * u_TF


class GroupedExperts(nn.Module):
    """SwiGLU experts. Under expert parallelism an instance holds global experts
    [expert_offset, expert_offset + num_experts) of `num_global_experts`."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, num_global_experts: int | None = None,
                 expert_offset: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.num_global_experts = num_experts if num_global_experts is None else num_global_experts
        self.expert_offset = expert_offset
        if not 0 <= expert_offset <= self.num_global_experts - num_experts:
            raise ValueError(f"GroupedExperts: experts [{expert_offset}, {expert_offset + num_experts})"
                             f" do not fit in {self.num_global_experts} global experts")
        kw = {"device": device, "dtype": dtype}
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn, **kw))
        self.grouped_mm = grouped_mm
        self.swiglu = swiglu

    def forward(self, x_TD: torch.Tensor, offs_E: torch.Tensor, *,
                end: int | None = None) -> torch.Tensor:
        """`end`: offs_E[-1] when the caller knows it on the host (the dispatchers do), so the
        grouped GEMMs never wait for the GPU (`workbench.model.grouped`)."""
        mm = self.grouped_mm
        h_TF = self.swiglu(mm(x_TD, self.w1, offs_E, end=end), mm(x_TD, self.w3, offs_E, end=end))
        return mm(h_TF, self.w2, offs_E, end=end)

    @torch.no_grad()
    def narrow_(self, expert_offset: int, num_experts: int) -> None:
        """Keep only global experts [expert_offset, expert_offset + num_experts) (EP sharding).

        Replaces the parameters, so call it before building the optimizer."""
        start = expert_offset - self.expert_offset
        if start < 0 or start + num_experts > self.num_experts:
            raise ValueError(f"GroupedExperts holds experts [{self.expert_offset}, "
                             f"{self.expert_offset + self.num_experts}); cannot narrow to "
                             f"[{expert_offset}, {expert_offset + num_experts})")
        for name in ("w1", "w3", "w2"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old[start:start + num_experts].clone(),
                                             requires_grad=old.requires_grad))
        self.expert_offset, self.num_experts = expert_offset, num_experts

    def extra_repr(self) -> str:
        E, F_, D = self.w1.shape
        return (f"experts={E} (global {self.expert_offset}..{self.expert_offset + E - 1} of "
                f"{self.num_global_experts}), hidden={D}, ffn={F_}")
