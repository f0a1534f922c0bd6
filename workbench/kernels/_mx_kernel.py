"""Triton MX kernel (MXFP4, MXFP8 E4M3/E5M2): one pass, one E8M0 scale per 32 elements.

Mirrors ``workbench.formats.mx`` (``quantize_mx`` / ``dequantize_mx``) for the profiles whose
scale rule is integer arithmetic on the amax bits (floor, ceil, even, rceil). The per-byte encode
multipliers and decode scales are the reference's own tables (``mx_profiles.cached_lut``), read
by byte, so byte-0 and byte-255 blocks behave exactly as each profile says.

Fake quantization is ALU-heavy for a memory-bound op (H200: ~4.8 TB/s against ~17 T int32 op/s,
about 14 integer ops per bf16 element at the copy rate), so a program whose tile is all finite
takes a short path (grid rounding, hardware casts); tiles holding NaN/inf take the exact
special-value path that ``quantize`` always uses.

``swiglu_mx_kernel`` fuses the SwiGLU product in front of the activation fake quantization that
the down projection applies to it (see ``api.silu_mul_fake_quantize``).

Shape legend: the input is viewed as ``x_BK`` [n_blocks, 32]; a program owns NB blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._common import (
    bf16_bits,
    bf16_value,
    bits_of,
    e2m1_code_rne,
    e2m1_round_value,
    e2m1_value,
    fp8_round,
    is_nan,
    load_f32,
    pack_pairs,
    store_rounded,
    torchao_mx_nan_code,
    x86_mul_nan_bits,
)

# scale rules, as constexpr ints
FLOOR, CEIL, EVEN, RCEIL = (tl.constexpr(i) for i in range(4))
# element kinds
E2M1, E4M3, E5M2 = (tl.constexpr(i) for i in range(3))


@triton.jit
def _scale_byte(ab, RULE: tl.constexpr, EMAX: tl.constexpr, MANT_BITS: tl.constexpr,
                MAX_MANT: tl.constexpr, INF_BYTE: tl.constexpr):
    """E8M0 byte from the amax bits ``ab`` (NaN-propagating: bits above 0x7F800000 are NaN)."""
    raw = ab
    if RULE == EVEN:
        ab = (ab + (1 << (22 - MANT_BITS))) & 0x7F800000
    efield = (ab >> 23) & 0xFF
    mant = ab & 0x7FFFFF
    k = efield - 127 - EMAX
    if RULE == CEIL:
        k += (mant > 0).to(tl.int32)
    if RULE == RCEIL:
        k += (mant > MAX_MANT).to(tl.int32)
    byte = tl.minimum(tl.maximum(k + 127, 0), 255)
    if RULE == RCEIL:
        byte = tl.minimum(byte, 254)
    if INF_BYTE >= 0:
        byte = tl.where(raw == 0x7F800000, INF_BYTE, byte)
    return tl.where(raw > 0x7F800000, 0xFF, byte)  # every profile served here: NaN -> 0xFF


@triton.jit
def _fp8(v, ELEM: tl.constexpr, ELEM_MAX: tl.constexpr, HW: tl.constexpr):
    """Clamp, then round to the float8 grid (as fp32); NaN passes the clamp."""
    v = tl.where(v > ELEM_MAX, ELEM_MAX, tl.where(v < -ELEM_MAX, -ELEM_MAX, v))
    if HW:  # cvt.rn.satfinite: round-to-nearest-even, exact on the clamped values
        if ELEM == E4M3:
            return v.to(tl.float8e4nv).to(tl.float32)
        return v.to(tl.float8e5).to(tl.float32)
    if ELEM == E4M3:
        return fp8_round(v, 3, 0.015625, 512.0, 0.001953125)
    return fp8_round(v, 2, 0.00006103515625, 65536.0, 0.0000152587890625)


@triton.jit
def fake_tile(x, enc_lut_ptr, dec_lut_ptr, ELEM: tl.constexpr, RULE: tl.constexpr,
              EMAX: tl.constexpr, MANT_BITS: tl.constexpr, MAX_MANT: tl.constexpr,
              ELEM_MAX: tl.constexpr, INF_BYTE: tl.constexpr, HW: tl.constexpr):
    """The MX fake quantization of the fp32 tile ``x`` [NB, 32] (a block per row), in fp32.
    Shared by ``mx_kernel`` and the fused SwiGLU kernel, so both round the same way."""
    # amax on the magnitude bits: an integer max propagates NaN (its bits sort above inf) as
    # torch.amax does, where float max reductions on a GPU drop it
    ab = tl.max(bits_of(x) & 0x7FFFFFFF, axis=1)
    byte = _scale_byte(ab, RULE, EMAX, MANT_BITS, MAX_MANT, INF_BYTE)
    mult = tl.load(enc_lut_ptr + byte)[:, None]
    v = x * mult
    ds = tl.load(dec_lut_ptr + byte)[:, None]
    if ELEM == E2M1:
        if tl.max(ab, axis=0) < 0x7F800000:  # an all-finite tile takes the short path
            q = e2m1_round_value(v)
        else:
            vbits = x86_mul_nan_bits(bits_of(v), x, mult)
            code = tl.where((vbits & 0x7FFFFFFF) > 0x7F800000, torchao_mx_nan_code(vbits),
                            e2m1_code_rne(vbits))
            q = e2m1_value(code)
    else:
        q = _fp8(v, ELEM, ELEM_MAX, HW)
    return q * ds


@triton.jit
def mx_kernel(x_ptr, out_ptr, scale_ptr, enc_lut_ptr, dec_lut_ptr, n_blocks,
              NB: tl.constexpr, ELEM: tl.constexpr, RULE: tl.constexpr, EMAX: tl.constexpr,
              MANT_BITS: tl.constexpr, MAX_MANT: tl.constexpr, ELEM_MAX: tl.constexpr,
              INF_BYTE: tl.constexpr, FAKE: tl.constexpr, BF16_BITS: tl.constexpr,
              HW: tl.constexpr, OUT_BF16: tl.constexpr):
    # BF16_BITS: the input is bf16; OUT_BF16: the fake-quantized output is (see nvfp4_kernel)
    BLOCK: tl.constexpr = 32
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB)
    bmask = blk < n_blocks
    idx = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = bmask[:, None]
    x = load_f32(x_ptr, idx, mask, BF16_BITS)

    if FAKE:
        y = fake_tile(x, enc_lut_ptr, dec_lut_ptr, ELEM, RULE, EMAX, MANT_BITS, MAX_MANT,
                      ELEM_MAX, INF_BYTE, HW)
        store_rounded(out_ptr + idx, y, mask, OUT_BF16, HW)
    else:
        ab = tl.max(bits_of(x) & 0x7FFFFFFF, axis=1)
        byte = _scale_byte(ab, RULE, EMAX, MANT_BITS, MAX_MANT, INF_BYTE)
        mult = tl.load(enc_lut_ptr + byte)[:, None]
        v = x * mult
        vbits = x86_mul_nan_bits(bits_of(v), x, mult)
        if ELEM == E2M1:
            code = tl.where((vbits & 0x7FFFFFFF) > 0x7F800000, torchao_mx_nan_code(vbits),
                            e2m1_code_rne(vbits))
            oidx = blk[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
            tl.store(out_ptr + oidx, pack_pairs(code, NB, BLOCK), mask=mask)
        else:
            # q is an exact float8 value: the cast only changes the storage. NaN bytes are
            # written as torch's CPU cast writes them (0x7F plus the sign of the CPU NaN)
            q = _fp8(v, ELEM, ELEM_MAX, HW)
            qb = q.to(out_ptr.dtype.element_ty).to(tl.uint8, bitcast=True)
            nan_byte = (0x7F | ((vbits >> 24) & 0x80)).to(tl.uint8)
            qb = tl.where(is_nan(v), nan_byte, qb)
            tl.store(out_ptr.to(tl.pointer_type(tl.uint8)) + idx, qb, mask=mask)
        tl.store(scale_ptr + blk, byte.to(tl.uint8), mask=bmask)


@triton.jit
def silu_bits(g, HW: tl.constexpr):
    """bf16 bits of torch's CUDA ``F.silu`` of bf16 ``g`` (widened to fp32): ``g / (1 + exp(-g))``
    in fp32 with CUDA's accurate ``expf`` (libdevice's, not Triton's ``tl.exp``, which is the
    approximate ``ex2.approx`` after a multiply) and an IEEE division (Triton's ``/`` is
    approximate), rounded once to bf16. Under the interpreter, which has no libdevice, numpy's
    exp stands in: within an ulp of torch's CPU silu, not bit-equal (the tests say where)."""
    if HW:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return bf16_bits(tl.math.div_rn(g, 1.0 + e), HW)


@triton.jit
def swiglu_mx_kernel(g_ptr, u_ptr, out_ptr, enc_lut_ptr, dec_lut_ptr, n_blocks,
                     NB: tl.constexpr, ELEM: tl.constexpr, RULE: tl.constexpr,
                     EMAX: tl.constexpr, MANT_BITS: tl.constexpr, MAX_MANT: tl.constexpr,
                     ELEM_MAX: tl.constexpr, INF_BYTE: tl.constexpr, HW: tl.constexpr):
    """bf16 ``g``, ``u`` -> the fake quantization of ``h = silu(g) * u`` (bf16) in one pass: what
    ``F.silu(g) * u`` followed by ``mx_kernel`` computes, without writing ``silu(g)`` and ``h``
    and reading them back. The product of two bf16 values is exact in fp32, so rounding it once
    to bf16 is torch's bf16 multiply."""
    BLOCK: tl.constexpr = 32
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * NB + tl.arange(0, NB)
    idx = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (blk < n_blocks)[:, None]
    g = load_f32(g_ptr, idx, mask, True)
    u = load_f32(u_ptr, idx, mask, True)
    h = bf16_value(bf16_bits(bf16_value(silu_bits(g, HW)) * u, HW))
    y = fake_tile(h, enc_lut_ptr, dec_lut_ptr, ELEM, RULE, EMAX, MANT_BITS, MAX_MANT, ELEM_MAX,
                  INF_BYTE, HW)
    store_rounded(out_ptr + idx, y, mask, True, HW)


@triton.jit
def swiglu_backward_kernel(dq_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr,
                           HW: tl.constexpr, CONTRACT: tl.constexpr):
    """The backward of ``Q(silu(g) * u)`` with an identity STE, as torch's autograd runs it on
    CUDA, in one pass: ``du = dq * s`` and ``dg = silu_backward(dq * u, g)`` with
    ``s = silu(g)`` recomputed (bf16, the forward's). torch's silu_backward computes, in fp32,
    ``dy * sig * (1 + x * (1 - sig))`` with ``sig = 1 / (1 + exp(-x))`` (an IEEE division),
    compiled with contraction on: ``CONTRACT`` writes the inner ``x * (1 - sig) + 1`` as one
    fma, else as a multiply and an add (launched with ``enable_fp_fusion=False``); which one is
    torch's bits is a GPU fact (tests/kernels/test_swiglu.py)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dq = load_f32(dq_ptr, offs, mask, True)
    g = load_f32(g_ptr, offs, mask, True)
    u = load_f32(u_ptr, offs, mask, True)
    s = bf16_value(silu_bits(g, HW))
    du = bf16_bits(dq * s, HW)
    ds = bf16_value(bf16_bits(dq * u, HW))
    if HW:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    sig = tl.math.div_rn(1.0, 1.0 + e)
    if CONTRACT:
        t = tl.math.fma(g, 1.0 - sig, 1.0)
    else:
        t = g * (1.0 - sig) + 1.0
    dg = bf16_bits(ds * sig * t, HW)
    tl.store(du_ptr + offs, du.to(tl.int16), mask=mask)
    tl.store(dg_ptr + offs, dg.to(tl.int16), mask=mask)
