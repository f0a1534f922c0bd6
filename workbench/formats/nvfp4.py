"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one fp32 global scale per tensor.

Four libraries agree on the format and disagree on every operation order (docs/formats.md, NVFP4
table), so each is a row of ``PROFILES``: an ``NVFP4Profile`` whose fields are the library's own
steps, transcribed from its source (versions pinned in pyproject's ``dev`` extra):

- ``torchao``: ``torchao/prototype/mx_formats/nvfp4_tensor.py`` ``nvfp4_quantize`` and
  ``NVFP4Tensor.dequantize`` (0.18).
- ``te``: Transformer Engine's CUDA kernels ``cast/nvfp4/core_nvfp4.cuh`` (global and block scale,
  the ``quantization_and_transposition_SF`` variant used by ``quantize_transpose_nvfp4``) and
  ``dequantize_nvfp4.cuh``. TE cannot run here; ``nvfp4_profiles.py`` says what is assumed for NaN.
- ``modelopt-export``: ModelOpt 0.47 ``NVFP4QTensor.quantize`` / ``dequantize``.
- ``compressed-tensors``: 0.20.1 ``generate_gparam`` + ``calculate_qparams`` fed the weight's own
  min/max (bf16 weights: bf16 statistics, as llm-compressor's observers and our checkpoint
  fixtures do; quantize ``x.float()`` for fp32 statistics) + ``quantize_and_pack_fp4`` /
  ``NVFP4PackedCompressor.decompress``.

``QuantizedTensor.global_scale`` is always the decode-direction fp32 scale ``d``
(x ~ code * scale * d). Each library stores its own form (``library_global``): torchao and ModelOpt
store ``d`` itself, TE the fp32 amax, compressed-tensors ``2688/amax``. The conversion
``d <-> library_global`` is exact for torchao/ModelOpt and lossy by up to one fp32 ulp for TE and
compressed-tensors (about 15% of values do not survive ``1/(1/g)``), and those two libraries decode
from their own form. ``dequantize_nvfp4(..., library_global=g)`` therefore decodes bit-exactly when
the library form is known (checkpoints carry it); without it the form is recovered from ``d``.

Shape legend: ``x_RK`` input with leading dims R and last dim K; ``b_RB`` per-block values
(B = K/16 blocks); ``x_RBS`` blocked input (S = 16 elements per block); ``g`` a library global,
0-dim or ``[E, 1, 1]`` (one per expert of a 3-D stack).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .constants import E2M1_SIGN_BIT, NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR, div_const
from .elements import e2m1_decode_packed, e2m1_encode, pack_fp4
from .nvfp4_profiles import PROFILES, NVFP4Profile, get_profile

Tensor = torch.Tensor
__all__ = [
    "PROFILES", "NVFP4Parts", "NVFP4Profile", "dequantize_nvfp4", "from_library_global",
    "get_profile", "quantize_nvfp4", "quantize_nvfp4_parts", "to_library_global",
]


def _blocks(x: Tensor) -> Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


# --- global scale forms ----------------------------------------------------------------------


def from_library_global(g: Tensor | float, profile: str) -> Tensor:
    """A library's stored global (ModelOpt ``weight_scale_2``, compressed-tensors
    ``weight_global_scale``, TE amax, torchao ``per_tensor_scale``) -> decode-direction fp32."""
    form = get_profile(profile).global_form
    g = torch.as_tensor(g, dtype=torch.float32)
    if g.dim() == 1 and g.numel() == 1:  # compressed-tensors stores a [1] tensor
        g = g.reshape(())
    if form == "decode":
        return g
    if form == "amax":
        return div_const(g, NVFP4_GLOBAL_DIVISOR)
    return 1.0 / g


def to_library_global(d, profile: str | None = None) -> Tensor:
    """Decode-direction global -> the form the profile's library stores; inverse of
    ``from_library_global`` (exact for torchao/ModelOpt, within one ulp for TE/compressed-tensors).

    ``d`` is a tensor/float with ``profile`` given, or a ``QuantizedTensor`` (its own profile).
    """
    if profile is None:
        if getattr(d, "fmt", None) != "nvfp4":
            raise TypeError("to_library_global needs an nvfp4 QuantizedTensor, or a global scale "
                            f"and a profile; got {type(d).__name__}")
        d, profile = d.global_scale, d.profile
    form = get_profile(profile).global_form
    d = torch.as_tensor(d, dtype=torch.float32)
    if form == "decode":
        return d
    if form == "amax":
        return d * NVFP4_GLOBAL_DIVISOR
    return 1.0 / d


# --- the one encode path ---------------------------------------------------------------------


class NVFP4Parts(NamedTuple):
    data: Tensor  # uint8 [..., K/2]
    scale: Tensor  # float8_e4m3fn [..., K/16]
    global_scale: Tensor  # decode direction, 0-dim or [E, 1, 1]
    library_global: Tensor  # the same global in the form the profile's library stores


def _per_tensor(x: Tensor, value: Tensor | float, name: str) -> Tensor:
    """A per-tensor value as fp32: 0-dim, or ``[E, 1, ...]`` for one per leading index."""
    a = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    per_expert = (x.shape[0],) + (1,) * (x.dim() - 1)
    if x.dim() >= 2 and tuple(a.shape) == per_expert:
        return a  # kept even for E == 1, so callers can index experts uniformly
    if a.numel() == 1:
        return a.reshape(())
    raise ValueError(
        f"{name} must be a scalar or shape {list(per_expert)} (one per leading index) for an "
        f"input of shape {list(x.shape)}, got shape {list(a.shape)}"
    )


def _stats(amax: Tensor, x: Tensor, prof: NVFP4Profile) -> Tensor:
    """An amax (exact in x's dtype) in the dtype the profile's library computes scales in."""
    return amax.to(x.dtype) if prof.stats_in_input_dtype else amax


def _tile_amax(x_RBS: Tensor, amax: Callable[..., Tensor], tile_rows: int) -> Tensor:
    """Block amax over ``tile_rows`` x 16 tiles, repeated on every row of the tile."""
    if tile_rows == 1:
        return amax(x_RBS, -1)
    rows = x_RBS.shape[-3] if x_RBS.dim() >= 3 else 0
    if rows == 0 or rows % tile_rows:
        raise ValueError(
            f"{tile_rows}x16 tiles need a row dim (-2) that is a multiple of {tile_rows}, "
            f"got shape {list(x_RBS.shape[:-2]) + [x_RBS.shape[-2] * NVFP4_BLOCK]}"
        )
    t = x_RBS.reshape(*x_RBS.shape[:-3], rows // tile_rows, tile_rows, *x_RBS.shape[-2:])
    tile_TB = amax(amax(t, -1), -2)
    return tile_TB.repeat_interleave(tile_rows, dim=-2)


def _nan_codes(v: Tensor, prof: NVFP4Profile) -> Tensor:
    if prof.nan_code is not None:
        return prof.nan_code(v)
    # undefined in the library (compressed-tensors); a signed zero, as x86 gives
    return torch.signbit(v).to(torch.uint8) * E2M1_SIGN_BIT


def _round(v: Tensor, prof: NVFP4Profile) -> Tensor:
    codes = e2m1_encode(v, ties="even")  # every library rounds to nearest even and saturates
    if prof.zero_sign == "negative":
        codes = torch.where(v < 0, codes | E2M1_SIGN_BIT, codes & 0x7)
    nan = torch.isnan(v)
    if torch.compiler.is_compiling():
        # no data-dependent branch or mask-shaped tensor under torch.compile(fullgraph=True):
        # NaN codes are computed everywhere and selected, the same bytes
        return torch.where(nan, _nan_codes(v, prof), codes)
    if nan.any():  # rare: keep the common eager path free of per-element NaN work
        codes[nan] = _nan_codes(v[nan], prof)
    return codes


def quantize_nvfp4_parts(
    x: Tensor,
    profile: str,
    global_amax: Tensor | float | None = None,
    *,
    library_global: Tensor | float | None = None,
    tile_rows: int = 1,
) -> NVFP4Parts:
    """Quantize ``x`` (last dim a multiple of 16) exactly as ``profile``'s library does.

    ``global_amax`` replaces the tensor amax (scalar, or ``[E, 1, ...]`` for one global per
    leading index). ``library_global`` instead gives the global in the library's stored form
    (torchao ``per_tensor_scale``, ModelOpt ``weights_scaling_factor_2``, compressed-tensors
    ``weight_global_scale``, TE amax), as each library's own quantize call accepts it: re-encoding
    with a checkpoint's stored global reproduces the library bit for bit. ``tile_rows=16`` (``te``
    only) takes one scale per 16x16 tile of the last two dims, as TE does for weights; the tile
    scale is stored on each of its 16 rows, so ``scale`` keeps the ``[..., K/16]`` shape and every
    decoder treats it like 1x16 scales.
    """
    prof = get_profile(profile)
    if tile_rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"tile_rows must be 1 or {NVFP4_BLOCK}, got {tile_rows}")
    if tile_rows != 1 and prof.name != "te":
        raise ValueError(f"16x16 tiles are Transformer Engine's weight layout; profile {profile!r} "
                         "has only 1x16 blocks")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"nvfp4 quantizes fp32/bf16/fp16 tensors, got {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {list(x.shape)}")
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"nvfp4 needs a last dim that is a multiple of {NVFP4_BLOCK}, "
                         f"got shape {list(x.shape)}")
    xf = x.float()
    if library_global is not None:
        if global_amax is not None:
            raise ValueError("pass global_amax or library_global, not both")
        g = _per_tensor(x, library_global, "library_global")
    elif global_amax is not None:
        g = prof.global_from_amax(_per_tensor(x, global_amax, "global_amax"))
    else:
        g = prof.global_from_amax(_stats(prof.amax(xf), x, prof))
    x_RBS = _blocks(xf)
    s_RB = prof.block_scale(_stats(_tile_amax(x_RBS, prof.amax, tile_rows), x, prof), g)
    v_RBS = prof.scaled(x_RBS, s_RB, g)
    data = pack_fp4(_round(v_RBS, prof).reshape(x.shape))
    return NVFP4Parts(data, s_RB, from_library_global(g, profile), g)


def quantize_nvfp4(
    x: Tensor, profile: str, global_amax: Tensor | float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(data, scale, decode-direction global) for ``api.quantize``."""
    parts = quantize_nvfp4_parts(x, profile, global_amax)
    return parts.data, parts.scale, parts.global_scale


def dequantize_nvfp4(
    data: Tensor,
    scale: Tensor,
    global_scale: Tensor,
    profile: str,
    dtype: torch.dtype,
    *,
    library_global: Tensor | None = None,
) -> Tensor:
    """Decode with ``profile``'s library arithmetic; ``library_global`` (its own stored form)
    makes TE and compressed-tensors decodes bit-exact where ``global_scale`` alone cannot."""
    prof = get_profile(profile)
    if data.dtype != torch.uint8:
        raise TypeError(f"nvfp4 data must be uint8 (two codes per byte), got {data.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"nvfp4 scales must be float8_e4m3fn, got {scale.dtype}")
    k = data.shape[-1] * 2
    if k % NVFP4_BLOCK or tuple(scale.shape) != (*data.shape[:-1], k // NVFP4_BLOCK):
        raise ValueError(f"nvfp4 scale shape {list(scale.shape)} does not match data shape "
                         f"{list(data.shape)} (expected [..., {k // NVFP4_BLOCK}])")
    g = to_library_global(global_scale, profile) if library_global is None else library_global
    g = torch.as_tensor(g, dtype=torch.float32, device=data.device)
    if g.numel() == 1:
        g = g.reshape(())
    c = e2m1_decode_packed(data, torch.float32, neg_zero=prof.decode_neg_zero)
    return prof.decode(_blocks(c), scale, g).reshape(c.shape).to(dtype)
