"""Triton kernel of the fp64 sum of squares, imported lazily by ``sumsq.py``.

``sumsq_kernel``: program ``p`` reads its ``iters * BLOCK`` contiguous elements once (fp32, or
bf16 as int16 bits), widens each to fp64, squares and accumulates it in an fp64 vector of
``BLOCK`` lanes, and writes the vector's sum to ``partial[p]``: no atomics, so the order of every
addition is fixed by (n, BLOCK, iters) and the result is the same run to run.

Squares are exact: an fp32 significand has 24 bits, its square at most 48 (< fp64's 53), and the
exponent range of the square (2^-298 .. 2^256) sits inside fp64's normal range. Only the
additions round.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import load_f32


@triton.jit
def sumsq_kernel(x_ptr, partial_ptr, n, iters, BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):
    """``partial[p] = sum(float64(x[i])**2)`` over ``i`` in ``[p * iters * BLOCK,
    (p + 1) * iters * BLOCK) ∩ [0, n)``."""
    # int64 offsets: a 2.4e9-element gradient is past int32's 2^31 - 1
    base = tl.program_id(0).to(tl.int64) * iters * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for i in range(iters):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        # masked lanes load 0 and add 0; bf16 widened from its bits (load_f32: the interpreter
        # would flush bf16 subnormals), then fp32 -> fp64 exactly
        v = load_f32(x_ptr, offs, mask, BF16_BITS).to(tl.float64)
        acc += v * v
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))
