"""CUDA fast path of ``workbench.model.grouped.grouped_mm``: one ``torch._grouped_mm`` launch
(forward, and its autograd backward: dx = dy @ Q(w), dw = dy^T @ Q(x)) instead of a loop of
per-expert matmuls. The fake quantization itself happens before, in ``workbench.qat.ste`` (the
Triton kernels on CUDA), so the numerics are the reference's: same quantized operands, same
products, only the GEMM's accumulation order may differ (fp32 accumulate in both).

Legend: T tokens (rows, sorted by expert), I reduction dim, O output dim, E experts.
"""

from __future__ import annotations

import torch


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: ``torch._grouped_mm``'s backward
    rejects expanded (stride-0) gradients such as the one from ``y.sum()``."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def usable(x_TI: torch.Tensor, w_EOI: torch.Tensor, end: int) -> bool:
    """Whether ``torch._grouped_mm`` can take these operands here (Hopper+, bf16, 16-byte rows)."""
    if not (x_TI.is_cuda and w_EOI.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x_TI.dtype != torch.bfloat16 or w_EOI.dtype != torch.bfloat16 or end == 0:
        return False
    if w_EOI.shape[0] == 0 or x_TI.shape[1] % 8 or w_EOI.shape[1] % 8:
        return False
    return torch.cuda.get_device_capability(x_TI.device) >= (9, 0)


def grouped_mm_cuda(x_TI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor,
                    end: int) -> torch.Tensor:
    """Rows [0, end) through ``torch._grouped_mm``; rows past ``end`` (no expert) are zero, and
    their input gradient is zero (the slice's backward), never the GEMM's uninitialised rows."""
    T = x_TI.shape[0]
    xs_TI = x_TI[:end] if end < T else x_TI
    y_TO = torch._grouped_mm(xs_TI.contiguous(), w_EOI.contiguous().transpose(-2, -1),
                             offs=offs_E)
    y_TO = _ContiguousGrad.apply(y_TO)
    if end < T:
        y_TO = torch.cat([y_TO, y_TO.new_zeros(T - end, y_TO.shape[1])], dim=0)
    return y_TO
