"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one fp32 per-tensor scale.

PRELIMINARY: only the torchao profile's ordinary path; the te / modelopt-export /
compressed-tensors profiles and special values are being completed against their libraries.
"""

from __future__ import annotations

import torch

from .constants import E2M1_MAX, E4M3_MAX, NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR
from .elements import e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4

_E4M3_MIN_NORMAL = 2.0**-6


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def quantize_nvfp4(
    x: torch.Tensor, profile: str, global_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if profile != "torchao":
        raise NotImplementedError(f"NVFP4 profile {profile!r} is not implemented yet")
    xf = x.float()
    amax = xf.abs().amax() if global_amax is None else global_amax.float()
    pts = amax / NVFP4_GLOBAL_DIVISOR
    xb = _blocks(xf)
    bamax = xb.abs().amax(-1)
    pts_b = pts.reshape(pts.shape + (1,) * 0) if pts.dim() == 0 else pts
    s = ((bamax / E2M1_MAX) / pts_b).clamp(_E4M3_MIN_NORMAL, E4M3_MAX).to(torch.float8_e4m3fn)
    v = xb * ((1.0 / pts_b).unsqueeze(-1) / s.float().unsqueeze(-1)) if pts.dim() else xb * (
        (1.0 / pts) / s.float().unsqueeze(-1)
    )
    data = pack_fp4(e2m1_encode(v.reshape(x.shape)))
    return data, s, pts


def dequantize_nvfp4(
    data: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    profile: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(data))
    gs = global_scale.float()
    s = scale.float() * (gs if gs.dim() == 0 else gs)
    vb = _blocks(vals) * s.unsqueeze(-1)
    return vb.reshape(vals.shape).to(dtype)
