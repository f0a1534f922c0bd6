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

A SwiGLU expert multiplies the same activations by w1 and by w3: the second call reuses the first
call's fake-quantized activations (`_shared_act_fq`) instead of quantizing the same tensor
again, one full read and write of the activations less per layer. Both GEMMs then hang off one
STE node, whose two incoming gradients autograd sums before they pass to x: the same sum, in the
same order, as when each STE passed its own gradient to x.
"""

from __future__ import annotations

import weakref

import torch

from workbench.formats import Recipe, parse_recipe
from workbench.model import grouped as plain
from workbench.qat.ste import fake_quant_ste


def grouped_mm(x_TI: torch.Tensor, w_EOI: torch.Tensor, offs: torch.Tensor, *,
               weight: object = None, act: object = None, end: int | None = None) -> torch.Tensor:
    """`workbench.model.grouped.grouped_mm` on fake-quantized operands: the weights per expert
    along I (``weight``), the activations in blocks along I (``act``); either may be None.
    ``end``: offs[-1] when the caller knows it (no host wait, see the plain function)."""
    plain.check(x_TI, w_EOI, offs)  # shape errors name grouped_mm, before fake quantization
    # Fake quantization is queued before the plain GEMM reads the group ends on the host (on
    # CUDA that read waits for the GPU), so the launches run while the host waits.
    dt = _gemm_dtype(x_TI)
    if weight is not None:
        w_EOI = fake_quant_ste(w_EOI, parse_recipe(weight), per_leading=True,
                               out_dtype=_narrowing(w_EOI, dt))
    if act is not None:
        x_TI = _shared_act_fq(x_TI, parse_recipe(act), _narrowing(x_TI, dt))
    return plain.grouped_mm(x_TI, w_EOI, offs, end=end)


def _gemm_dtype(x_TI: torch.Tensor) -> torch.dtype | None:
    """The dtype the plain GEMM casts its operands to: the autocast dtype on CUDA, else none."""
    if x_TI.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _narrowing(t: torch.Tensor, dt: torch.dtype | None) -> torch.dtype | None:
    # fp32 masters under autocast: the fake quantization writes the GEMM's bf16 operand itself
    # (the same bits as the cast after it, one pass less over the fp32 tensor)
    return dt if dt is not None and t.dtype == torch.float32 and dt != t.dtype else None


# The last activation quantized: (weakref to x, x's signature, recipe, grad mode, the output).
# One slot is enough: w1 and w3 take the same x back to back. The output is held strongly but
# only while x lives (a finalizer on x empties the slot), so it never outlives its input. (The
# experts' input is never a leaf; a leaf x that requires grad is kept alive by the output's graph,
# so there the slot lasts until the next activation is quantized: one tensor at most.)
_LAST_ACT: list[tuple] = []


def _act_signature(x: torch.Tensor) -> tuple:
    return (x._version, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device)


def _clear_slot(ref: weakref.ref) -> None:
    if _LAST_ACT and _LAST_ACT[0][0] is ref:
        _LAST_ACT.clear()


def _shared_act_fq(x: torch.Tensor, recipe: Recipe,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fake_quant_ste(x, recipe, out_dtype=...)`, reused for the same tensor, unchanged (same
    version), the same recipe and output dtype, and the same grad mode (an output made under
    no_grad has no graph to reuse)."""
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return fake_quant_ste(x, recipe, out_dtype=out_dtype)
    sig = (_act_signature(x), recipe, out_dtype, torch.is_grad_enabled())
    if _LAST_ACT:
        ref, last_sig, out = _LAST_ACT[0]
        if ref() is x and last_sig == sig:
            return out
    out = fake_quant_ste(x, recipe, out_dtype=out_dtype)
    ref = weakref.ref(x)
    _LAST_ACT[:] = [(ref, sig, out)]
    weakref.finalize(x, _clear_slot, ref)
    return out
