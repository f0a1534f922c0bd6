"""The reference's per-weight metrics for a stack of same-shape weights ``[E, N, K]`` at once.

``metrics.error_metrics`` and ``metrics.grid_mismatch`` take one 2-D weight; these functions
take E of them stacked and return E rows, so a batch costs one sequence of torch ops (one kernel
launch sequence on CUDA, one OpenMP region per op on CPU) instead of E. They run on any device.

Why the rows equal the reference's:
- quantizing and decoding are the codecs of ``workbench.formats`` on the stack: blocks run along
  the last dim and leading dims are independent, so each expert's codes and scales are the 2-D
  call's. The one per-tensor quantity, NVFP4's global scale, is computed per expert with the
  profile's own amax and global rule and passed in the library's stored form
  (``quantize_stack``), which reproduces the 2-D call bit for bit (tested for every profile);
- counts (zero codes, clipped elements, scale and code mismatches, exponent histograms) are
  integer counts of the same predicates, maxima are order-free: both equal exactly. Fractions
  are exact integer counts over n in float64 on every path (``metrics.count_ratio``), so no
  device's fp32 mean (CUDA multiplies by 1/n) can move their last bit;
- the four float sums (sum ref^2, err^2, ref*out, out^2): on CPU the reference's own fp32 BLAS
  dot per expert, on the same contiguous fp32 vectors, so the same order of summation; on CUDA
  fp32 batched reductions (``vecdot``): same products, another order, so rel_err, sqnr_db and
  cosine agree to about 1e-6 relative there (fp32 accumulation over ~1e6 terms; tests allow
  1e-5). Where products are fp32 subnormals (weights near 2^-70) the order changes the result
  by far more: such weights must not be compared across summation orders.
"""

from __future__ import annotations

import math

import torch

from workbench.formats import QuantizedTensor, Recipe, dequantize, format_spec, quantize
from workbench.formats.nvfp4 import get_profile, quantize_nvfp4_parts

from .metrics import at_max_code, block_scales, count_ratio, metrics_from_sums, scale_exponents

_EXP_SPAN = 4096  # histogram key: expert * span + (exponent + span/2); exponents lie in +-1000


def _pad_k(x: torch.Tensor, block: int) -> torch.Tensor:
    rem = x.shape[-1] % block
    return x if not rem else torch.nn.functional.pad(x, (0, block - rem))


def quantize_stack(w_ENK: torch.Tensor, recipe: Recipe) -> QuantizedTensor:
    """``quantize(w_ENK[e], recipe, pad=True)`` for every e, as one stacked grid.

    MX formats have no per-tensor state, so the stack is one ``quantize`` call. NVFP4 derives a
    global scale from each expert's amax: it is computed here per expert with the profile's own
    ``amax`` and ``global_from_amax`` (in the input dtype where the profile computes statistics
    there, as ``nvfp4._stats`` does) and handed to the codec as the library's stored global."""
    if recipe.fmt != "nvfp4":
        return quantize(w_ENK, recipe, pad=True)
    prof = get_profile(recipe.profile)
    E = w_ENK.shape[0]
    amax = prof.amax(w_ENK.float().reshape(E, -1), -1)
    if prof.stats_in_input_dtype:
        amax = amax.to(w_ENK.dtype)
    g = prof.global_from_amax(amax).float().reshape(E, 1, 1)
    x = _pad_k(w_ENK, format_spec("nvfp4").block)
    parts = quantize_nvfp4_parts(x, recipe.profile, library_global=g)
    return QuantizedTensor("nvfp4", recipe.profile, parts.data, parts.scale, parts.global_scale,
                           tuple(w_ENK.shape), parts.library_global)


def _count_ratios(mask_EM: torch.Tensor) -> list[float]:
    # per expert, the reference's ``metrics.count_ratio``: an exact integer count over n (an fp32
    # mean would depend on the device's reduction and division: CUDA multiplies by 1/n)
    return [count_ratio(c, mask_EM.shape[-1]) for c in mask_EM.sum(-1).tolist()]


def _zero_counts(q: QuantizedTensor) -> tuple[torch.Tensor, int]:
    """Zero codes per expert over the stored (padded) data, and the codes per expert."""
    E = q.data.shape[0]
    d = q.data.view(torch.uint8).reshape(E, -1)
    if format_spec(q.fmt).packed:
        z = ((d & 0x7) == 0).sum(-1) + (((d >> 4) & 0x7) == 0).sum(-1)
        return z, 2 * d.shape[1]
    return ((d == 0) | (d == 0x80)).sum(-1), d.shape[1]


def _clip_fracs(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor) -> list[float]:
    """``metrics.clip_fraction`` per expert: 0 where no block comes near its limit (the
    reference's early exit), else the fp32 mean of at-max codes with |w| > |deq|."""
    spec = format_spec(q.fmt)
    E, k = w.shape[0], w.shape[-1]
    limit = block_scales(q) * spec.elem_max
    wk = _pad_k(w.float(), spec.block) if w.shape[-1] != q.padded_k else w.float()
    amax = wk.reshape(*wk.shape[:-1], -1, spec.block).abs().amax(-1)
    near = (amax >= limit * (1 - 1e-5)).reshape(E, -1).any(-1)
    if not bool(near.any()):
        return [0.0] * E
    sat = at_max_code(q)[..., :k]
    frac = _count_ratios((sat & (w.float().abs() > deq.float().abs())).reshape(E, -1))
    return [f if n else 0.0 for f, n in zip(frac, near.tolist())]


def stack_metrics(w: torch.Tensor, deq: torch.Tensor, q: QuantizedTensor | None) -> list[dict]:
    """``metrics.error_metrics(w[e], deq[e], q[e])`` for every expert e of the stacks."""
    E = w.shape[0]
    ref, out = w.float().reshape(E, -1), deq.float().reshape(E, -1)
    err = out - ref
    if w.device.type == "cpu":
        # the reference's own fp32 BLAS dots, one per expert (a call costs microseconds on CPU):
        # the same order of summation, which matters where products are fp32 subnormals
        sums = torch.tensor([[float(torch.dot(a, b)) for a, b in
                              ((ref[e], ref[e]), (err[e], err[e]), (ref[e], out[e]),
                               (out[e], out[e]))] for e in range(E)], dtype=torch.float64)
    else:  # one batched reduction per sum on the GPU: fp32, another summation order
        sums = torch.stack([torch.linalg.vecdot(ref, ref), torch.linalg.vecdot(err, err),
                            torch.linalg.vecdot(ref, out), torch.linalg.vecdot(out, out)], -1)
    maxs = torch.stack([err.abs().amax(-1), ref.abs().amax(-1)], -1) if ref.shape[1] else \
        torch.zeros(E, 2, device=w.device)
    if q is not None:
        clip = _clip_fracs(w, deq, q)
        zeros, n = _zero_counts(q)
        zero = [int(z) / n for z in zeros.tolist()]
    else:
        clip = zero = [math.nan] * E
    rows = []
    for s, m, c, z in zip(sums.tolist(), maxs.tolist(), clip, zero):
        rows.append(metrics_from_sums(*s, *m, clip_frac=c, zero_frac=z))
    return rows


def code_mismatch_counts(da_EN: torch.Tensor, db_EN: torch.Tensor, packed: bool) -> torch.Tensor:
    """Per expert, the element codes that differ between two grids' uint8 data [E, N] (packed
    FP4: two codes a byte), +0 and -0 counted equal (as ``metrics.grid_mismatch``)."""
    if packed:
        n_diff = 0
        for shift in (0, 4):
            ca, cb = (da_EN >> shift) & 0xF, (db_EN >> shift) & 0xF
            ca, cb = torch.where(ca & 0x7 == 0, 0, ca), torch.where(cb & 0x7 == 0, 0, cb)
            n_diff = n_diff + (ca != cb).sum(-1)
        return n_diff
    return ((da_EN != db_EN) & (((da_EN & 0x7F) != 0) | ((db_EN & 0x7F) != 0))).sum(-1)


def stack_mismatch(a: QuantizedTensor, b: QuantizedTensor) -> list[dict]:
    """``metrics.grid_mismatch(a[e], b[e])`` for every expert e (+0 and -0 the same code)."""
    E = a.data.shape[0]
    sa, sb = a.scale.view(torch.uint8).reshape(E, -1), b.scale.view(torch.uint8).reshape(E, -1)
    if sa.shape != sb.shape:
        raise ValueError(f"grids differ in block layout: {tuple(a.scale.shape)} vs "
                         f"{tuple(b.scale.shape)}")
    scale_diff = _count_ratios(sa != sb)
    if a.global_scale is not None and b.global_scale is not None:
        ga, gb = a.global_scale.float().reshape(E), b.global_scale.float().reshape(E)
        scale_diff = [1.0 if g else s  # NaN != NaN too, as torch.equal
                      for g, s in zip((ga != gb).tolist(), scale_diff)]
    da, db = a.data.view(torch.uint8).reshape(E, -1), b.data.view(torch.uint8).reshape(E, -1)
    packed = format_spec(a.fmt).packed
    n_diff = code_mismatch_counts(da, db, packed)
    n = (2 if packed else 1) * da.shape[1]
    return [{"scale_mismatch_frac": s, "code_mismatch_frac": d / n if n else 0.0}
            for s, d in zip(scale_diff, n_diff.tolist())]


def stack_histograms(q: QuantizedTensor) -> list[list[tuple[int, int]]]:
    """Per expert, ``(exponent, count)`` of ``metrics.scale_exponents``, exponents ascending (as
    the reference's ``torch.unique``)."""
    E = q.scale.shape[0]
    exps = scale_exponents(q).reshape(E, -1).long()
    keys = torch.arange(E, device=exps.device).unsqueeze(-1) * _EXP_SPAN + exps + _EXP_SPAN // 2
    uniq, counts = torch.unique(keys, return_counts=True)
    out: list[list[tuple[int, int]]] = [[] for _ in range(E)]
    for key, c in zip(uniq.tolist(), counts.tolist()):
        e, x = divmod(key, _EXP_SPAN)
        out[e].append((x - _EXP_SPAN // 2, c))
    return out


def decode_stack(q: QuantizedTensor) -> torch.Tensor:
    """BF16 decode of a stacked grid: what ``view.materialize()`` gives for each member (the
    views decode with the same codec, profile and library global)."""
    return dequantize(q, torch.bfloat16)
