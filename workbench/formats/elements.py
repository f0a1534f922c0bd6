"""Element-level encodings shared by every block format: E2M1 rounding and nibble packing, E8M0.

Rounding of already-scaled fp32 values to E2M1 is where libraries differ (docs/formats.md): the OCP
spec and torchao round to nearest, ties to even; ModelOpt's MXFP4 export rounds ties down;
microxcaling rounds ties away from zero. All saturate to +-6.
"""

from __future__ import annotations

import itertools
import sys

import torch

from .constants import E2M1_MAGNITUDES, E2M1_SIGN_BIT, E8M0_BIAS

# Midpoints between consecutive E2M1 magnitudes: boundary i separates code i from code i+1.
_E2M1_BOUNDARIES = tuple((a + b) / 2 for a, b in itertools.pairwise(E2M1_MAGNITUDES))
TIE_MODES = ("even", "down", "away")
_LITTLE_ENDIAN = sys.byteorder == "little"
_BITS_DTYPE = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def e2m1_magnitude_code(mag: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round non-negative values (bf16/fp16/fp32) to the E2M1 magnitude code 0..7, saturating.

    Non-negative floats sort like their bit patterns, so each boundary test is one integer
    comparison on the bits (vectorised for every dtype), accumulated in place into uint8; no
    fp32 temporary is made. NaN (bits above +inf) and +inf give 7, as ``bucketize`` did.
    """
    if ties not in TIE_MODES:
        raise ValueError(f"ties must be one of {TIE_MODES}, got {ties!r}")
    if mag.dtype not in _BITS_DTYPE:
        mag = mag.float()
    bits = mag.view(_BITS_DTYPE[mag.dtype])
    code = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    hit = torch.empty(mag.shape, dtype=torch.bool, device=mag.device)
    for i, bound in enumerate(_boundary_bits(mag.dtype)):
        # At boundary i (between codes i and i+1) a tie goes up for "away", and for "even"
        # exactly when the upper code i+1 is even: then the test is >=, i.e. > bits - 1.
        up = ties == "away" or (ties == "even" and i % 2 == 1)
        torch.gt(bits, bound - 1 if up else bound, out=hit)
        code += hit.to(torch.uint8)  # .to, not a bool .view: Inductor rejects the latter
    return code


def _read_boundary_bits(dtype: torch.dtype) -> tuple[int, ...]:
    t = torch.tensor(_E2M1_BOUNDARIES, dtype=dtype)  # every boundary is exact in all three
    return tuple(t.view(_BITS_DTYPE[dtype]).tolist())


# Read once at import: a .tolist() inside the encode path would break torch.compile graphs.
_BOUNDARY_BITS = {dt: _read_boundary_bits(dt) for dt in _BITS_DTYPE}


def _boundary_bits(dtype: torch.dtype) -> tuple[int, ...]:
    return _BOUNDARY_BITS[dtype]


def e2m1_encode(v: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round values (already divided by their block scale) to E2M1 codes (uint8, 0..15).

    Saturates at +-6. The sign bit follows ``signbit`` so -0.0 and tiny negatives give 0x8,
    as torchao and ml_dtypes do. NaN inputs are the caller's business (profiles differ).
    """
    if v.dtype not in _BITS_DTYPE:
        v = v.float()
    code = e2m1_magnitude_code(v.abs(), ties)
    code.add_(torch.signbit(v).to(torch.uint8), alpha=E2M1_SIGN_BIT)
    return code


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> values; code 0x8 decodes to -0.0."""
    lut = torch.tensor(
        list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float32, device=codes.device
    )
    return lut[(codes & 0xF).long()].to(dtype)


_PAIR_LUTS: dict[tuple[torch.dtype, torch.device, bool], torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype, neg_zero: bool) -> torch.Tensor:
    vals = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES])
    if not neg_zero:
        vals[E2M1_SIGN_BIT] = 0.0
    b = torch.arange(256)
    pairs = torch.stack([vals[b & 0xF], vals[b >> 4]], dim=-1).to(dtype)
    wide = {2: torch.int32, 4: torch.int64}[pairs.element_size()]
    return pairs.view(wide).reshape(256)


def e2m1_decode_packed(packed: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                       neg_zero: bool = True) -> torch.Tensor:
    """Packed FP4 bytes [..., K/2] -> values [..., K] in one gather.

    The table has one entry per byte holding both decoded elements viewed as one wide integer;
    gathering it with int64 indices is ~9x faster on CPU than unpacking nibbles and looking each
    up. ``neg_zero=False`` decodes 0x8 as +0.0 (ModelOpt's dequantize).
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8, got {packed.dtype}")
    key = (dtype, packed.device, neg_zero)
    lut = _PAIR_LUTS.get(key)
    if lut is None:
        lut = _pair_lut(dtype, neg_zero).to(packed.device)
        # a tensor stored from inside a traced region is a side effect torch.compile rejects:
        # cache only in eager mode (compiled graphs hold the table as a constant anyway)
        if not torch.compiler.is_compiling():
            _PAIR_LUTS[key] = lut
    out = torch.index_select(lut, 0, packed.reshape(-1).long()).view(dtype)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes (last dim {codes.shape[-1]})")
    codes = codes.to(torch.uint8).contiguous()
    if torch.compiler.is_compiling():  # inductor fuses the strided form; no storage tricks
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    # Read each (2i, 2i+1) pair as one little-endian int16 w = lo + 256*hi (codes < 16):
    # w | w >> 4 has lo | hi << 4 in its low byte, one pass instead of two strided ones.
    if codes.numel() and codes.storage_offset() % 2 == 0 and _LITTLE_ENDIAN:
        w = codes.view(torch.int16)
        return (w | (w >> 4)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of ``pack_fp4``)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8, got {packed.dtype}")
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def e8m0_to_fp32(b: torch.Tensor, nan_byte: str = "nan") -> torch.Tensor:
    """E8M0 bytes -> fp32 scales 2^(b-127).

    Byte 0 is 2^-127, an fp32 subnormal (bits 0x00400000), not zero. Byte 0xFF is NaN per the
    spec (torchao, TE, PyTorch, ml_dtypes) or +inf where a decoder computes 2**(b-127) in float
    (compressed-tensors): ``nan_byte`` picks "nan" or "inf". (transformers' ldexp decode is the
    exact 2^128, which no fp32 scale holds: see ``mx_profiles.MXProfile.dec_byte255``.)
    """
    if b.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 bytes, got {b.dtype}")
    bits = b.to(torch.int32) << 23  # exponent field; byte 255 -> +inf bits
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    out = bits.view(torch.float32)
    if nan_byte == "nan":
        out = torch.where(b == 0xFF, torch.full_like(out, float("nan")), out)
    elif nan_byte != "inf":
        raise ValueError(f"nan_byte must be 'nan' or 'inf', got {nan_byte!r}")
    return out


def fp32_exponent(x: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of fp32 values as int32 (subnormals and zero give -127)."""
    return ((x.float().view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS


def fp32_mantissa(x: torch.Tensor) -> torch.Tensor:
    """The 23-bit mantissa field of fp32 values as int32."""
    return x.float().view(torch.int32) & 0x7FFFFF
