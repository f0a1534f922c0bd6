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

`swiglu(g, u, act=...)` is the QAT side of the experts' SwiGLU seam. On a GPU, for MX activation
recipes, it returns the down projection's fake-quantized operand Q(silu(g) * u) from one Triton
pass (`workbench.kernels.silu_mul_fake_quantize`: the same bits as the unfused ops) and marks it
as already quantized, so the down projection's `grouped_mm` takes it as it is; neither silu(g)
nor the product is written. Its backward is one pass too (`silu_mul_backward`: the bits of the
unfused graph's STE identity, the multiply's two products and `aten.silu_backward`), and it
saves g and u only (the unfused graph also keeps silu(g)).
Elsewhere (CPU, NVFP4 activations, torch.compile traces) it is the plain SwiGLU and the down
projection quantizes as before.
"""

from __future__ import annotations

import weakref

import torch

from workbench import kernels
from workbench.formats import Recipe, format_spec, parse_recipe
from workbench.model import grouped as plain
from workbench.model.experts import swiglu as plain_swiglu
from workbench.qat.ste import fake_quant_ste, hooked


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
            return x if out is None else out  # None: x is itself that fake quantization
    out = fake_quant_ste(x, recipe, out_dtype=out_dtype)
    _remember(x, sig, out)
    return out


def _remember(x: torch.Tensor, sig: tuple, out: torch.Tensor | None) -> None:
    ref = weakref.ref(x)
    _LAST_ACT[:] = [(ref, sig, out)]
    weakref.finalize(x, _clear_slot, ref)


def swiglu(g_TF: torch.Tensor, u_TF: torch.Tensor, *, act: object = None) -> torch.Tensor:
    """The experts' SwiGLU ``silu(g) * u``; with ``act`` (the down projection's activation
    recipe), where a fused kernel serves it, already fake-quantized with that recipe (see the
    module doc). The down projection's ``grouped_mm(..., act=act)`` recognises the result."""
    recipe = None if act is None else parse_recipe(act)
    fast = _fused_kernels(g_TF, u_TF, recipe)
    if fast is None:
        return plain_swiglu(g_TF, u_TF)
    q = _SiluMulFakeQuant.apply(g_TF, u_TF, recipe, fast)
    # what `_shared_act_fq(q, recipe)` will ask for from the down projection (bf16 q: no
    # narrowing), answered by q itself
    _remember(q, (_act_signature(q), recipe, None, torch.is_grad_enabled()), None)
    return q


def _fused_kernels(g: torch.Tensor, u: torch.Tensor, recipe: Recipe | None):
    """`workbench.kernels` where the fused SwiGLU serves these operands and recipe, else None.
    Not inside torch.compile traces or inference mode, where `_shared_act_fq` cannot recognise
    the result (no slot, no version counter) and would quantize it again."""
    if recipe is None or not g.is_cuda or torch.compiler.is_compiling() \
            or torch.is_inference_mode_enabled():
        return None
    if g.dtype != torch.bfloat16 or u.dtype != torch.bfloat16 or g.shape != u.shape \
            or g.dim() != 2 or format_spec(recipe.fmt).scale != "e8m0" \
            or g.shape[1] % format_spec(recipe.fmt).block:
        return None
    return kernels if kernels.supports(recipe) and kernels.available() else None


class _SiluMulFakeQuant(torch.autograd.Function):
    """Q(silu(g) * u): forward in one kernel, backward in one kernel, both the unfused graph's
    bits (its STE's identity, the multiply's two products, SiluBackward)."""

    @staticmethod
    def forward(ctx, g, u, recipe: Recipe, fast):
        # timed as a fake quantization (its SwiGLU work included)
        q = hooked(lambda: fast.silu_mul_fake_quantize(g, u, recipe), g)
        ctx.save_for_backward(g, u)  # silu(g) is recomputed, not kept: one tensor less saved
        ctx.fast = fast
        return q

    @staticmethod
    def backward(ctx, dq):
        g, u = ctx.saved_tensors
        dg, du = ctx.fast.silu_mul_backward(dq, g, u)
        return (dg if ctx.needs_input_grad[0] else None,
                du if ctx.needs_input_grad[1] else None, None, None)
