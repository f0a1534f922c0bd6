"""The stored quantization grid of one expert projection, undecoded: codes and scales.

Analysis needs what the file holds (which codes are zero, which scale exponents occur, which
elements sit at the format maximum), not only the decoded values that views give.
"""

from __future__ import annotations

import torch

from workbench.formats import QuantizedTensor

from .experts import ExpertRecord
from .layouts import FMT_OF_CODEC
from workbench.formats.nvfp4 import from_library_global


def grid_selection(ck, rec: ExpertRecord) -> tuple:
    """``(*lead, rows)``: the index of one record's rows in its data and scale tensors (both
    stored ``[*lead, N, ...]``), as ``ShardIndex.read`` and ``read_into`` take it."""
    lead = () if rec.lead is None else (rec.lead,)
    n = rec.shape[0]
    return (*lead, slice(rec.row_offset, rec.row_offset + rec.row_stride * n, rec.row_stride))


def library_global(ck, spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(library's stored global as a 0-dim fp32, the decode-direction global) of an NVFP4
    weight."""

    lib = ck.index.read(spec.part("global_scale")).float().reshape(())
    return lib, from_library_global(lib, spec.profile)


def stored_grid(ck, rec: ExpertRecord) -> QuantizedTensor | None:
    """``QuantizedTensor`` ``[out, in]`` of one record's stored MX/NVFP4 bytes; None when the
    weight is stored dense or in a codec workbench.formats does not model (INT4, FP8 block).

    NVFP4 global scales are converted to the decode direction; gpt-oss ``[.., K/32, 16]`` blocks
    are flattened; row maps (gpt-oss interleaved gate/up, TE fc1 halves) are applied.
    ``stacks.py`` and ``windows.py`` build stacks of these straight into pinned buffers with the
    same steps (``grid_selection``, ``library_global``): keep the two in step.
    """
    spec = ck.spec(rec.name)
    if spec.codec not in FMT_OF_CODEC:
        return None
    index = grid_selection(ck, rec)
    data = ck.index.read(spec.part("data"), index)
    if spec.blocks4d:
        data = data.reshape(*data.shape[:-2], -1)
    scale = ck.index.read(spec.part("scale"), index)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    gs = lib = None
    fmt = FMT_OF_CODEC[spec.codec]
    if fmt == "nvfp4":
        lib, gs = library_global(ck, spec)
    # the library's own stored global too, so dequantize(grid) is bit-exact with its decoder
    return QuantizedTensor(fmt, spec.profile, data, scale, gs, (rec.shape[0], rec.shape[1]), lib)
