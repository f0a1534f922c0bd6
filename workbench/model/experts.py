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

Families add two things around the seam, never inside it: `act` is `swiglu` or gpt-oss's
`ClampedSwiGLU`, and optional per-expert biases (gpt-oss) `b1`, `b3` [E, F] and `b2` [E, D] are
added to each routed row's gate, up and down outputs (`add_expert_bias`), so a quantizing seam
sees the same GEMMs for every family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.arch import ExpertConfig
from workbench.model.grouped import grouped_mm

# The experts' weights by role, in the seam's call order; also their parameter names.
EXPERT_WEIGHTS = ("w1", "w3", "w2")
# Their optional per-expert biases (gpt-oss), added outside the seam.
EXPERT_BIASES = ("b1", "b3", "b2")

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(g_TF: torch.Tensor, u_TF: torch.Tensor) -> torch.Tensor:
    """The experts' activation: silu(gate) * up."""
    return F.silu(g_TF) * u_TF


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts._apply_gate`): gate clamped
    above at `limit`, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, g_TF: torch.Tensor, u_TF: torch.Tensor) -> torch.Tensor:
        g_TF = g_TF.clamp(min=None, max=self.limit)
        u_TF = u_TF.clamp(min=-self.limit, max=self.limit)
        return (u_TF + 1) * (g_TF * torch.sigmoid(g_TF * self.alpha))


def activation(cfg: ExpertConfig) -> Activation:
    return swiglu if cfg.activation == "swiglu" else ClampedSwiGLU(cfg.alpha, cfg.limit)


class _ExpertBias(torch.autograd.Function):
    """y[row] + b[expert of row] for rows sorted by expert (rows at or past offs[-1]: + 0).

    The expert of each row comes from `offs` on the device (no host sync). The bias gradient
    is a segment sum of the rows' gradients, a fixed-order reduction, where a scatter-add of
    rows into experts would use atomics on CUDA (docs/determinism.md)."""

    @staticmethod
    def forward(ctx, y_TX, b_EX, offs_E):
        rows = torch.arange(y_TX.shape[0], device=y_TX.device, dtype=offs_E.dtype)
        idx_T = torch.bucketize(rows, offs_E, right=True)  # = E past the last expert
        padded = torch.cat([b_EX, b_EX.new_zeros(1, b_EX.shape[1])]).to(y_TX.dtype)
        ctx.save_for_backward(offs_E)
        ctx.b_dtype = b_EX.dtype
        return y_TX + padded[idx_T]

    @staticmethod
    def backward(ctx, g_TX):
        (offs_E,) = ctx.saved_tensors
        ends = offs_E.to(torch.int64)
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        lengths = torch.cat([counts, g_TX.shape[0] - ends[-1:]])  # the rows past offs[-1] last
        g_b = torch.segment_reduce(g_TX.float(), "sum", lengths=lengths, axis=0, unsafe=True,
                                   initial=0.0)[:-1]
        return g_TX, g_b.to(ctx.b_dtype), None


def add_expert_bias(y_TX: torch.Tensor, b_EX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _ExpertBias.apply(y_TX, b_EX, offs_E)


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
    """Routed experts. Under expert parallelism an instance holds global experts
    [expert_offset, expert_offset + num_experts) of `num_global_experts`.

    `act`: the activation between the projections (`swiglu`, or `ClampedSwiGLU`); `bias`:
    per-expert biases b1, b3, b2 (else None); `gemms`: the seam (see the module doc), an
    `ExpertGemms` unless QAT replaced it."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, num_global_experts: int | None = None,
                 expert_offset: int = 0, bias: bool = False, act: Activation = swiglu,
                 device: torch.device | str | None = None,
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
        if bias:
            self.b1 = nn.Parameter(torch.empty(num_experts, ffn, **kw))
            self.b3 = nn.Parameter(torch.empty(num_experts, ffn, **kw))
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden, **kw))
        else:
            self.b1 = self.b3 = self.b2 = None
        self.act: Activation = act
        self.gemms: ExpertGemms = ExpertGemms()

    def forward(self, x_TD: torch.Tensor, offs_E: torch.Tensor, *,
                end: int | None = None) -> torch.Tensor:
        """`end`: offs_E[-1] when the caller knows it on the host (the dispatchers do), so the
        grouped GEMMs never wait for the GPU (`workbench.model.grouped`)."""
        g_TF, u_TF = self.gemms.gate_up(x_TD, self.w1, self.w3, offs_E, end=end)
        if self.b1 is not None:
            g_TF = add_expert_bias(g_TF, self.b1, offs_E)
            u_TF = add_expert_bias(u_TF, self.b3, offs_E)
        y_TD = self.gemms.down(g_TF, u_TF, self.w2, offs_E, act=self.act, end=end)
        if self.b2 is not None:
            y_TD = add_expert_bias(y_TD, self.b2, offs_E)
        return y_TD

    def expert_params(self) -> list[str]:
        """Names of the per-expert parameters (first dim = expert): the weights, then the biases
        this module has."""
        return [*EXPERT_WEIGHTS, *(n for n in EXPERT_BIASES if getattr(self, n) is not None)]

    @torch.no_grad()
    def narrow_(self, expert_offset: int, num_experts: int) -> None:
        """Keep only global experts [expert_offset, expert_offset + num_experts) (EP sharding).

        Replaces the parameters, so call it before building the optimizer."""
        start = expert_offset - self.expert_offset
        if start < 0 or start + num_experts > self.num_experts:
            raise ValueError(f"GroupedExperts holds experts [{self.expert_offset}, "
                             f"{self.expert_offset + self.num_experts}); cannot narrow to "
                             f"[{expert_offset}, {expert_offset + num_experts})")
        for name in self.expert_params():
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old[start:start + num_experts].clone(),
                                             requires_grad=old.requires_grad))
        self.expert_offset, self.num_experts = expert_offset, num_experts

    def extra_repr(self) -> str:
        E, F_, D = self.w1.shape
        act = "swiglu" if self.act is swiglu else repr(self.act)
        return (f"experts={E} (global {self.expert_offset}..{self.expert_offset + E - 1} of "
                f"{self.num_global_experts}), hidden={D}, ffn={F_}, act={act}"
                + (", bias" if self.b1 is not None else "") + f", gemms={self.gemms!r}")
