"""Routed experts as stacked parameters behind one seam, the expert GEMMs.

Legend: T routed rows (token copies sorted by expert), D hidden, F expert FFN, E local experts.

`w1` (gate) and `w3` (up) are [E, F, D], `w2` (down) is [E, D, F]: Linear convention
[E, out, in], so each block-scaled format blocks the last (reduction) dim of every weight.

The forward reaches the weights only through its seam, `self.gemms` (an `ExpertGemms`), in two
calls: `gate_up(x, w1, w3, ...)`, both GEMMs that read the same input, and `down(g, u, w2, ...,
act=self.act)`, the activation and the GEMM after it. The seam receives each weight by role
(the parameter names `w1`, `w3`, `w2`), so a replacement seam (QAT's, `workbench.qat`) knows which
weight it holds by the call, never by the tensor object: wrappers that swap the registered
parameters (FSDP2 gathers and reshards them) change nothing for it. QAT replaces the attribute on
the instance, never the parameters, so masters, state_dict and optimizer state stay untouched.
The two calls are shaped by what a quantizing seam must do: quantize the input of w1 and w3
once, and fuse the activation with the down projection's input quantization where it can.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workbench.model.grouped import grouped_mm

# The experts' weights by role, in the seam's call order; also their parameter names.
EXPERT_WEIGHTS = ("w1", "w3", "w2")

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(g_TF: torch.Tensor, u_TF: torch.Tensor) -> torch.Tensor:
    """The experts' activation: silu(gate) * up."""
    return F.silu(g_TF) * u_TF


class ExpertGemms:
    """The plain grouped GEMMs of one expert layer: the default seam of `GroupedExperts`.

    A replacement keeps these two signatures; `end` is offs_E[-1] when the caller knows it on the
    host (`workbench.model.grouped`)."""

    def gate_up(self, x_TD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                offs_E: torch.Tensor, *, end: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ w1[e].T, x @ w3[e].T) per expert's rows: the gate and up projections of the same
        input (a quantizing seam quantizes x once for both)."""
        return (grouped_mm(x_TD, w1_EFD, offs_E, end=end),
                grouped_mm(x_TD, w3_EFD, offs_E, end=end))

    def down(self, g_TF: torch.Tensor, u_TF: torch.Tensor, w2_EDF: torch.Tensor,
             offs_E: torch.Tensor, *, act: Activation, end: int | None = None) -> torch.Tensor:
        """act(g, u) @ w2[e].T per expert's rows. `act` is the model's activation (`swiglu`, or
        another family's); a quantizing seam may fuse it with the input quantization of this
        GEMM only when it is `swiglu` itself."""
        return grouped_mm(act(g_TF, u_TF), w2_EDF, offs_E, end=end)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GroupedExperts(nn.Module):
    """SwiGLU experts. Under expert parallelism an instance holds global experts
    [expert_offset, expert_offset + num_experts) of `num_global_experts`.

    `act`: the activation between the projections (`swiglu`); `gemms`: the seam (see the module
    doc), an `ExpertGemms` unless QAT replaced it."""

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
        self.act: Activation = swiglu
        self.gemms: ExpertGemms = ExpertGemms()

    def forward(self, x_TD: torch.Tensor, offs_E: torch.Tensor, *,
                end: int | None = None) -> torch.Tensor:
        """`end`: offs_E[-1] when the caller knows it on the host (the dispatchers do), so the
        grouped GEMMs never wait for the GPU (`workbench.model.grouped`)."""
        g_TF, u_TF = self.gemms.gate_up(x_TD, self.w1, self.w3, offs_E, end=end)
        return self.gemms.down(g_TF, u_TF, self.w2, offs_E, act=self.act, end=end)

    @torch.no_grad()
    def narrow_(self, expert_offset: int, num_experts: int) -> None:
        """Keep only global experts [expert_offset, expert_offset + num_experts) (EP sharding).

        Replaces the parameters, so call it before building the optimizer."""
        start = expert_offset - self.expert_offset
        if start < 0 or start + num_experts > self.num_experts:
            raise ValueError(f"GroupedExperts holds experts [{self.expert_offset}, "
                             f"{self.expert_offset + self.num_experts}); cannot narrow to "
                             f"[{expert_offset}, {expert_offset + num_experts})")
        for name in EXPERT_WEIGHTS:
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old[start:start + num_experts].clone(),
                                             requires_grad=old.requires_grad))
        self.expert_offset, self.num_experts = expert_offset, num_experts

    def extra_repr(self) -> str:
        E, F_, D = self.w1.shape
        return (f"experts={E} (global {self.expert_offset}..{self.expert_offset + E - 1} of "
                f"{self.num_global_experts}), hidden={D}, ffn={F_}, gemms={self.gemms!r}")
