"""Per-expert quantization statistics of a prepared model's routed experts, batched per stack.

Legend: E local experts, O out rows, I reduction dim (blocks run along I), L MoE layers.

For every expert stack the QAT seam fake-quantizes (`workbench.qat.grouped.QATExpertGemms`), one
call quantizes the whole [E, O, I] stack with the seam's own recipe and per-expert NVFP4 amax
(`workbench.formats.quantize`, the reference, or on a GPU the Triton codecs with the same bits)
and reduces per expert:

    rel_err     ||Q(w) - w|| / ||w||          sqnr_db   10 log10(sum w^2 / sum (Q(w) - w)^2)
    sat_frac    share of codes at the element format's largest magnitude
    clip_frac   share of elements beyond what their block can hold (|w| > |Q(w)| at such a code)
    amax        max |w|
    codes       the packed codes (uint8 view), for code churn between two records
    scale_exp   histogram of the block-scale exponents (E8M0 byte - 127; log2 of the E4M3 scale)

`w` is the master the seam quantizes (fp32 in the workbench trainer), so these numbers are the
fake quantization the forward pass applied at that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench import kernels
from workbench.formats import Recipe, format_spec, quantize
from workbench.formats.api import dequantize
from workbench.model.experts import GroupedExperts
from workbench.qat.grouped import QATExpertGemms

# The routed experts' parameters and the names checkpoints give them.
PROJ_OF = {"w1": "gate", "w3": "up", "w2": "down"}
EXP_LO, EXP_HI = -127, 127  # the E8M0 exponent range; E4M3 scales fall inside it


@dataclass
class StackStats:
    """Per-expert statistics of one [E, O, I] stack; every tensor has E entries (or E rows)."""

    recipe: Recipe
    rel_err: torch.Tensor
    sqnr_db: torch.Tensor
    sat_frac: torch.Tensor
    clip_frac: torch.Tensor
    amax: torch.Tensor
    codes: torch.Tensor  # [E, n] uint8 (two FP4 codes per byte, one FP8 code per byte)
    scale_hist: torch.Tensor  # [E, EXP_HI - EXP_LO + 1] int64


def _element_codes(q_data: torch.Tensor, packed: bool) -> torch.Tensor:
    """[E, n] codes, one per element: FP4 nibbles unpacked, FP8 bytes as they are."""
    raw = q_data.reshape(q_data.shape[0], -1)
    if raw.dtype != torch.uint8:
        raw = raw.view(torch.uint8)
    if not packed:
        return raw
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(raw.shape[0], -1)


def _scale_exponents(scale: torch.Tensor, kind: str) -> torch.Tensor:
    """[E, blocks] integer exponents of the block scales; NaN / zero scales map outside the
    histogram range and are not counted."""
    s = scale.reshape(scale.shape[0], -1)
    if kind == "e8m0":
        byte = s.view(torch.uint8).to(torch.int64) if s.dtype != torch.uint8 else s.to(torch.int64)
        return torch.where(byte == 255, EXP_HI + 1, byte - 127)
    v = s.float()
    _, exp = torch.frexp(v)
    # frexp gives v = m * 2^exp with m in [0.5, 1): floor(log2 v) = exp - 1.
    return torch.where((v > 0) & torch.isfinite(v), exp.to(torch.int64) - 1, EXP_HI + 1)


@torch.no_grad()
def stack_stats(w_EOI: torch.Tensor, recipe: Recipe) -> StackStats:
    """Statistics of fake-quantizing `w_EOI` as the QAT seam does (NVFP4: one global scale per
    expert, from its own amax)."""
    spec = format_spec(recipe.fmt)
    w = w_EOI.detach()
    E = w.shape[0]
    amax = w.abs().amax(dim=(-2, -1))
    kw = {"global_amax": amax.float().view(E, 1, 1)} if recipe.fmt == "nvfp4" else {}
    if w.is_cuda and kernels.supports(recipe) and kernels.available():
        # The Triton codecs: the same bits as the reference (tested), one pass each.
        q = kernels.quantize(w, recipe, **kw)
        fq = kernels.fake_quantize(w, recipe, **kw)
    else:
        q = quantize(w, recipe, **kw)
        fq = dequantize(q, w.dtype)
    err = (fq - w).double()
    sq_w = w.double().pow(2).sum(dim=(-2, -1))
    sq_e = err.pow(2).sum(dim=(-2, -1))
    rel = (sq_e / sq_w).sqrt()
    sqnr = 10 * torch.log10(sq_w / sq_e)
    codes = _element_codes(q.data, spec.packed)
    if spec.packed:
        sat = (codes & 0x7) == 0x7  # E2M1 magnitude code 7 = 6.0
    else:
        sat = q.data.reshape(E, -1).float().abs() == spec.elem_max
    flat_w, flat_fq = w.reshape(E, -1), fq.reshape(E, -1)
    clip = sat & (flat_w.abs() > flat_fq.abs())
    exps = _scale_exponents(q.scale, spec.scale) - EXP_LO
    bins = EXP_HI - EXP_LO + 1
    keep = (exps >= 0) & (exps < bins)
    hist = torch.zeros(E, bins + 1, dtype=torch.int64, device=w.device)
    hist.scatter_add_(1, torch.where(keep, exps, bins), keep.to(torch.int64))
    n = flat_w.shape[1]
    return StackStats(recipe, rel, sqnr, sat.sum(1).double() / n, clip.sum(1).double() / n,
                      amax.double(), codes if spec.packed else codes.clone(), hist[:, :bins])


def code_churn(prev: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """[E] share of element codes that differ between two records of the same stack."""
    return (prev != codes).sum(1).double() / codes.shape[1]


@dataclass(frozen=True)
class ExpertStack:
    layer: int  # index of the decoder layer
    proj: str  # gate / up / down
    param: nn.Parameter  # under FSDP2 the sharded DTensor of the EP slice's stack
    recipe: Recipe
    expert_offset: int  # global index of the stack's first expert
    module: GroupedExperts


def _seam(module: nn.Module) -> QATExpertGemms | None:
    seam = getattr(module, "gemms", None) if isinstance(module, GroupedExperts) else None
    return seam if isinstance(seam, QATExpertGemms) else None


def quantized_stacks(model: nn.Module) -> list[ExpertStack]:
    """The routed-expert stacks the QAT seam fake-quantizes, in layer order (empty for bf16)."""
    out = []
    for name, mod in model.named_modules():
        seam = _seam(mod)
        if seam is None:
            continue
        layer = int(name.split(".")[2])  # model.layers.{L}.mlp.experts
        for pname, proj in PROJ_OF.items():
            recipe = seam.weights.get(pname)  # by role: the parameter may be FSDP's DTensor
            if recipe is not None:
                out.append(ExpertStack(layer, proj, getattr(mod, pname), recipe,
                                       mod.expert_offset, mod))
    return out


def activation_recipe(module: GroupedExperts) -> Recipe | None:
    seam = _seam(module)
    return seam.act if seam is not None else None
