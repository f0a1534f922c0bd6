"""Triton kernels of the AdamW update, imported lazily by ``adamw.py``:

- ``adamw_kernel``: the whole single-tensor AdamW step of fp32 masters in one pass (read p, g,
  m, v; write p, m, v), torch's CUDA bits op for op (its docstring lists the ops). torch's
  single-tensor path runs eight elementwise kernels, 84 bytes of traffic per element against
  this kernel's 28 (the step's time before and after: docs/kernels.md).
- ``addcdiv_amax_kernel``: only the last op, ``param.addcdiv_(exp_avg, denom, value=alpha)``,
  for bf16 masters (whose other ops stay torch's).

Both can reduce the per-expert abs-max of the values they store (the NVFP4 global amax of the
new weight version, which the optimizer hands to its amax sink).

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


@triton.jit
def adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, amax_bits_ptr, n_per_expert,
                 decay, w1, b2, c2, inv_bc2, bc2, eps, alpha,
                 BLOCK: tl.constexpr, DECAY: tl.constexpr, LERP_SMALL: tl.constexpr,
                 LERP_FMA: tl.constexpr, ADDCMUL_FMA: tl.constexpr, C2_ONE: tl.constexpr,
                 DIV_RECIP: tl.constexpr, CONTRACT: tl.constexpr, ALPHA_ONE: tl.constexpr,
                 AMAX: tl.constexpr):
    """The whole single-tensor AdamW step of one ``BLOCK`` chunk of fp32 expert (or tensor)
    ``program_id(0)``, op for op as torch's CUDA kernels round it (every intermediate in fp32):

        p = p * decay                   param.mul_(1 - lr * wd)                      (DECAY)
        m = lerp(m, g, w1)              exp_avg.lerp_(grad, 1 - beta1)
        v = v * b2 + c2 * (g * g)       exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        d = sqrt(v) / bc2 + eps         (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        p = p + alpha * (m / d)         param.addcdiv_(exp_avg, denom, value=-step_size)

    Where torch's rounding could go two ways there is a switch, and jobs/gpu/adamw_bits.py
    measures which is torch's: ATen's lerp takes ``self + w * (end - self)`` for |w| < 0.5
    (LERP_SMALL; else ``end - (end - self) * (1 - w)``), a sum nvcc may contract (LERP_FMA);
    addcmul and addcdiv add with an fma (ADDCMUL_FMA, CONTRACT), except for a value of exactly 1
    (C2_ONE, ALPHA_ONE: ATen then fuses the product into the sum, or adds the quotient); a
    division by a host scalar is a multiplication by its reciprocal ``inv_bc2`` (taken in
    double, rounded to fp32; DIV_RECIP; else an IEEE division by the fp32 ``bc2``). sqrt and the quotient are IEEE (Triton's
    default sqrt and ``/`` are approximate on NVIDIA GPUs). Launched with
    ``enable_fp_fusion=False``: every fma is written out and nothing else may fuse.
    With AMAX, the abs-max of the stored params is folded into ``amax_bits[e]`` as in
    ``addcdiv_amax_kernel``."""
    # chunks on grid axis 0 (up to 2^31 - 1 of them: a 300M-element embedding is 74k chunks,
    # over axis 1's limit of 65535), experts on axis 1
    e = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_expert
    idx = e * n_per_expert + offs
    p = tl.load(p_ptr + idx, mask=mask, other=0.0)
    g = tl.load(g_ptr + idx, mask=mask, other=0.0)
    m = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0)
    if DECAY:
        p = p * decay
    diff = g - m
    if LERP_SMALL:
        if LERP_FMA:
            m = tl.math.fma(w1, diff, m)
        else:
            m = m + w1 * diff
    else:
        omw = 1.0 - w1
        if LERP_FMA:
            m = tl.math.fma(-diff, omw, g)
        else:
            m = g - diff * omw
    v = v * b2
    if C2_ONE:
        v = tl.math.fma(g, g, v)
    elif ADDCMUL_FMA:
        v = tl.math.fma(c2, g * g, v)
    else:
        v = v + c2 * (g * g)
    s = tl.sqrt_rn(v)
    if DIV_RECIP:
        d = s * inv_bc2
    else:
        d = tl.math.div_rn(s, bc2)
    d = d + eps
    q = tl.math.div_rn(m, d)
    if ALPHA_ONE:
        p = p + q
    elif CONTRACT:
        p = tl.math.fma(q, alpha, p)
    else:
        p = p + q * alpha
    tl.store(p_ptr + idx, p, mask=mask)
    tl.store(m_ptr + idx, m, mask=mask)
    tl.store(v_ptr + idx, v, mask=mask)
    if AMAX:
        a = tl.where(mask, bits_of(p) & 0x7FFFFFFF, 0)
        tl.atomic_max(amax_bits_ptr + e, tl.max(a, axis=0), sem="relaxed")
