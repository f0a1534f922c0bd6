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
        return e8m0_exponents(q.scale.to(torch.int32))
    s = block_scales(q)
    e = torch.floor(torch.log2(s.abs())).nan_to_num(nan=1000.0, neginf=-1000.0, posinf=1000.0)
    return e.to(torch.int32)


def e8m0_exponents(b: torch.Tensor) -> torch.Tensor:
    """``scale_exponents`` of E8M0 bytes ``b`` (integers): the byte minus 127, NaN (255) 1000."""
    return torch.where(b == 255, 1000, b - 127)


def _nibble_lut(pred, device) -> torch.Tensor:
    """[256] int64: how many of the two FP4 codes in each byte satisfy ``pred``."""
    b = torch.arange(256)
    return (pred(b & 0xF).long() + pred(b >> 4).long()).to(device)


def zero_code_fraction(q: QuantizedTensor) -> float:
    spec = format_spec(q.fmt)
    data = q.data.view(torch.uint8).reshape(-1)
    # a histogram of bytes, then a per-byte count: one pass, no unpacked copy
    counts = torch.bincount(data, minlength=256)
    if spec.packed:
        zeros = (counts * _nibble_lut(lambda c: c & 0x7 == 0, counts.device)).sum()
        return float(zeros) / (2 * data.numel())
    return float(counts[0] + counts[0x80]) / data.numel()


def at_max_code(q: QuantizedTensor) -> torch.Tensor:
    """Elements whose stored code is the format's largest magnitude, ``[..., padded K]``."""
    spec = format_spec(q.fmt)
    if spec.packed:
        return (unpack_fp4(q.data) & 0x7) == 0x7
    return q.data.float().abs() == spec.elem_max


def clip_fraction(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor) -> float:
    """Fraction of elements clipped at the format maximum: stored at the largest code while the
    reference is larger in magnitude. Read from the codes, so no float rounding of
    ``elem_max * scale`` decides borderline elements; blocks whose amax is clearly below that
    limit are skipped first (RCEIL-style rules never clip, so usually all of them)."""
    spec = format_spec(q.fmt)
    k = w.shape[-1]
    limit = block_scales(q) * spec.elem_max
    wk = w.float()
    if wk.shape[-1] != q.padded_k:
        wk = torch.nn.functional.pad(wk, (0, q.padded_k - k))
    amax = wk.reshape(*wk.shape[:-1], -1, spec.block).abs().amax(-1)
    if not bool((amax >= limit * (1 - 1e-5)).any()):
        return 0.0
    sat = at_max_code(q)[..., :k]
    # an exact integer count over the element count: an fp32 mean's last bit depends on how a
    # device reduces and divides (CUDA's mean multiplies by 1/n), a count ratio does not
    return count_ratio((sat & (w.float().abs() > deq.float().abs())).sum(), sat.numel())


def count_ratio(count, n: int) -> float:
    """``count / n`` of an integer count (a tensor or int) in float64: the same number on every
    device and path (NaN for n == 0, as the mean of nothing)."""
    return int(count) / n if n else math.nan


def error_metrics(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor | None) -> dict[str, float]:
    """One table row's metrics. ``q`` may be None (no grid): clip/zero fractions are NaN.

    Sums are fp32 dot products (vectorised BLAS, accumulated in fp32): one pass each, no squared
    temporaries."""
    ref, out = w.float().reshape(-1), deq.float().reshape(-1)
    err = out - ref
    inf = float("inf")
    return metrics_from_sums(
        float(torch.dot(ref, ref)), float(torch.dot(err, err)), float(torch.dot(ref, out)),
        float(torch.dot(out, out)),
        float(torch.linalg.vector_norm(err, inf)) if err.numel() else 0.0,
        float(torch.linalg.vector_norm(ref, inf)) if ref.numel() else 0.0,
        clip_frac=clip_fraction(w, deq, q) if q is not None else math.nan,
        zero_frac=zero_code_fraction(q) if q is not None else math.nan)


def metrics_from_sums(sig: float, noise: float, cross: float, energy: float, max_abs_err: float,
                      amax: float, *, clip_frac: float, zero_frac: float) -> dict[str, float]:
    """The row from its sums (sum ref^2, err^2, ref*out, out^2) and maxima: the one place the
    formulas live, shared by the reference above and the fused path (``fused.py``)."""
    norm_ref, norm_out = math.sqrt(sig), math.sqrt(energy)
    return {
        "rel_err": math.sqrt(noise) / norm_ref if norm_ref else (0.0 if noise == 0 else math.inf),
        "sqnr_db": _db(sig, noise),
        "max_abs_err": max_abs_err,
        "cosine": cross / (norm_ref * norm_out) if norm_ref and norm_out else
        (1.0 if norm_ref == norm_out else 0.0),
        "amax": amax,
        "clip_frac": clip_frac,
        "zero_frac": zero_frac,
    }


def _db(sig: float, noise: float) -> float:
    """10 log10(sig / noise): +inf without noise, -inf for noise on a zero (or vanishing)
    signal, NaN when either sum is NaN (a NaN or Inf among the values summed)."""
    if not noise:
        return math.inf
    ratio = sig / noise
    return 10 * math.log10(ratio) if ratio > 0 else (-math.inf if ratio == 0 else math.nan)


def nonfinite_rows(df):
    """Boolean mask of table rows whose sums met a NaN or Inf: SQNR NaN or -inf. Any
    non-finite value among a weight's inputs makes its noise sum NaN or +inf, and so does
    nothing else but an fp32 overflow of the sums or a zero reference with nonzero error;
    those rows are then counted exactly (``tables``), where they give 0."""
    s = df["sqnr_db"].astype(float)
    return s.isna() | (s == -math.inf)


def count_nonfinite(*tensors: torch.Tensor) -> int:
    """Elements that are NaN or +-Inf in any of the same-shape ``tensors`` (each counted
    once)."""
    bad = None
    for t in tensors:
        b = ~torch.isfinite(t)
        bad = b if bad is None else bad | b
    return int(bad.sum()) if bad is not None else 0


def grid_mismatch(a: QuantizedTensor, b: QuantizedTensor) -> dict[str, float]:
    """How two grids of the same weight differ: fraction of blocks whose scale differs, and of
    elements whose code differs (question 3: does the stored rule equal a recipe?).
    +0 and -0 count as the same code: libraries disagree on which they write."""
    sa, sb = a.scale.view(torch.uint8), b.scale.view(torch.uint8)
    if sa.shape != sb.shape:
        raise ValueError(f"grids differ in block layout: {tuple(sa.shape)} vs {tuple(sb.shape)}")
    da, db = a.data.view(torch.uint8).reshape(-1), b.data.view(torch.uint8).reshape(-1)
    diff = da != db  # only bytes that differ need a closer look
    xa, xb = da[diff], db[diff]
    if format_spec(a.fmt).packed:
        ca, cb = unpack_fp4(xa), unpack_fp4(xb)
        ca, cb = torch.where(ca & 0x7 == 0, 0, ca), torch.where(cb & 0x7 == 0, 0, cb)
        n_diff, n = int((ca != cb).sum()), 2 * da.numel()
    else:
        n_diff, n = int(((xa & 0x7F) != 0).logical_or((xb & 0x7F) != 0).sum()), da.numel()
    scale_diff = count_ratio((sa != sb).sum(), sa.numel())
    if a.global_scale is not None and b.global_scale is not None and \
            not torch.equal(a.global_scale.float(), b.global_scale.float()):
        scale_diff = 1.0  # every block's effective scale changes with the global
    return {"scale_mismatch_frac": scale_diff, "code_mismatch_frac": n_diff / n if n else 0.0}
