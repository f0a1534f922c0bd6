"""Triton NVFP4 kernels: a per-expert amax pass, then one quantize / fake-quantize pass.

Mirrors ``workbench.formats.nvfp4_profiles`` rows ``torchao`` and ``te`` operation by operation
(true divisions as ``div_rn``; the global-scale scalars are recomputed per block from the fp32
amax with the same fp32 operations the reference runs on the CPU, so no host round trip).

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
def amax_kernel(x_ptr, part_ptr, n_per_expert, n_parts, BLOCK: tl.constexpr,
                IGNORE_NAN: tl.constexpr, BF16_BITS: tl.constexpr):
    """Partial abs-max of ``BLOCK``-element chunks of each expert: part[e, p]."""
    e = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_expert
    x = load_f32(x_ptr, e * n_per_expert + offs, mask, BF16_BITS)
    # integer max of the magnitude bits: NaN (bits above inf) wins with its payload, as
    # torch's x.abs().amax() on the CPU returns it; zeroed first when NaN is skipped (TE)
    m = bits_of(x) & 0x7FFFFFFF
    if IGNORE_NAN:
        m = tl.where(m > 0x7F800000, 0, m)
    m = tl.max(m, axis=0).to(tl.float32, bitcast=True)
    tl.store(part_ptr + e * n_parts + p, m)


@triton.jit
def nvfp4_kernel(x_ptr, out_ptr, scale_ptr, amax_ptr, n_blocks, blocks_per_expert,
                 NB: tl.constexpr, PROFILE: tl.constexpr, FAKE: tl.constexpr,
                 BF16_BITS: tl.constexpr, HW: tl.constexpr):
    BLOCK: tl.constexpr = 16
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB)
    bmask = blk < n_blocks
    idx = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = bmask[:, None]
    x = load_f32(x_ptr, idx, mask, BF16_BITS)
    amax = tl.load(amax_ptr + blk // blocks_per_expert, mask=bmask, other=1.0)
    # block amax on magnitude bits: NaN bits sort above inf, so an integer max propagates NaN
    # (torch.amax: torchao) and zeroing them first skips NaN (fmaxf from 0: TE)
    m = bits_of(x) & 0x7FFFFFFF
    if PROFILE == TORCHAO:
        bamax = tl.max(m, axis=1).to(tl.float32, bitcast=True)
        # GPU arithmetic returns the canonical NaN; each step keeps the CPU's NaN payload instead
        # (quantize() codes of NaN-scaled blocks read it, see _common.x86_mul_nan_bits)
        pts = _keep_nan(tl.math.div_rn(amax, 2688.0), amax)  # per_tensor_amax_to_scale
        s = _keep_nan(tl.math.div_rn(bamax, 6.0), bamax)
        s = x86_div_nan_bits(bits_of(tl.math.div_rn(s, pts)), s, pts).to(tl.float32, bitcast=True)
        s = tl.where(s < E4M3_TINY, E4M3_TINY, tl.where(s > 448.0, 448.0, s))  # NaN stays
        sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
        # torch widens the e4m3 NaN byte to 0x7FF00000 (plus sign): later NaN payloads read it
        nan_sf = (0x7FF00000 | (bits_of(s) & -2147483648)).to(tl.float32, bitcast=True)
        sf = tl.where(is_nan(sf), nan_sf, sf)
        inv_pts = _keep_nan(tl.math.div_rn(1.0, pts), pts)
        f = tl.math.div_rn(inv_pts, sf)
        f_bits = x86_div_nan_bits(bits_of(f), inv_pts, sf)
        f = f_bits.to(tl.float32, bitcast=True)
        v = x * f[:, None]
        dec = (pts * sf)[:, None]
    else:
        bamax = tl.max(tl.where(m > 0x7F800000, 0, m), axis=1).to(tl.float32, bitcast=True)
        # compute_global_encode_scaling_factor_FP4: fminf(2688/amax, FLT_MAX), 1 for 0 / inf amax
        s_enc = tl.math.div_rn(2688.0, amax)
        s_enc = tl.where((s_enc > FLT_MAX) | (is_nan(s_enc)), FLT_MAX, s_enc)  # fmin
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s = bamax * (s_enc * RCP_6)
        s = tl.where((s > FLT_MAX) | (is_nan(s)), FLT_MAX, s)
        s = tl.where(s > 448.0, 448.0, s)  # __NV_SATFINITE
        sf = fp8_round(s, 3, 0.015625, 512.0, 0.001953125)
        s_dec = tl.math.div_rn(1.0, s_enc)
        rcp = tl.math.div_rn(1.0, sf * s_dec)
        rcp = tl.where((rcp > FLT_MAX) | (is_nan(rcp)), FLT_MAX, rcp)
        v = x * rcp[:, None]
        f = rcp
        # the decode-direction global round trip of fake_quantize: (amax / 2688) * 2688
        g = tl.math.div_rn(amax, 2688.0) * 2688.0
        dec = ((sf * g) * RCP_2688)[:, None]

    if FAKE:
        # a tile whose scaled values are all finite takes the short grid rounding (see _mx_kernel)
        if tl.max(tl.max(bits_of(v) & 0x7FFFFFFF, axis=1), axis=0) < 0x7F800000:
            y = e2m1_round_value(v) * dec
        else:
            y = e2m1_value(_codes(x, v, f, PROFILE)) * dec
        store_rounded(out_ptr + idx, y, mask, BF16_BITS, HW)
    else:
        code = _codes(x, v, f, PROFILE)
        oidx = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(out_ptr + oidx, pack_pairs(code, NB, BLOCK), mask=mask)
        # sf is an exact e4m3 value; a NaN scale is written as torch's cast writes it (0x7F)
        sb = sf.to(scale_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
        sb = tl.where(is_nan(sf), (0x7F | ((bits_of(sf) >> 24) & 0x80)).to(tl.uint8), sb)
        tl.store(scale_ptr.to(tl.pointer_type(tl.uint8)) + blk, sb, mask=bmask)


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
