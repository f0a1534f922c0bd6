"""The fake-quantizing grouped GEMMs that QAT installs as `GroupedExperts`' seam.

Legend: T tokens (rows, sorted by expert), I reduction dim, O output dim, E experts, D hidden,
F expert FFN.

`grouped_mm(x_TI, w_EOI, offs_E, weight=..., act=...)` is one GEMM on fake-quantized operands:
for expert e, rows offs[e-1]:offs[e] of Q(x) times Q(w[e]).T (Linear convention, as
`workbench.model.grouped.grouped_mm`; rows at or past offs[-1] are zero). With ``weight`` /
``act`` recipes (``workbench.formats.Recipe`` or ``"mxfp4:rceil"``-style strings) the weights are
fake-quantized per expert along I (one NVFP4 per-tensor scale per expert) and the activations in
blocks along I, both with a straight-through estimator.
What the backward sees: dx = dy @ Q(w) (the quantized weights), dw = dy^T @ Q(x) (the quantized
activations), and dy itself stays BF16. That is the forward graph differentiated with identity
STEs: the deployed model runs Q(w) and Q(x), so their gradients are taken at the quantized
point; quantizing dy (as real MX training recipes do, along other axes) would emulate a
low-precision *training* backward, which fake-quant QAT for low-precision *inference* does not
aim at.

`QATExpertGemms` is the seam (`workbench.model.experts.ExpertGemms`) built from those operands:
- `gate_up(x, w1, w3)` quantizes x once and feeds the one quantized tensor to both GEMMs (one
  full read and write of the activations less per layer than quantizing it per GEMM). Both GEMMs
  hang off one STE node, whose two incoming gradients autograd sums before they pass to x: the
  same sum, in the same order, as when each GEMM's STE passed its own gradient to x.
- `down(g, u, w2, act=...)`: for the plain SwiGLU (`act is swiglu`) on a GPU with an MX
  activation recipe, Q(silu(g) * u) comes from one Triton pass
  (`workbench.kernels.silu_mul_fake_quantize`: the same bits as the unfused ops); neither
  silu(g) nor the product is written. Its backward is one pass too (`silu_mul_backward`: the
  bits of the unfused graph's STE identity, the multiply's two products and
  `aten.silu_backward`), and it saves g and u only (the unfused graph also keeps silu(g)).
  Elsewhere (CPU, NVFP4 activations, other activations, torch.compile traces) it applies `act`
  and quantizes the result.
The weights arrive by role (w1, w3, w2), so each one's recipe and parameter name are fixed at
`prepare`; an NVFP4 stack's per-expert amax comes from the trainer's `QATState` when it holds one
for these very values (`workbench.qat.state`), else from one pass here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from workbench import kernels
from workbench.formats import Recipe, format_spec, parse_recipe
from workbench.model import grouped as plain
from workbench.model.experts import Activation, ExpertGemms, swiglu
from workbench.qat.state import QATState
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
        w_EOI = _weight_fq(w_EOI, parse_recipe(weight), dt)
    if act is not None:
        x_TI = _act_fq(x_TI, parse_recipe(act), dt)
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


def _weight_fq(w: torch.Tensor, recipe: Recipe, dt: torch.dtype | None,
               amax: torch.Tensor | None = None) -> torch.Tensor:
    return fake_quant_ste(w, recipe, per_leading=True, out_dtype=_narrowing(w, dt),
                          global_amax=amax)


def _act_fq(x: torch.Tensor, recipe: Recipe, dt: torch.dtype | None) -> torch.Tensor:
    return fake_quant_ste(x, recipe, out_dtype=_narrowing(x, dt))


class QATExpertGemms(ExpertGemms):
    """The seam of one prepared expert layer (see the module doc).

    ``weights``: role (w1, w3, w2) -> weight recipe, None for a weight kept in BF16; ``names``:
    role -> the parameter's name in the model (the amax book's key); ``act``: the activation
    recipe of both GEMM inputs (None: BF16); ``fuse_act``: let `down` fuse SwiGLU with its input
    quantization where a kernel serves it (False: the unfused ops, the same bits, for A/B
    timing); ``state``: the trainer's `QATState` (None: every amax computed here); ``plain``:
    the seam this one replaced, which `unprepare` puts back."""

    def __init__(self, weights: Mapping[str, Recipe | None], names: Mapping[str, str],
                 act: Recipe | None, *, fuse_act: bool = True, state: QATState | None = None,
                 plain: ExpertGemms | None = None) -> None:
        self.weights = dict(weights)
        self.names = dict(names)
        self.act = act
        self.fuse_act = fuse_act
        self.state = state
        self.plain = plain if plain is not None else ExpertGemms()

    def _weight(self, role: str, w: torch.Tensor, dt: torch.dtype | None) -> torch.Tensor:
        recipe = self.weights[role]
        if recipe is None:
            return w
        amax = None
        if self.state is not None and recipe.fmt == "nvfp4":
            amax = self.state.amax(self.names[role], w)
        return _weight_fq(w, recipe, dt, amax)

    def gate_up(self, x_TD: torch.Tensor, w1_EFD: torch.Tensor, w3_EFD: torch.Tensor,
                offs_E: torch.Tensor, *, end: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        plain.check(x_TD, w1_EFD, offs_E)  # shape errors name grouped_mm, before any launch
        plain.check(x_TD, w3_EFD, offs_E)
        dt = _gemm_dtype(x_TD)
        # launch order as one GEMM at a time: w1's quantization, the input's, the GEMM; then w3's
        w1_q = self._weight("w1", w1_EFD, dt)
        x_q = x_TD if self.act is None else _act_fq(x_TD, self.act, dt)  # once, for both
        g_TF = plain.grouped_mm(x_q, w1_q, offs_E, end=end)
        u_TF = plain.grouped_mm(x_q, self._weight("w3", w3_EFD, dt), offs_E, end=end)
        return g_TF, u_TF

    def down(self, g_TF: torch.Tensor, u_TF: torch.Tensor, w2_EDF: torch.Tensor,
             offs_E: torch.Tensor, *, act: Activation, end: int | None = None) -> torch.Tensor:
        fast = _fused_kernels(g_TF, u_TF, self.act) if self.fuse_act and act is swiglu else None
        if fast is not None:
            h_q = _SiluMulFakeQuant.apply(g_TF, u_TF, self.act, fast)  # already Q(silu(g) * u)
        else:
            h_q = act(g_TF, u_TF)
        plain.check(h_q, w2_EDF, offs_E)
        dt = _gemm_dtype(h_q)
        w2_q = self._weight("w2", w2_EDF, dt)
        if fast is None and self.act is not None:
            h_q = _act_fq(h_q, self.act, dt)
        return plain.grouped_mm(h_q, w2_q, offs_E, end=end)

    def __repr__(self) -> str:
        w = ", ".join(f"{r}={self.weights[r] or 'bf16'}" for r in self.weights)
        return (f"QATExpertGemms({w}, act={self.act or 'bf16'}, fuse_act={self.fuse_act}, "
                f"state={'yes' if self.state is not None else 'none'})")


def _fused_kernels(g: torch.Tensor, u: torch.Tensor, recipe: Recipe | None):
    """`workbench.kernels` where the fused SwiGLU serves these operands and recipe, else None
    (not inside torch.compile traces: a Triton launch from an autograd.Function's Python)."""
    if recipe is None or not g.is_cuda or torch.compiler.is_compiling():
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
