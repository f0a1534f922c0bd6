"""Error metrics of one quantized weight against its reference, in plain torch.

All metrics are computed in fp32 from a reference ``w`` and the decoded ``deq``; the grid
(``QuantizedTensor``) supplies what only the stored codes know: zero codes, block scales and
hence which reference elements exceed the largest value their block can represent (clipped).
"""

from __future__ import annotations

import math

import torch

from workbench.formats import QuantizedTensor, format_spec
from workbench.formats.elements import unpack_fp4

METRICS = ("rel_err", "sqnr_db", "max_abs_err", "cosine", "clip_frac", "zero_frac", "amax")


def block_scales(q: QuantizedTensor) -> torch.Tensor:
    """Effective fp32 scale of every block, ``[..., K/B]`` (MX: 2^(b-127); NVFP4: s * global)."""
    if format_spec(q.fmt).scale == "e8m0":
        b = q.scale.to(torch.int32)
        return torch.where(b == 255, float("nan"), torch.exp2((b - 127).float()))
    gs = q.global_scale.float()
    return q.scale.float() * (gs if gs.dim() == 0 else gs.reshape(*gs.shape[:-1], 1))


def scale_exponents(q: QuantizedTensor) -> torch.Tensor:
    """Integer exponent of each block scale (log2, floored); zero-scale blocks give -1000 (NVFP4
    zero blocks) and NaN scales give 1000, so a histogram keeps them apart."""
    if format_spec(q.fmt).scale == "e8m0":
        b = q.scale.to(torch.int32)
        return torch.where(b == 255, 1000, b - 127)
    s = block_scales(q)
    e = torch.floor(torch.log2(s.abs())).nan_to_num(nan=1000.0, neginf=-1000.0, posinf=1000.0)
    return e.to(torch.int32)


def zero_code_fraction(q: QuantizedTensor) -> float:
    spec = format_spec(q.fmt)
    if spec.packed:
        codes = unpack_fp4(q.data) & 0x7
        return float((codes == 0).float().mean())
    return float((q.data.float() == 0).float().mean())


def at_max_code(q: QuantizedTensor) -> torch.Tensor:
    """Elements whose stored code is the format's largest magnitude, ``[..., padded K]``."""
    spec = format_spec(q.fmt)
    if spec.packed:
        return (unpack_fp4(q.data) & 0x7) == 0x7
    return q.data.float().abs() == spec.elem_max


def clip_fraction(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor) -> float:
    """Fraction of elements clipped at the format maximum: stored at the largest code while the
    reference is larger in magnitude. Read from the codes, so no float rounding of
    ``elem_max * scale`` decides borderline elements."""
    k = w.shape[-1]
    sat = at_max_code(q)[..., :k]
    return float((sat & (w.float().abs() > deq.float().abs())).float().mean())


def error_metrics(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor | None) -> dict[str, float]:
    """One table row's metrics. ``q`` may be None (no grid): clip/zero fractions are NaN."""
    ref, out = w.float(), deq.float()
    err = out - ref
    sig = float(ref.square().sum())
    noise = float(err.square().sum())
    norm_ref, norm_out = math.sqrt(sig), float(out.norm())
    row = {
        "rel_err": math.sqrt(noise) / norm_ref if norm_ref else (0.0 if noise == 0 else math.inf),
        "sqnr_db": 10 * math.log10(sig / noise) if noise else math.inf,
        "max_abs_err": float(err.abs().max()) if err.numel() else 0.0,
        "cosine": float((ref * out).sum()) / (norm_ref * norm_out) if norm_ref and norm_out else
        (1.0 if norm_ref == norm_out else 0.0),
        "amax": float(ref.abs().max()) if ref.numel() else 0.0,
        "clip_frac": clip_fraction(ref, out, q) if q is not None else math.nan,
        "zero_frac": zero_code_fraction(q) if q is not None else math.nan,
    }
    return row


def grid_mismatch(a: QuantizedTensor, b: QuantizedTensor) -> dict[str, float]:
    """How two grids of the same weight differ: fraction of blocks whose scale differs, and of
    elements whose code differs (question 3: does the stored rule equal a recipe?)."""
    sa, sb = a.scale.view(torch.uint8), b.scale.view(torch.uint8)
    if sa.shape != sb.shape:
        raise ValueError(f"grids differ in block layout: {tuple(sa.shape)} vs {tuple(sb.shape)}")
    if format_spec(a.fmt).packed:
        ca, cb = unpack_fp4(a.data), unpack_fp4(b.data)
        # +0 and -0 (0x0 / 0x8) are the same value; libraries disagree on which they write
        ca, cb = torch.where(ca & 0x7 == 0, 0, ca), torch.where(cb & 0x7 == 0, 0, cb)
    else:
        ca, cb = a.data.float(), b.data.float()  # value compare: -0.0 == +0.0
    scale_diff = (sa != sb).float().mean()
    if a.global_scale is not None and b.global_scale is not None and \
            not torch.equal(a.global_scale.float(), b.global_scale.float()):
        scale_diff = torch.ones(())  # every block's effective scale changes with the global
    return {"scale_mismatch_frac": float(scale_diff), "code_mismatch_frac": float((ca != cb).float().mean())}
