"""Triton helpers shared by the MX and NVFP4 kernels: E2M1 rounding, decoding, x86 NaN rules.

Every helper repeats, on fp32 bit patterns, what ``workbench.formats`` does with torch ops on
the CPU (the spec). Three hardware facts drive the bit tricks:
- Triton's fp32 ``/`` is the approximate ``div.full.f32`` on NVIDIA GPUs: true divisions of the
  reference use ``div_rn`` (IEEE round-to-nearest) instead.
- NVIDIA arithmetic returns the canonical NaN 0x7FFFFFFF for any NaN result; x86 (where the
  reference runs) returns the first NaN operand, quietened, or the "default NaN" 0xFFC00000 for
  an invalid operation such as 0 * inf (torch's vectorised CPU ``a * b`` returns b's NaN when
  both are NaN, seen with torch 2.13). torchao's FP4 cast reads a NaN's payload, so
  ``x86_mul_nan_bits`` rebuilds the CPU payload before codes are taken from it.
- Non-negative floats sort like their bit patterns: E2M1 rounding is integer comparisons.
"""

from __future__ import annotations

import triton
import triton.language as tl

# fp32 bits of the E2M1 rounding boundaries 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0.
B0 = tl.constexpr(0x3E800000)
B1 = tl.constexpr(0x3F400000)
B2 = tl.constexpr(0x3FA00000)
B3 = tl.constexpr(0x3FE00000)
B4 = tl.constexpr(0x40200000)
B5 = tl.constexpr(0x40600000)
B6 = tl.constexpr(0x40A00000)
QUIET = tl.constexpr(0x00400000)
X86_DEFAULT_NAN = tl.constexpr(-4194304)  # 0xFFC00000 as int32


@triton.jit
def is_nan(v):
    # not libdevice.isnan: the interpreter cannot run it (docs/formats.md, environment limits)
    return v != v  # noqa: PLR0124


@triton.jit
def bits_of(v):
    return v.to(tl.int32, bitcast=True)


@triton.jit
def x86_mul_nan_bits(vbits, a, b):
    """Bits of ``a * b`` as torch computes it on x86, given the device's result bits ``vbits``."""
    ab = a.to(tl.int32, bitcast=True)
    bb = b.to(tl.int32, bitcast=True)
    nan_bits = tl.where(is_nan(b), bb | QUIET, tl.where(is_nan(a), ab | QUIET, X86_DEFAULT_NAN))
    isnan = (vbits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(isnan, nan_bits, vbits)


@triton.jit
def e2m1_code_rne(vbits):
    """E2M1 code (0..15, int32) of fp32 bits: nearest, ties to even, saturating, sign bit from
    the sign of the bits. NaN magnitudes (bits above inf) give 7, as the reference's compare."""
    m = vbits & 0x7FFFFFFF
    c = (m > B0).to(tl.int32) + (m >= B1).to(tl.int32) + (m > B2).to(tl.int32)
    c += (m >= B3).to(tl.int32) + (m > B4).to(tl.int32) + (m >= B5).to(tl.int32)
    c += (m > B6).to(tl.int32)
    return c | ((vbits >> 28) & 0x8)


@triton.jit
def torchao_mx_nan_code(vbits):
    """torchao ``_f32_to_floatx_unpacked`` on a NaN (its "normal" branch), as ``mx._fp4_special_codes``."""
    m = vbits & 0x7FFFFFFF
    add = ((1 - 127) << 23) + ((1 << 21) - 1)
    mag = ((m + add + ((m >> 22) & 1)) >> 22) & 0x7
    return mag | ((vbits >> 28) & 0x8)


@triton.jit
def torchao_nvfp4_nan_code(vbits):
    """torchao NVFP4's code for a NaN element, as ``nvfp4_profiles._torchao_nan_codes``."""
    mant = vbits & 0x7FFFFF
    carry = (mant + 0x1FFFFF + ((mant >> 22) & 1)) >> 22
    return (2 + carry) | ((vbits >> 28) & 0x8)


@triton.jit
def e2m1_value(code):
    """fp32 value of an E2M1 code (int32 0..15); 0x8 is -0.0."""
    m = code & 0x7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22),
                    tl.where(m == 1, 0x3F000000, 0))
    bits = bits | ((code & 0x8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_pairs(code, NB: tl.constexpr, K: tl.constexpr):
    """[NB, K] int32 codes -> [NB, K/2] uint8, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(code, (NB, K // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def pow2_scaled(x, e):
    """x * 2^e for int32 e in [-127, 127], exact for normal results: the power is built from
    bits, and 2^-127 (an fp32 subnormal, flushed by some paths) as 2^-126 * 0.5."""
    ec = tl.maximum(e, -126)
    p = ((ec + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e < -126, (x * p) * 0.5, x * p)


@triton.jit
def fp8_round(v, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_UP: tl.constexpr,
              SUB_DOWN: tl.constexpr):
    """fp32 value of the nearest float8 (MBITS mantissa bits, smallest normal MIN_NORMAL), ties to
    even, for |v| already clamped to the format's max; NaN passes. Integer rounding, so the
    result is the same on every backend (the Triton interpreter's fp8 casts round wrongly).
    SUB_UP / SUB_DOWN = 2^(MBITS-EMIN) / its inverse: the subnormal grid step's inverse / step."""
    a = tl.abs(v)
    ab = bits_of(a)
    DROP: tl.constexpr = 23 - MBITS
    lsb = (ab >> DROP) & 1
    rb = (ab + ((1 << (DROP - 1)) - 1) + lsb) & ~((1 << DROP) - 1)
    normal = rb.to(tl.float32, bitcast=True)
    # below MIN_NORMAL the grid is uniform: scale to integers, round with the 2^23 trick (exact:
    # a * 2^k is exact and below 2^23), scale back
    sub = ((a * SUB_UP + 8388608.0) - 8388608.0) * SUB_DOWN
    r = tl.where(a < MIN_NORMAL, sub, normal)
    r = tl.where(v < 0, -r, r)
    r = tl.where(v == 0, v, r)  # keep the sign of zero
    return tl.where(is_nan(v), v, r)


@triton.jit
def e2m1_round_value(v):
    """fp32 value of the nearest E2M1 (ties to even, saturating at 6) of a *finite* v, without
    codes: round to the grid step of v's binade (0.5 below 2, 1 below 4, else 2) with the
    2^23 trick, clamp to 6, put v's sign back (so -0.0 and tiny negatives give -0.0). Equal to
    ``e2m1_value(e2m1_code_rne(bits(v)))`` for finite v, with a third of the integer work."""
    a = tl.abs(v)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    big = step * 8388608.0
    q = tl.minimum((a + big) - big, 6.0)
    return (bits_of(q) | (bits_of(v) & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(y, HW: tl.constexpr):
    """The bf16 bits of fp32 ``y`` rounded to nearest even, sign-extended to int32: on a GPU the
    cvt.rn cast torch's conversions also use, under the interpreter (whose bf16 cast truncates)
    the same rounding on the integer bits, as ``store_rounded``."""
    if HW:
        return y.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    b = bits_of(y)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(is_nan(y), b >> 16, r)


@triton.jit
def bf16_value(bits):
    """fp32 value of sign-extended bf16 ``bits`` (as ``bf16_bits`` returns them)."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def store_rounded(ptr, y, mask, BF16_BITS: tl.constexpr, HW: tl.constexpr):
    """Store fp32 ``y`` in ``ptr``'s dtype. bf16 outputs go out as int16 bits: on a GPU the
    cvt.rn cast, under the interpreter (whose bf16 cast truncates and flushes subnormals) the
    same round-to-nearest-even done on the integer bits."""
    if BF16_BITS and HW:
        tl.store(ptr, y.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
    elif BF16_BITS:
        b = bits_of(y)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(is_nan(y), b >> 16, r)
        tl.store(ptr, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_f32(ptr, idx, mask, BF16_BITS: tl.constexpr):
    """Load as fp32. bf16 comes in as int16 bits and is widened by a shift: exact for
    subnormals and NaN payloads on every backend (the interpreter flushes bf16 subnormals)."""
    if BF16_BITS:
        raw = tl.load(ptr + idx, mask=mask, other=0).to(tl.int32)  # sign-extended
        return (raw << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + idx, mask=mask, other=0.0).to(tl.float32)
