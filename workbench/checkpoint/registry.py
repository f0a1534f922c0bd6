"""One record per stored codec and per checkpoint layout: everything the reader knows about each.

A `Codec` owns its companion roles and their dtypes, its block width, its workbench.formats
format (MX / NVFP4), the check of its stored shapes, the LogicalSpec it builds and its decoder. A `Layout` owns the suffixes that name each companion, the
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
from .errors import CheckpointError, ConfigError, ShapeMismatchError

_E8 = (torch.uint8, torch.float8_e8m0fnu)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LogicalSpec:
    """One logical weight: where its parts are stored and how to decode them."""

    name: str
    codec: str | None  # None: stored dense
    shape: tuple[int, ...]  # logical shape, Linear convention [..., out, in]
    stored_dtype: torch.dtype
    parts: tuple[tuple[str, str], ...]  # (role, stored tensor name)
    block: int = 1  # logical columns per scale entry
    row_block: int = 1  # logical rows per scale entry (fp8-block)
    blocks4d: bool = False  # gpt-oss data is [..., N, K/32, 16]
    profile: str | None = None
    scale_kind: str | None = None  # fp8 (compressed-tensors float-quantized): tensor|channel|block
    transposed: bool = False  # dense stored [..., in, out] (transformers' fused gpt-oss experts)
    interleaved: bool = False  # fused gate_up rows alternate gate, up (gpt-oss)

    def part(self, role: str) -> str | None:
        return dict(self.parts).get(role)


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
        math_dtype = torch.float32 if CODECS[spec.codec].fp32_block_math else s.dtype
        return decode_fp8_block(w, s[(ridx // br) - sr0], c0, bc, math_dtype)
    s = index.read(spec.part("scale"))
    if spec.scale_kind == "channel":
        s = s.reshape(-1, 1)[rs]
    return decode_fp8_scaled(w, s.reshape(-1, 1) if s.dim() else s)


# -- per-codec shape checks and specs: (index, layout, qcfg, base, g, shape, codec) -------------
# `g` is the weight's {role: stored name}; `shape` its logical shape (packed widths unpacked).

def _mismatch(index, g, role, got, want, codec) -> ShapeMismatchError:
    e = index.entry(g[role])
    return ShapeMismatchError(f"{role} shape {list(got)} does not fit {codec.name} data "
                              f"{list(index.entry(g['data']).shape)} (expected {list(want)})",
                              path=e.file, tensor=g[role])


def _check_blocks(index, layout, qcfg, base, g, shape, c) -> list[CheckpointError]:
    d, s = index.entry(g["data"]), index.entry(g["scale"])
    bad: list[CheckpointError] = []
    b, cols = c.block, shape[-1]
    if layout.blocks4d and (len(d.shape) < 3 or d.shape[-1] != c.bytes_per_block):
        bad.append(_mismatch(index, g, "data", d.shape, (*d.shape[:-1], c.bytes_per_block), c))
    elif cols % b:
        bad.append(ShapeMismatchError(f"{cols} logical columns are not a multiple of the "
                                      f"{b}-wide {c.name} block", path=d.file, tensor=g["data"]))
    elif s.shape != (*shape[:-1], cols // b):
        bad.append(_mismatch(index, g, "scale", s.shape, (*shape[:-1], cols // b), c))
    if "global_scale" in c.roles:
        gs = index.entry(g["global_scale"])
        if math.prod(gs.shape) != 1:
            bad.append(_mismatch(index, g, "global_scale", gs.shape, (1,), c))
    return bad


def _spec_blocks(index, layout, qcfg, base, g, shape, c) -> LogicalSpec:
    return LogicalSpec(base, c.name, shape, index.entry(g["data"]).dtype, _parts(g),
                       block=c.block, blocks4d=layout.blocks4d, profile=layout.profile,
                       interleaved=layout.interleaved)


def qcfg_group_size(qcfg, base: str) -> int:
    for grp in qcfg.groups:
        if grp.codec == "int4" and grp.weights is not None and grp.weights.group_size:
            return int(grp.weights.group_size)
    raise ConfigError("INT4 weights need a group_size in the config", path=qcfg.source,
                      tensor=base)


def _check_int4(index, layout, qcfg, base, g, shape, c) -> list[CheckpointError]:
    d, s = index.entry(g["data"]), index.entry(g["scale"])
    w = qcfg_group_size(qcfg, base)
    sh = index.entry(g["shape"])
    if sh.shape != (2,) or len(d.shape) != 2:
        return [ShapeMismatchError(f"INT4 needs 2-D data and a [2] weight_shape, got "
                                   f"{list(d.shape)} and {list(sh.shape)}", path=sh.file,
                                   tensor=g["shape"])]
    rows, cols = (int(v) for v in index.read(g["shape"]).tolist())
    if d.shape != (rows, math.ceil(cols * 4 / 32)):
        return [_mismatch(index, g, "data", d.shape, (rows, math.ceil(cols * 4 / 32)), c)]
    if cols % w or s.shape != (rows, cols // w):
        return [_mismatch(index, g, "scale", s.shape, (rows, cols // w), c)]
    return []


def _spec_int4(index, layout, qcfg, base, g, shape, c) -> LogicalSpec:
    rows, cols = (int(v) for v in index.read(g["shape"]).tolist())  # the true width
    return LogicalSpec(base, c.name, (rows, cols), index.entry(g["data"]).dtype, _parts(g),
                       block=qcfg_group_size(qcfg, base))


def ct_fp8_block(qcfg) -> tuple[int, int] | None:
    """compressed-tensors' FP8 "block" strategy tiles (None for tensor / channel scales)."""
    for grp in qcfg.groups:
        w = grp.weights
        if grp.codec == "fp8" and w is not None and w.strategy == "block" and w.block_structure:
            return (int(w.block_structure[0]), int(w.block_structure[1]))
    return None


def _fp8_tiles(qcfg, c) -> tuple[int, int] | None:
    # DeepSeek's config states its tiles for every weight; compressed-tensors per group
    if c.name == "fp8-block":
        blk = qcfg.weight_block_size
        return None if blk is None else (int(blk[0]), int(blk[1]))
    return ct_fp8_block(qcfg)


def _check_fp8(index, layout, qcfg, base, g, shape, c) -> list[CheckpointError]:
    d, s = index.entry(g["data"]), index.entry(g["scale"])
    # the FP8 decoders read 2-D [out, in] data only: any other rank is refused here, at open,
    # rather than by the first read
    if len(d.shape) != 2:
        return [ShapeMismatchError(f"{c.name} data must be 2-D [out, in], got {list(d.shape)}",
                                   path=d.file, tensor=g["data"])]
    r = d.shape[0]
    blk = _fp8_tiles(qcfg, c)
    if blk is not None:
        want = (math.ceil(d.shape[0] / blk[0]), math.ceil(d.shape[1] / blk[1]))
        if s.shape != want:
            return [_mismatch(index, g, "scale", s.shape, want, c)]
    elif s.shape not in ((), (1,), (r, 1), (r,)):
        return [_mismatch(index, g, "scale", s.shape, (r, 1), c)]
    return []


def _spec_fp8(index, layout, qcfg, base, g, shape, c) -> LogicalSpec:
    dtype, parts = index.entry(g["data"]).dtype, _parts(g)
    blk = _fp8_tiles(qcfg, c)
    if blk is not None:  # DeepSeek's tiles, or compressed-tensors' block strategy (same tiles)
        kind = None if c.name == "fp8-block" else "block"
        return LogicalSpec(base, c.name, shape, dtype, parts, block=blk[1], row_block=blk[0],
                           scale_kind=kind)
    s = index.entry(g["scale"]).shape
    kind = "tensor" if math.prod(s) == 1 and shape[0] != 1 else "channel"
    return LogicalSpec(base, c.name, shape, dtype, parts, scale_kind=kind)


def _parts(g: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((r, n) for r, n in g.items() if r != "_conflict"))


@dataclass(frozen=True)
class Codec:
    """A stored encoding of one weight.

    roles:  companion role -> the dtypes it may be stored in ("data" first).
    family: codecs that carry the same bits under different conventions share one family
            (NVFP4 with ModelOpt's or compressed-tensors' global; FP8 with any scale layout).
    fmt:    the workbench.formats format it decodes through (None: decoded here, INT4 / FP8).
    block:  logical columns per scale entry for fmt codecs (INT4 / FP8 read it from the config).
    bits:   (num_bits, type) a compressed-tensors config must declare for it, if it is one.
    check:  shape check of the stored parts against the logical shape -> errors.
    spec:   builds the weight's LogicalSpec (block widths, scale kind, profile of the layout).
    fp32_block_math: block scales are applied in fp32 (DeepSeek), not in the scale's dtype.
    """

    name: str
    roles: Mapping[str, tuple[torch.dtype, ...]]
    decode: Callable
    family: str
    fmt: str | None = None
    block: int | None = None
    bits: tuple[int, str] | None = None
    check: Callable = _check_blocks
    spec: Callable = _spec_blocks
    fp32_block_math: bool = False

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
          _decode_int4, "int4", bits=(4, "int"), check=_check_int4, spec=_spec_int4),
    Codec("fp8", {"data": (torch.float8_e4m3fn,), "scale": _FLOATS}, _decode_fp8, "fp8",
          bits=(8, "float"), check=_check_fp8, spec=_spec_fp8),
    Codec("fp8-block", {"data": (torch.float8_e4m3fn,), "scale": (torch.float32,)}, _decode_fp8,
          "fp8", check=_check_fp8, spec=_spec_fp8, fp32_block_math=True),
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
