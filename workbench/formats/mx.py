"""MX block formats (OCP Microscaling v1.0): one E8M0 scale per 32 elements along the last dim.

PRELIMINARY: the scale rules of every profile and their special-value behaviour are being
completed and checked against torchao / compressed-tensors / ModelOpt (see FORMATS.md).
"""

from __future__ import annotations

import torch

from .constants import E8M0_BIAS, FormatSpec
from .elements import e2m1_decode, e2m1_encode, e8m0_to_fp32, fp32_exponent, fp32_mantissa, pack_fp4, unpack_fp4


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def scale_byte(amax: torch.Tensor, spec: FormatSpec, profile: str) -> torch.Tensor:
    """E8M0 byte for each block amax (fp32) under a profile's scale rule."""
    e = fp32_exponent(amax)
    if profile == "floor":
        k = e - spec.elem_emax
    elif profile == "rceil":
        # smallest k with elem_max * 2^k >= amax, in integers: bump when amax's mantissa exceeds
        # elem_max's (6 = 1.5 * 2^2, 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15).
        max_mant = fp32_mantissa(torch.tensor(spec.elem_max))
        k = e - spec.elem_emax + (fp32_mantissa(amax) > max_mant).to(torch.int32)
    else:
        raise NotImplementedError(f"MX profile {profile!r} is not implemented yet")
    byte = (k + E8M0_BIAS).clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    return byte.to(torch.uint8)


def quantize_mx(x: torch.Tensor, spec: FormatSpec, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocks(x.float(), spec.block)
    amax = xb.abs().amax(-1)
    byte = scale_byte(amax, spec, profile)
    v = xb / e8m0_to_fp32(byte).unsqueeze(-1)
    v = v.reshape(x.shape)
    if spec.element == "e2m1":
        data = pack_fp4(e2m1_encode(v))
    else:
        data = v.clamp(-spec.elem_max, spec.elem_max).to(spec.elem_dtype)
    return data, byte


def dequantize_mx(
    data: torch.Tensor, scale: torch.Tensor, spec: FormatSpec, profile: str, dtype: torch.dtype
) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(data)) if spec.element == "e2m1" else data.float()
    vb = _blocks(vals, spec.block) * e8m0_to_fp32(scale).unsqueeze(-1)
    return vb.reshape(vals.shape).to(dtype)
