"""The plain grouped GEMM that `GroupedExperts`' seam (`experts.ExpertGemms`) calls (no quantization).

Legend: T tokens (rows, sorted by expert), I reduction dim, O output dim, E experts.

`grouped_mm(x_TI, w_EOI, offs_E)` computes, for expert e, rows offs[e-1]:offs[e] of x times
w[e].T (Linear convention, like `torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`).
Rows at or past offs[-1] are outputs of no expert: they are zero here.

The model owns this function; `workbench.qat` replaces the experts' seam from outside with one
that fake-quantizes the operands and then calls this one.

`end`: offs[-1], when the caller knows it on the host. The dispatchers do: offs is the cumsum of
the routed counts and they pass exactly the routed rows, so it is the row count. Given, the CUDA
path never reads offs on the host, and the host never waits for the GPU in the layer: without it,
each call's `offs.tolist()` drained the queue, so every kernel after it (the next fake
quantization, the next GEMM) started only after the host had launched it, leaving the GPU idle
for a visible share of the layer step (docs/kernels.md, "What the trainer's profile showed";
`jobs/bench_qat_moe.py --breakdown`). A wrong `end` is caught on the device (`torch._assert_async`), and on CPU, where
the offsets are read and validated anyway, by a ValueError.
"""

from __future__ import annotations

import torch

from workbench.kernels import grouped as fast
from workbench.model.cast import autocast_operand


def check(x_TI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> None:
    if x_TI.dim() != 2 or w_EOI.dim() != 3:
        raise ValueError(f"grouped_mm expects x [T, I] and w [E, O, I], got {tuple(x_TI.shape)} "
                         f"and {tuple(w_EOI.shape)}")
    if x_TI.shape[1] != w_EOI.shape[2]:
        raise ValueError(f"grouped_mm reduction dims differ: x has I={x_TI.shape[1]}, "
                         f"w has I={w_EOI.shape[2]}")
    if offs_E.dim() != 1 or offs_E.shape[0] != w_EOI.shape[0]:
        raise ValueError(f"grouped_mm offs must be [E={w_EOI.shape[0]}], got {tuple(offs_E.shape)}")
    if offs_E.dtype != torch.int32:
        raise TypeError(f"grouped_mm offs must be int32 (as torch._grouped_mm), got {offs_E.dtype}")


def _ends(x_TI: torch.Tensor, offs_E: torch.Tensor) -> list[int]:
    """The group ends on the host, validated. On CUDA `tolist` waits for the GPU, so callers
    queue the fake-quant launches first: they run while the host waits, instead of after."""
    ends = offs_E.tolist()
    prev = 0
    for e, end in enumerate(ends):
        if end < prev:
            raise ValueError(f"grouped_mm offs must be non-decreasing, offs[{e}]={end} < {prev}")
        prev = end
    if prev > x_TI.shape[0]:
        raise ValueError(f"grouped_mm offs[-1]={prev} exceeds the {x_TI.shape[0]} rows of x")
    return ends


def grouped_mm(x_TI: torch.Tensor, w_EOI: torch.Tensor, offs: torch.Tensor, *,
               end: int | None = None) -> torch.Tensor:
    """Per-expert `x[rows of e] @ w[e].T`; differentiable in x and w; empty groups allowed.
    `end`: offs[-1] if the caller knows it (see the module doc)."""
    check(x_TI, w_EOI, offs)
    if end is not None and not 0 <= end <= x_TI.shape[0]:
        raise ValueError(f"grouped_mm end={end} is outside the {x_TI.shape[0]} rows of x")
    if x_TI.is_cuda and torch.is_autocast_enabled("cuda"):
        # fp32 masters under bf16 autocast: cast as autocast would for a matmul, so the grouped
        # kernel can take them. After fake quantization: MX values (element x power of two) are
        # exact in bf16; NVFP4's are not (the fp32 per-tensor global scale gives them up to 24
        # significant bits, and ~93% round here), the same rounding as a bf16 fake quantization
        # (torchao's QAT alike) and at most half a bf16 ulp from the deployed fp32 dequant
        dt = torch.get_autocast_dtype("cuda")
        # (the weight through autocast_operand: the same bits, its gradient widened in one pass)
        x_TI, w_EOI = x_TI.to(dt), autocast_operand(w_EOI)
    if x_TI.is_cuda and end is not None and fast.usable(x_TI, w_EOI, end):
        if w_EOI.shape[0]:
            torch._assert_async(offs[-1] == end, "grouped_mm: offs[-1] != end")
        return fast.grouped_mm_cuda(x_TI, w_EOI, offs, end)
    ends = _ends(x_TI, offs)
    last = ends[-1] if ends else 0
    if end is not None and last != end:
        raise ValueError(f"grouped_mm end={end} but offs ends at {last}")
    if x_TI.is_cuda and fast.usable(x_TI, w_EOI, last):
        return fast.grouped_mm_cuda(x_TI, w_EOI, offs, last)
    # A loop over experts is the readable reference and is exact on CPU. torch._grouped_mm runs
    # on CPU in torch 2.13 but its backward rejects expanded (stride-0) gradients such as the
    # one from `y.sum()`, and it leaves rows past offs[-1] uninitialised.
    # split/unbind (not x[a:b] / w[e]): their backward is one concatenation, whereas per-expert
    # slicing materialises a full-size zero gradient per expert (quadratic in E: 22x slower
    # backward at E=128 on CPU, measured by the model work).
    start, counts = 0, []
    for stop in ends:
        counts.append(stop - start)
        start = stop
    tail = x_TI.shape[0] - start
    if w_EOI.shape[0] == 0:
        return x_TI.new_zeros(x_TI.shape[0], w_EOI.shape[1])
    x_parts = x_TI.split(counts + [tail], dim=0)
    pieces_TO = [x_e @ w_e.transpose(0, 1) for x_e, w_e in zip(x_parts, w_EOI.unbind(0))]
    if tail:
        pieces_TO.append(x_TI.new_zeros(tail, w_EOI.shape[1]))
    return torch.cat(pieces_TO, dim=0)
