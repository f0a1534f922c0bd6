"""Triton kernel of the AdamW update's last op, ``param.addcdiv_(exp_avg, denom, value=alpha)``,
which also reduces the per-expert abs-max of the values it stores (the NVFP4 global amax of the
new weight version, `workbench.qat.ste.seed_amax`). Imported lazily by ``adamw.py``.

torch's CUDA addcdiv computes, per element in fp32 (its acc type), ``a + alpha * (b / c)`` with
an IEEE division, compiled by nvcc with contraction on, then rounds to the param dtype.
``CONTRACT`` picks ``fma(alpha, q, a)`` (nvcc's likely contraction) or a separate multiply and add
(launched with ``enable_fp_fusion=False``, so Triton's own contraction does not fuse them back):
which one is torch's bits is measured by jobs/gpu/adamw_bits.py on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import bf16_bits, bits_of, load_f32


@triton.jit
def addcdiv_amax_kernel(p_ptr, m_ptr, d_ptr, amax_bits_ptr, n_per_expert, alpha,
                        BLOCK: tl.constexpr, BF16_BITS: tl.constexpr, HW: tl.constexpr,
                        CONTRACT: tl.constexpr):
    """``p = p + alpha * (m / d)`` over one ``BLOCK`` chunk of expert ``program_id(0)``, and the
    abs-max of the stored values folded into ``amax_bits[e]`` (int32 bits of the fp32 amax,
    zero-initialised) by an atomic integer max, as ``_nvfp4_kernel.amax_kernel`` does with
    IGNORE_NAN=False: NaN magnitudes sort above inf and win, order-independently."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_expert
    idx = e * n_per_expert + offs
    a = load_f32(p_ptr, idx, mask, BF16_BITS)
    b = load_f32(m_ptr, idx, mask, BF16_BITS)
    c = load_f32(d_ptr, idx, mask, BF16_BITS)
    # Triton's fp32 `/` is the approximate div.full.f32 on NVIDIA GPUs; torch divides exactly
    q = tl.math.div_rn(b, c)
    if CONTRACT:
        y = tl.math.fma(q, alpha, a)
    else:
        y = q * alpha + a
    if BF16_BITS:
        r = bf16_bits(y, HW)
        tl.store(p_ptr + idx, r.to(tl.int16), mask=mask)
        stored = r << 16  # the fp32 bits of the stored bf16 value
    else:
        tl.store(p_ptr + idx, y, mask=mask)
        stored = bits_of(y)
    m = tl.where(mask, stored & 0x7FFFFFFF, 0)
    tl.atomic_max(amax_bits_ptr + e, tl.max(m, axis=0), sem="relaxed")
