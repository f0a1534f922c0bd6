"""The cast of an fp32 master to bf16 autocast's dtype, with a faster backward.

Under CUDA bf16 autocast a matmul casts its fp32 weight to bf16, and the backward of that cast
widens the bf16 weight gradient back to fp32. torch 2.11 widens through its generic casting
copy kernel, half the bandwidth of the narrowing copy (its share of a step: docs/kernels.md,
"What the trainer's profile showed"). ``autocast_operand``
does the same cast itself, as autocast would (so autocast then leaves the operand alone), and
widens the gradient with ``kernels.cast.widen_bf16``: the same forward and gradient bits, one
vectorised pass. Everywhere else (CPU, no autocast, no gradient, torch.compile traces, dtypes
other than fp32 -> bf16, no Triton) it is the plain ``.to`` or nothing at all.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from workbench.kernels import available
from workbench.kernels.api import _interpret
from workbench.kernels.cast import widen_bf16


class _MasterCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return w.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        if g.dtype == torch.bfloat16 and type(g) is torch.Tensor and g.is_contiguous() \
                and (g.is_cuda or _interpret()):
            return widen_bf16(g)
        return g.to(torch.float32)  # e.g. a non-contiguous gradient: torch's copy


def autocast_operand(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as CUDA autocast would hand it to a matmul: cast to the autocast dtype when autocast
    is on and ``t`` is a CUDA floating tensor, else ``t`` itself. fp32 tensors that need a
    gradient going to bf16 take ``_MasterCast`` (see the module doc)."""
    if t is None or not (t.is_cuda and torch.is_autocast_enabled("cuda")) \
            or not t.is_floating_point():
        return t
    dt = torch.get_autocast_dtype("cuda")
    if (t.dtype == torch.float32 and dt == torch.bfloat16 and t.requires_grad
            and torch.is_grad_enabled() and not isinstance(t, DTensor)
            and not torch.compiler.is_compiling() and available()):
        return _MasterCast.apply(t)
    return t.to(dt)


class Linear(torch.nn.Linear):
    """``nn.Linear`` whose weight (and bias) reach CUDA bf16 autocast through
    ``autocast_operand``: the bits of ``nn.Linear`` everywhere, the weight gradient widened in
    one vectorised pass. Parameters, names and state dicts are ``nn.Linear``'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, autocast_operand(self.weight),
                                          autocast_operand(self.bias))
