"""The stored quantization grid of one expert projection, undecoded: codes and scales.

Analysis needs what the file holds (which codes are zero, which scale exponents occur, which
elements sit at the format maximum), not only the decoded values that views give.
"""

from __future__ import annotations

import torch

from workbench.formats import QuantizedTensor

from .experts import ExpertRecord
from .layouts import FMT_OF_CODEC


def stored_grid(ck, rec: ExpertRecord) -> QuantizedTensor | None:
    """``QuantizedTensor`` ``[out, in]`` of one record's stored MX/NVFP4 bytes; None when the
    weight is stored dense or in a codec workbench.formats does not model (INT4, FP8 block).

    NVFP4 global scales are converted to the decode direction; gpt-oss ``[.., K/32, 16]`` blocks
    are flattened; row maps (gpt-oss interleaved gate/up, TE fc1 halves) are applied.
    """
    spec = ck.spec(rec.name)
    if spec.codec not in FMT_OF_CODEC:
        return None
    lead = () if rec.lead is None else (rec.lead,)
    n = rec.shape[0]
    rows = slice(rec.row_offset, rec.row_offset + rec.row_stride * n, rec.row_stride)
    data = ck.index.read(spec.part("data"), (*lead, rows))
    if spec.blocks4d:
        data = data.reshape(*data.shape[:-2], -1)
    scale = ck.index.read(spec.part("scale"), (*lead, rows))
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    gs = lib = None
    fmt = FMT_OF_CODEC[spec.codec]
    if fmt == "nvfp4":
        from workbench.formats.nvfp4 import from_library_global

        lib = ck.index.read(spec.part("global_scale")).float().reshape(())
        gs = from_library_global(lib, spec.profile)
    # the library's own stored global too, so dequantize(grid) is bit-exact with its decoder
    return QuantizedTensor(fmt, spec.profile, data, scale, gs, (n, rec.shape[1]), lib)
