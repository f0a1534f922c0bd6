"""Decoders for stored formats that `workbench.formats` does not cover, or covers differently.

* FP8 block (DeepSeek-V3 `weight_scale_inv`): `y = fp8.float() * scale_inv[r // 128, c // 128]`
  in fp32, then bf16 -- the order of DeepSeek's reference `weight_dequant`.
* INT4 `pack-quantized` (compressed-tensors, Kimi K2): 8 codes per int32 word, element i at bits
  4i..4i+3 (little-endian bytes, low nibble first), stored with offset +8; decode
  `(code - 8).to(scale.dtype) * scale` like compressed-tensors' `_dequantize` (bf16 math when the
  scale is bf16).
* FP8 with a per-tensor / per-channel / block scale (compressed-tensors `float-quantized`):
  `fp8.to(scale.dtype) * scale`, as its `_dequantize`.
MX and NVFP4 decode through `workbench.formats` (NVFP4 with the library's own stored global,
`dequantize_nvfp4(..., library_global=...)`, which is what makes compressed-tensors' encode-
direction `weight_global_scale` decode bit-exactly).
"""

from __future__ import annotations

import torch


def decode_fp8_block(w_RC: torch.Tensor, s_rc: torch.Tensor, c0: int, bc: int,
                     math_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_RC: fp8 rows, columns from c0; s_rc: the scale row of each of those rows, scale
    columns starting at block c0 // bc. DeepSeek multiplies in fp32; compressed-tensors' FP8
    "block" strategy in the scale's dtype (`math_dtype`)."""
    cols = torch.arange(w_RC.shape[-1]) + c0
    s = s_rc[:, (cols // bc) - (c0 // bc)]
    return (w_RC.to(math_dtype) * s.to(math_dtype)).to(torch.bfloat16)


def unpack_int4(words_RW: torch.Tensor) -> torch.Tensor:
    """int32 words -> int8 codes in [-8, 7], 8 per word, element order as packed."""
    b = words_RW.contiguous().view(torch.uint8)  # little-endian byte order (x86, ARM)
    lo, hi = b & 0xF, b >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(*words_RW.shape[:-1], -1)
    return codes.to(torch.int16).sub(8).to(torch.int8)


def decode_int4(words_RW: torch.Tensor, scale_RG: torch.Tensor, group: int) -> torch.Tensor:
    q = unpack_int4(words_RW)
    q = q[..., : scale_RG.shape[-1] * group]
    s = scale_RG.repeat_interleave(group, dim=-1)
    return (q.to(scale_RG.dtype) * s).to(torch.bfloat16)


def decode_fp8_scaled(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.to(scale.dtype) * scale).to(torch.bfloat16)

