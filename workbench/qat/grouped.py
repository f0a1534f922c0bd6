"""The fake-quantizing grouped GEMM that QAT installs in `GroupedExperts`' seam.

Legend: T tokens (rows, sorted by expert), I reduction dim, O output dim, E experts.

`grouped_mm(x_TI, w_EOI, offs_E)` computes, for expert e, rows offs[e-1]:offs[e] of x times
w[e].T (Linear convention, like `torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`).
Rows at or past offs[-1] are outputs of no expert: they are zero here.

With ``weight`` / ``act`` recipes (``workbench.formats.Recipe`` or ``"mxfp4:rceil"``-style
strings) the weights are fake-quantized per expert along I (one NVFP4 per-tensor scale per
expert) and the activations in blocks along I, both with a straight-through estimator.
What the backward sees: dx = dy @ Q(w) (the quantized weights), dw = dy^T @ Q(x) (the quantized
activations), and dy itself stays BF16. That is the forward graph differentiated with identity
STEs: the deployed model runs Q(w) and Q(x), so their gradients are taken at the quantized
point; quantizing dy (as real MX training recipes do, along other axes) would emulate a
low-precision *training* backward, which fake-quant QAT for low-precision *inference* does not
aim at.
"""

from __future__ import annotations

import torch

from workbench.formats import parse_recipe
from workbench.model import grouped as plain
from workbench.qat.ste import fake_quant_ste


def grouped_mm(x_TI: torch.Tensor, w_EOI: torch.Tensor, offs: torch.Tensor, *,
               weight: object = None, act: object = None) -> torch.Tensor:
    """`workbench.model.grouped.grouped_mm` on fake-quantized operands: the weights per expert
    along I (``weight``), the activations in blocks along I (``act``); either may be None."""
    plain.check(x_TI, w_EOI, offs)  # shape errors name grouped_mm, before fake quantization
    # Fake quantization is queued before the plain GEMM reads the group ends on the host (on
    # CUDA that read waits for the GPU), so the launches run while the host waits.
    if weight is not None:
        w_EOI = fake_quant_ste(w_EOI, parse_recipe(weight), per_leading=True)
    if act is not None:
        x_TI = fake_quant_ste(x_TI, parse_recipe(act))
    return plain.grouped_mm(x_TI, w_EOI, offs)
