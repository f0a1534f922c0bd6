"""One record per stored codec and per checkpoint layout: everything the reader knows about each.

A `Codec` owns its companion roles and their dtypes, its block width, its workbench.formats
format (MX / NVFP4) and its decoder. A `Layout` owns the suffixes that name each companion, the
quantization method it is read for, the workbench.formats profile whose *decoder* matches its
reference loader, and its storage quirks. Adding a layout or a codec is one record here; the
layout adapters (layouts.py) and views only read these records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from workbench.formats import QuantizedTensor, dequantize
from workbench.formats.nvfp4 import dequantize_nvfp4, from_library_global

from .codecs_extra import decode_fp8_block, decode_fp8_scaled, decode_int4

_E8 = (torch.uint8, torch.float8_e8m0fnu)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def row_slice(r: range) -> slice:
    """The slice that selects exactly the indices of a (positive-step) range."""
    return slice(r.start, r.start + r.step * len(r), r.step)


# -- decoders: (index, spec, lead, rows, c0, c1) -> [*lead_kept, len(rows), c1 - c0] -------------

def _decode_blocks(index, spec, lead: tuple, rows: range, c0: int, c1: int) -> torch.Tensor:
    """MX / NVFP4: read the scale blocks covering [c0, c1), decode with workbench.formats."""
    codec = CODECS[spec.codec]
    rs, B = row_slice(rows), spec.block
    b0, b1 = c0 // B, math.ceil(c1 / B)
    per = codec.bytes_per_block
    data = spec.part("data")
    if spec.blocks4d:
        d = index.read(data, (*lead, rs, slice(b0, b1), slice(None)))
        d = d.reshape(*d.shape[:-2], -1)
    else:
        d = index.read(data, (*lead, rs, slice(b0 * per, b1 * per)))
    s = index.read(spec.part("scale"), (*lead, rs, slice(b0, b1)))
    shape = (*d.shape[:-1], (b1 - b0) * B)
    if codec.fmt == "nvfp4":
        # decode from the global in the library's own stored form (compressed-tensors keeps
        # 2688/amax, ModelOpt amax/2688): bit-exact with that library's decoder
        lib = index.read(spec.part("global_scale")).float().reshape(())
        out = dequantize_nvfp4(d, s, from_library_global(lib, spec.profile), spec.profile,
                               torch.bfloat16, library_global=lib)
    else:
        if s.dtype == torch.float8_e8m0fnu:
            s = s.view(torch.uint8)
        out = dequantize(QuantizedTensor(codec.fmt, spec.profile, d, s, None, shape),
                         torch.bfloat16)
    return out[..., c0 - b0 * B: c1 - b0 * B]


def _decode_int4(index, spec, lead: tuple, rows: range, c0: int, c1: int) -> torch.Tensor:
    G = spec.block
    g0, g1 = c0 // G, math.ceil(c1 / G)
    rs = row_slice(rows)
    w = index.read(spec.part("data"), (rs, slice(g0 * G // 8, math.ceil(g1 * G / 8))))
    s = index.read(spec.part("scale"), (rs, slice(g0, g1)))
    return decode_int4(w, s, G)[..., c0 - g0 * G: c1 - g0 * G]


def _decode_fp8(index, spec, lead: tuple, rows: range, c0: int, c1: int) -> torch.Tensor:
    rs = row_slice(rows)
    w = index.read(spec.part("data"), (rs, slice(c0, c1)))
    if spec.codec == "fp8-block" or spec.scale_kind == "block":
        br, bc = spec.row_block, spec.block
        ridx = torch.tensor(list(rows))
        sr0 = rows.start // br
        s = index.read(spec.part("scale"), (slice(sr0, rows[-1] // br + 1),
                                            slice(c0 // bc, math.ceil(c1 / bc))))
        # DeepSeek multiplies in fp32; compressed-tensors' block strategy in the scale's dtype
        math_dtype = torch.float32 if spec.codec == "fp8-block" else s.dtype
        return decode_fp8_block(w, s[(ridx // br) - sr0], c0, bc, math_dtype)
    s = index.read(spec.part("scale"))
    if spec.scale_kind == "channel":
        s = s.reshape(-1, 1)[rs]
    return decode_fp8_scaled(w, s.reshape(-1, 1) if s.dim() else s)


@dataclass(frozen=True)
class Codec:
    """A stored encoding of one weight.

    roles:  companion role -> the dtypes it may be stored in ("data" first).
    family: codecs that carry the same bits under different conventions share one family
            (NVFP4 with ModelOpt's or compressed-tensors' global; FP8 with any scale layout).
    fmt:    the workbench.formats format it decodes through (None: decoded here, INT4 / FP8).
    block:  logical columns per scale entry for fmt codecs (INT4 / FP8 read it from the config).
    bits:   (num_bits, type) a compressed-tensors config must declare for it, if it is one.
    """

    name: str
    roles: Mapping[str, tuple[torch.dtype, ...]]
    decode: Callable
    family: str
    fmt: str | None = None
    block: int | None = None
    bits: tuple[int, str] | None = None

    @property
    def bytes_per_block(self) -> int:
        """Stored data bytes (or fp8 elements) per block along the last dim."""
        return self.block // 2 if self.bits is not None and self.bits[0] == 4 else self.block


_CODEC_LIST = (
    Codec("mxfp4", {"data": (torch.uint8,), "scale": _E8}, _decode_blocks, "mxfp4",
          fmt="mxfp4", block=32, bits=(4, "float")),
    Codec("nvfp4", {"data": (torch.uint8,), "scale": (torch.float8_e4m3fn,),
                    "global_scale": (torch.float32,)}, _decode_blocks, "nvfp4",
          fmt="nvfp4", block=16, bits=(4, "float")),
    # compressed-tensors stores the NVFP4 global scale encode-direction (2688 / amax)
    Codec("nvfp4-ct", {"data": (torch.uint8,), "scale": (torch.float8_e4m3fn,),
                       "global_scale": (torch.float32,)}, _decode_blocks, "nvfp4",
          fmt="nvfp4", block=16, bits=(4, "float")),
    Codec("mxfp8_e4m3", {"data": (torch.float8_e4m3fn,), "scale": _E8}, _decode_blocks,
          "mxfp8_e4m3", fmt="mxfp8_e4m3", block=32, bits=(8, "float")),
    Codec("int4", {"data": (torch.int32,), "scale": _FLOATS, "shape": (torch.int32, torch.int64)},
          _decode_int4, "int4", bits=(4, "int")),
    Codec("fp8", {"data": (torch.float8_e4m3fn,), "scale": _FLOATS}, _decode_fp8, "fp8",
          bits=(8, "float")),
    Codec("fp8-block", {"data": (torch.float8_e4m3fn,), "scale": (torch.float32,)}, _decode_fp8,
          "fp8"),
)
CODECS: dict[str, Codec] = {c.name: c for c in _CODEC_LIST}


@dataclass(frozen=True)
class Layout:
    """How one family of checkpoints names and stores a quantized weight.

    method:      the `QuantConfig.method` read with this layout.
    suffixes:    companion role -> suffix on the weight's stored name ("" = the name itself;
                 a role missing here is stored under the weight's own name, e.g. FP8 data).
    profile:     the workbench.formats profile whose decoder matches the layout's reference
                 loader (MX / NVFP4 only).
    blocks4d:    packed data is `[..., N, K/32, 16]` instead of `[..., N, K/2]`.
    interleaved: fused gate_up rows alternate gate, up.
    stored_scope: the config names no targets; a scale companion on disk marks a weight quantized.
    """

    name: str
    method: str
    suffixes: Mapping[str, str]
    profile: str | None = None
    blocks4d: bool = False
    interleaved: bool = False
    stored_scope: bool = False

    @property
    def role_of_suffix(self) -> dict[str, str]:
        """Non-empty suffix -> role, longest first (so `_scale_2` wins over `_scale`)."""
        return dict(sorted(((s, r) for r, s in self.suffixes.items() if s),
                           key=lambda kv: -len(kv[0])))

    def companion(self, base: str, role: str) -> str:
        """The stored name a role of `base` would have (for messages about missing ones)."""
        return base + self.suffixes.get(role, f"<{role}>")


_LAYOUT_LIST = (
    Layout("compressed-tensors", "compressed-tensors",
           {"data": "_packed", "scale": "_scale", "global_scale": "_global_scale",
            "shape": "_shape", "zero_point": "_zero_point"}, profile="compressed-tensors"),
    # transformers decodes `_blocks/_scales` with ldexp (byte 0 -> 2^-127, 0xFF -> the exact
    # 2^128, so zero codes stay zero, no saturation): the "transformers" profile;
    # triton_kernels' own decoder would saturate and give NaN for 0xFF, compressed-tensors' NaN
    # for 0 x 2^128.
    Layout("gpt-oss", "mxfp4", {"data": "_blocks", "scale": "_scales"}, profile="transformers",
           blocks4d=True, interleaved=True),
    Layout("modelopt", "modelopt", {"data": "", "scale": "_scale", "global_scale": "_scale_2"},
           profile="modelopt-export"),
    Layout("fp8-block", "fp8", {"data": "", "scale": "_scale_inv"}, stored_scope=True),
    Layout("dense", "dense", {}),
)
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in _LAYOUT_LIST}
LAYOUT_OF_METHOD: dict[str, Layout] = {lay.method: lay for lay in _LAYOUT_LIST}
