"""Triton kernel of the exact bf16 -> fp32 widening, imported lazily by ``cast.py``.

``widen_kernel``: each program reads ``BLOCK`` bf16 values as their int16 bits and writes them
shifted into the high half of fp32 words (``_common.load_f32``): exact for every value,
subnormals, infinities and NaN payloads included. No atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import load_f32


@triton.jit
def widen_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # int64 offsets: gradients of 2^31 elements and more exist (a 151936 x 16384 embedding)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, load_f32(x_ptr, offs, mask, True), mask=mask)
