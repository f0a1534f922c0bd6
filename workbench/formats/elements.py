"""Element-level encodings shared by every block format: E2M1 rounding and nibble packing, E8M0.

Rounding of already-scaled fp32 values to E2M1 is where libraries differ (FORMATS.md): the OCP
spec and torchao round to nearest, ties to even; ModelOpt's MXFP4 export rounds ties down;
microxcaling rounds ties away from zero. All saturate to +-6.
"""

from __future__ import annotations

import torch

from .constants import E2M1_MAGNITUDES, E2M1_SIGN_BIT, E8M0_BIAS

# Midpoints between consecutive E2M1 magnitudes: boundary i separates code i from code i+1.
_E2M1_BOUNDARIES = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))
TIE_MODES = ("even", "down", "away")


def e2m1_encode(v: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """Round fp32 values (already divided by their block scale) to E2M1 codes (uint8, 0..15).

    Saturates at +-6. The sign bit follows ``signbit`` so -0.0 and tiny negatives give 0x8,
    as torchao and ml_dtypes do. NaN inputs are the caller's business (profiles differ).
    """
    if ties not in TIE_MODES:
        raise ValueError(f"ties must be one of {TIE_MODES}, got {ties!r}")
    v = v.float()
    mag = v.abs()
    bounds = torch.tensor(_E2M1_BOUNDARIES, dtype=torch.float32, device=v.device)
    # right=False: number of boundaries strictly below mag, i.e. ties go to the lower code here.
    code = torch.bucketize(mag, bounds, right=False)
    on_tie = (mag.unsqueeze(-1) == bounds).any(-1)
    if ties == "away":
        code = code + on_tie.to(code.dtype)
    elif ties == "even":
        # At boundary i, the lower code is i; go up when the upper code (i + 1) is even.
        code = code + (on_tie & (code % 2 == 1)).to(code.dtype)
    # saturation: values above 6 land on code 7 already (bucketize caps at len(bounds) == 7)
    code = code.to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) * E2M1_SIGN_BIT)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> values; code 0x8 decodes to -0.0."""
    lut = torch.tensor(
        list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES], dtype=torch.float32, device=codes.device
    )
    return lut[(codes & 0xF).long()].to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of FP4 codes (last dim {codes.shape[-1]})")
    codes = codes.to(torch.uint8)
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
    (gpt-oss, transformers, compressed-tensors): ``nan_byte`` picks "nan" or "inf".
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
