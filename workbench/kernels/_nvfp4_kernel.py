"""Triton NVFP4 kernels: a per-expert amax pass, then one quantize / fake-quantize pass.

Mirrors ``workbench.formats.nvfp4_profiles`` rows ``torchao`` and ``te`` operation by operation
(true divisions as ``div_rn``; the global-scale scalars are computed on the device from the fp32
amax with the same fp32 operations the reference runs on the CPU, so no host round trip).

Fake quantization is bound by instruction issue near the copy rate (docs/kernels.md), so the
global scalars are computed once per program when its blocks share one expert, and a tile
whose scaled values are all finite skips the NaN bookkeeping that only specials need
(``quantize`` always does it).

Shape legend: the input is viewed as ``x_BS`` [n_blocks, 16]; blocks ``[e * bpe, (e+1) * bpe)``
belong to expert (leading index) e, whose global amax is ``amax_ptr[e]``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (
    bits_of,
    e2m1_code_rne,
    e2m1_round_value,
    e2m1_value,
    fp8_round,
    is_nan,
    load_f32,
    pack_pairs,
    store_rounded,
    torchao_nvfp4_nan_code,
    x86_mul_nan_bits,
)

TORCHAO, TE = tl.constexpr(0), tl.constexpr(1)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
E4M3_TINY = tl.constexpr(0.015625)  # 2^-6, torchao's block-scale floor
RCP_6 = tl.constexpr(0.1666666716337204)  # fp32(1/6), TE's constant
RCP_2688 = tl.constexpr(0.00037202380388043821)  # fp32(1/2688)


@triton.jit
def amax_kernel(x_ptr, amax_bits_ptr, n_per_expert, BLOCK: tl.constexpr,
                IGNORE_NAN: tl.constexpr, BF16_BITS: tl.constexpr):
    """Abs-max of each expert's ``BLOCK``-element chunks, folded into ``amax_bits[e]`` (int32
    bits of the fp32 amax, zero-initialised) by an atomic integer max."""
    e = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_expert
    x = load_f32(x_ptr, e * n_per_expert + offs, mask, BF16_BITS)
    # integer max of the magnitude bits: NaN (bits above inf) wins with its payload, as
    # torch's x.abs().amax() on the CPU returns it; zeroed first when NaN is skipped (TE).
    # Non-negative floats order like their bits, so the atomic max is order-independent.
    m = bits_of(x) & 0x7FFFFFFF
    if IGNORE_NAN:
        m = tl.where(m > 0x7F800000, 0, m)
    tl.atomic_max(amax_bits_ptr + e, tl.max(m, axis=0), sem="relaxed")


@triton.jit
def nvfp4_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, n_blocks, blocks_per_expert,
                 NB: tl.constexpr, PROFILE: tl.constexpr, FAKE: tl.constexpr,
                 BF16_BITS: tl.constexpr, HW: tl.constexpr, UNIFORM: tl.constexpr,
                 OUT_BF16: tl.constexpr):
    """UNIFORM: every program's blocks share one expert (so its global scalars are computed
    once per program). BF16_BITS: the input is bf16; OUT_BF16: the fake-quantized output is
    (which may differ from the input's dtype: an fp32 master written as the bf16 the GEMM reads)."""
    BLOCK: tl.constexpr = 16
    blk0 = tl.program_id(0).to(tl.int64) * NB
    blk = blk0 + tl.arange(0, NB)
    bmask = blk < n_blocks
    idx = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = bmask[:, None]
    x = load_f32(x_ptr, idx, mask, BF16_BITS)
    if UNIFORM:
        amax = tl.load(amax_ptr + blk0 // blocks_per_expert)
    else:
        amax = tl.load(amax_ptr + blk // blocks_per_expert, mask=bmask, other=1.0)
    ga, gb, gc = _globals(amax, PROFILE)
    # block amax on magnitude bits: NaN bits sort above inf, so an integer max propagates NaN
    m = bits_of(x) & 0x7FFFFFFF
    bmax = tl.max(m, axis=1)

    if FAKE:
        # Short path: the scale chain without NaN bookkeeping, valid when every scaled value
        # is finite. That holds iff RN(bamax * f) is finite in every block (rounding is
        # monotone, and a NaN anywhere upstream makes f or bamax NaN), so the check costs one
        # product per block instead of one test per element.
        bamax = bmax.to(tl.float32, bitcast=True)
        sf, f, dec = _chain_finite(bamax, ga, gb, gc, PROFILE)
        if tl.max(bits_of(bamax * f) & 0x7FFFFFFF, axis=0) < 0x7F800000:
            y = e2m1_round_value(x * f[:, None]) * dec[:, None]
        else:
            sf, f, dec = _chain_exact(m, bmax, amax, ga, gb, gc, PROFILE)
            y = e2m1_value(_codes(x, x * f[:, None], f, PROFILE)) * dec[:, None]
        store_rounded(out_ptr + idx, y, mask, OUT_BF16, HW)
    else:
        sf, f, dec = _chain_exact(m, bmax, amax, ga, gb, gc, PROFILE)
        code = _codes(x, x * f[:, None], f, PROFILE)
        oidx = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(out_ptr + oidx, pack_pairs(code, NB, BLOCK), mask=mask)
        # sf is an exact e4m3 value; a NaN scale is written as torch's cast writes it (0x7F)
        sb = sf.to(scale_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
        sb = tl.where(is_nan(sf), (0x7F | ((bits_of(sf) >> 24) & 0x80)).to(tl.uint8), sb)
        tl.store(scale_ptr.to(tl.pointer_type(tl.uint8)) + blk, sb, mask=bmask)


@triton.jit
def _globals(amax, PROFILE: tl.constexpr):
    """The per-tensor scalars of a global amax (a scalar, or one per block), as the reference
    computes them on the CPU: torchao (pts, 1/pts, pts); TE (S_enc/6, 1/S_enc, amax)."""
    if PROFILE == TORCHAO:
        # GPU arithmetic returns the canonical NaN; each step keeps the CPU's NaN payload instead
        # (quantize() codes of NaN-scaled blocks read it, see _common.x86_mul_nan_bits)
        pts = _keep_nan(tl.math.div_rn(amax, 2688.0), amax)  # per_tensor_amax_to_scale
        return pts, _keep_nan(tl.math.div_rn(1.0, pts), pts), pts
    # compute_global_encode_scaling_factor_FP4: fminf(2688/amax, FLT_MAX), 1 for 0 / inf amax
    s_enc = tl.math.div_rn(2688.0, amax)
    s_enc = tl.where((s_enc > FLT_MAX) | (is_nan(s_enc)), FLT_MAX, s_enc)  # fmin
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    # TE decodes with its stored global, the amax itself (fake_quantize carries it as the
    # library global, so no amax/2688*2688 round trip, which is off by an ulp for ~15% of amaxes)
    return s_enc * RCP_6, tl.math.div_rn(1.0, s_enc), amax


@triton.jit
def _chain_finite(bamax, ga, gb, gc, PROFILE: tl.constexpr):
    """Block scale, encode factor and decode scale, for finite inputs: ``_chain_exact``'s
    operations minus its NaN/overflow bookkeeping (the caller checks that none was needed)."""
    if PROFILE == TORCHAO:
        s = tl.math.div_rn(tl.math.div_rn(bamax, 6.0), ga)
        s = tl.where(s < E4M3_TINY, E4M3_TINY, tl.where(s > 448.0, 448.0, s))
        sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
        return sf, tl.math.div_rn(gb, sf), ga * sf
    s = bamax * ga
    s = tl.where(s > 448.0, 448.0, s)  # also takes an overflow to inf, as TE's FLT_MAX guard
    sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
    rcp = tl.minimum(tl.math.div_rn(1.0, sf * gb), FLT_MAX)  # zero blocks: 1/0 -> FLT_MAX
    return sf, rcp, (sf * gc) * RCP_2688


@triton.jit
def _chain_exact(m, bmax, amax, ga, gb, gc, PROFILE: tl.constexpr):
    """The reference's block-scale chain with its NaN rules (and the CPU's NaN payloads)."""
    if PROFILE == TORCHAO:
        bamax = bmax.to(tl.float32, bitcast=True)
        s = _keep_nan(tl.math.div_rn(bamax, 6.0), bamax)
        s = x86_div_nan_bits(bits_of(tl.math.div_rn(s, ga)), s, ga).to(tl.float32, bitcast=True)
        s = tl.where(s < E4M3_TINY, E4M3_TINY, tl.where(s > 448.0, 448.0, s))  # NaN stays
        sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
        # torch widens the e4m3 NaN byte to 0x7FF00000 (plus sign): later NaN payloads read it
        nan_sf = (0x7FF00000 | (bits_of(s) & -2147483648)).to(tl.float32, bitcast=True)
        sf = tl.where(is_nan(sf), nan_sf, sf)
        f = tl.math.div_rn(gb, sf)
        f = x86_div_nan_bits(bits_of(f), gb, sf).to(tl.float32, bitcast=True)
        return sf, f, ga * sf
    # TE skips NaN in the block amax (fmaxf from 0)
    bamax = tl.max(tl.where(m > 0x7F800000, 0, m), axis=1).to(tl.float32, bitcast=True)
    s = bamax * ga
    s = tl.where((s > FLT_MAX) | (is_nan(s)), FLT_MAX, s)
    s = tl.where(s > 448.0, 448.0, s)  # __NV_SATFINITE
    sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
    rcp = tl.math.div_rn(1.0, sf * gb)
    rcp = tl.where((rcp > FLT_MAX) | (is_nan(rcp)), FLT_MAX, rcp)
    return sf, rcp, (sf * gc) * RCP_2688


@triton.jit
def _codes(x, v, f, PROFILE: tl.constexpr):
    """E2M1 codes with each library's NaN rule (the exact path)."""
    if PROFILE == TORCHAO:
        vbits = x86_mul_nan_bits(bits_of(v), x, f[:, None])
        return tl.where((vbits & 0x7FFFFFFF) > 0x7F800000, torchao_nvfp4_nan_code(vbits),
                        e2m1_code_rne(vbits))
    return tl.where(is_nan(x), 7, e2m1_code_rne(bits_of(v)))


@triton.jit
def _keep_nan(r, a):
    """``r = op(a, constant)`` with a's NaN payload (quietened) where a is NaN, as on x86."""
    return tl.where(is_nan(a), (bits_of(a) | 0x00400000).to(tl.float32, bitcast=True), r)


@triton.jit
def x86_div_nan_bits(rbits, a, b):
    """Bits of ``a / b`` as torch's CPU division gives them: the first NaN operand wins (seen
    with torch 2.13; its multiplication returns the second, see ``_common.x86_mul_nan_bits``)."""
    ab = a.to(tl.int32, bitcast=True)
    bb = b.to(tl.int32, bitcast=True)
    nan_bits = tl.where(is_nan(a), ab | 0x00400000, tl.where(is_nan(b), bb | 0x00400000, -4194304))
    return tl.where((rbits & 0x7FFFFFFF) > 0x7F800000, nan_bits, rbits)
