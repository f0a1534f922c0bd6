"""The public codec surface: quantize / dequantize / fake_quantize over every format and profile.

Blocks run along the last dimension; any leading dimensions (3-D expert stacks ``[E, N, K]``
included) are independent rows of blocks. This module only validates, pads and dispatches; the
math of each format lives once, in ``mx.py`` and ``nvfp4.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import FormatSpec, format_spec
from .recipe import Recipe, parse_recipe

_FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, repr=False)
class QuantizedTensor:
    """A block-quantized tensor as libraries store it.

    data:  mxfp4/nvfp4: uint8 ``[..., K/2]`` codes, element 2i in the low nibble;
           mxfp8: float8 ``[..., K]``.
    scale: MX: uint8 E8M0 bytes ``[..., K/32]``; NVFP4: float8_e4m3fn ``[..., K/16]``.
    global_scale: NVFP4 only: fp32 per-tensor scale in the decode direction
           (x ~ code * scale * global_scale); a 0-dim tensor, or ``[E, 1, 1]``-style when one
           scale per leading index was asked for. None for MX.
    shape: the logical shape; differs from the padded storage only in the last dim.
    library_global: NVFP4 only, optional: the same global in the form the profile's library
           stores (TE: amax; compressed-tensors: 2688/amax). Those two decode from that form,
           and ``global_scale`` converted back can miss it by an fp32 ulp (up to 2 ulps in the
           output), so ``dequantize`` uses it when present. ``quantize`` always fills it.
    """

    fmt: str
    profile: str
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    shape: tuple[int, ...]
    library_global: torch.Tensor | None = None

    @property
    def spec(self) -> FormatSpec:
        return format_spec(self.fmt)

    @property
    def recipe(self) -> Recipe:
        return Recipe(self.fmt, self.profile)

    @property
    def padded_k(self) -> int:
        return self.data.shape[-1] * (2 if self.spec.packed else 1)

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()
        if self.global_scale is not None:
            n += self.global_scale.numel() * 4
        return n

    def __repr__(self) -> str:
        # The dataclass repr would print every code and scale: one line of what a user checks.
        parts = [f"{self.fmt}:{self.profile}", f"shape={tuple(self.shape)}",
                 f"blocks={self.scale.numel()}x{self.spec.block}", f"device={self.data.device.type}",
                 f"{self.nbytes()} bytes"]
        s = self.scale
        if s.numel() and s.device.type != "meta":
            if self.spec.scale == "e8m0":
                b = s.view(torch.uint8).to(torch.int32)
                parts.append(f"scale 2^[{int(b.min()) - 127}..{int(b.max()) - 127}]")
            else:
                f = s.float()
                parts.append(f"scale [{float(f.min()):.3g}..{float(f.max()):.3g}]")
        if self.global_scale is not None and self.global_scale.device.type != "meta":
            g = self.global_scale.float()
            parts.append(f"global={float(g):.4g}" if g.numel() == 1 else
                         f"global [{float(g.min()):.4g}..{float(g.max()):.4g}] x{g.numel()}")
        return f"QuantizedTensor({', '.join(parts)})"


def _resolve(fmt: str | Recipe, profile: str | None) -> Recipe:
    return parse_recipe(fmt, profile)


def quantize(
    x: torch.Tensor,
    fmt: str | Recipe,
    profile: str | None = None,
    *,
    pad: bool = False,
    global_amax: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (bf16/fp16/fp32, blocks along the last dim) with a format's profile.

    ``pad=True`` zero-pads a last dim that is not a multiple of the block (the logical shape is
    kept in ``q.shape`` and restored by ``dequantize``). For NVFP4, ``global_amax`` overrides the
    tensor amax used for the per-tensor scale (a scalar, or ``[E, 1, 1]`` for one scale per expert).
    """
    recipe = _resolve(fmt, profile)
    spec = format_spec(recipe.fmt)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"quantize expects a bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension to block along")
    shape = tuple(x.shape)
    k = shape[-1]
    rem = k % spec.block
    if rem:
        if not pad:
            raise ValueError(
                f"{recipe.fmt} blocks are {spec.block} wide along the last dim, which is {k} "
                f"(not a multiple); pass pad=True to zero-pad it"
            )
        x = torch.nn.functional.pad(x, (0, spec.block - rem))
    if spec.scale == "e8m0":
        from .mx import quantize_mx

        data, scale = quantize_mx(x, spec, recipe.profile)
        gs = lib = None
    else:
        from .nvfp4 import quantize_nvfp4_parts

        data, scale, gs, lib = quantize_nvfp4_parts(x, recipe.profile, global_amax)
    return QuantizedTensor(recipe.fmt, recipe.profile, data, scale, gs, shape, lib)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode to ``dtype`` with the stored profile's decoder, cropped to the logical shape."""
    spec = q.spec
    if spec.scale == "e8m0":
        from .mx import dequantize_mx

        out = dequantize_mx(q.data, q.scale, spec, q.profile, dtype)
    else:
        from .nvfp4 import dequantize_nvfp4

        out = dequantize_nvfp4(q.data, q.scale, q.global_scale, q.profile, dtype,
                               library_global=q.library_global)
    k = q.shape[-1]
    return out if out.shape[-1] == k else out[..., :k]


def fake_quantize(
    x: torch.Tensor, fmt: str | Recipe, profile: str | None = None, **kwargs
) -> torch.Tensor:
    """``dequantize(quantize(x, ...), x.dtype)``: same shape and dtype as ``x``."""
    return dequantize(quantize(x, fmt, profile, **kwargs), x.dtype)
