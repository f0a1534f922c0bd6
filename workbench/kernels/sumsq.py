"""Host side of the fp64 sum of squares (``workbench.train.loop.global_grad_norm`` calls it on
CUDA gradients).

``sum_of_squares(x)`` is ``x.double().pow(2).sum()`` in one pass over ``x``: torch's three ops
write and re-read an fp64 copy (~36 bytes of traffic per fp32 element; its share of a step:
docs/kernels.md); this reads 4 (fp32) or 2 (bf16) bytes per element. Squares
are exact in fp64, the sums round in fp64 in an order fixed by the size (no atomics), so the
result is deterministic; it is not bit-equal to torch's sum, whose order differs.
"""

from __future__ import annotations

import torch

from .api import _bits, _interpret, _require_device, _triton, triton_cdiv

_DTYPES = (torch.bfloat16, torch.float32)

# GPU tiling. One program reads BLOCK = 4096 elements per loop iteration with 8 warps (16 lanes
# per thread: 64 B of fp32 or 32 B of bf16 in flight per thread per iteration, 16 fp64
# accumulators = 32 registers), and loops so that a large tensor gets at most MAX_PROGRAMS
# programs: a 2.4e9-element gradient is 4069 programs of 144 iterations (2.4 MB of fp32 each),
# ~4 waves of resident programs over an H200's 132 SMs, each long enough that its start, its
# in-program fp64 tree sum and its one 8-byte store are noise against the streaming loads, and
# few enough partials (<= 4096) that the final torch.sum over them is a few microseconds.
# Tensors of up to 16.8M elements get one iteration per program (cdiv(n, 4096) programs).
BLOCK = 4096
MAX_PROGRAMS = 4096
NUM_WARPS = 8
# The interpreter costs ~5 ms per program and per loop iteration a few numpy ops on the whole
# block: few programs of big blocks.
_INTERPRET_BLOCK = 1 << 16
_INTERPRET_MAX_PROGRAMS = 16


def _kernel():
    _triton()  # Triton, or TritonUnavailable naming the gpu extra (api's one check)
    from . import _sumsq_kernel

    return _sumsq_kernel


def _tiling(n: int, block: int | None, max_programs: int | None) -> tuple[int, int, int]:
    """(block, iters, programs) for ``n`` > 0 elements."""
    if block is None:
        block = min(_INTERPRET_BLOCK, 1 << max(4, (n - 1).bit_length())) if _interpret() \
            else BLOCK
    if max_programs is None:
        max_programs = _INTERPRET_MAX_PROGRAMS if _interpret() else MAX_PROGRAMS
    if block < 16 or block & (block - 1) or max_programs < 1:
        raise ValueError(f"sum_of_squares: block must be a power of two >= 16 and max_programs "
                         f">= 1, got block={block}, max_programs={max_programs}")
    iters = triton_cdiv(triton_cdiv(n, block), max_programs)
    return block, iters, triton_cdiv(n, block * iters)


def sum_of_squares(x: torch.Tensor, *, block: int | None = None,
                   max_programs: int | None = None) -> torch.Tensor:
    """The sum over all elements of ``float64(x) ** 2`` as a 0-d float64 tensor on ``x``'s
    device: every square exact, every sum in fp64, one pass over ``x``, deterministic (the same
    bits for the same input and tiling). NaN and inf propagate as in torch; empty gives 0.

    ``x``: fp32 or bf16, contiguous, on CUDA (or CPU under TRITON_INTERPRET=1). ``block`` /
    ``max_programs``: override the tiling (tests use small ones to get many programs and loop
    iterations); the default is the module's ``BLOCK`` / ``MAX_PROGRAMS``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES:
        raise TypeError(f"sum_of_squares takes fp32/bf16 tensors, got {getattr(x, 'dtype', x)}")
    if not x.is_contiguous():
        # a copy would cost another pass; gradients are contiguous
        raise ValueError(f"sum_of_squares: x must be contiguous (shape {list(x.shape)}, stride "
                         f"{list(x.stride())})")
    _require_device(x)
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    block, iters, programs = _tiling(n, block, max_programs)
    partial = torch.empty(programs, dtype=torch.float64, device=x.device)
    _kernel().sumsq_kernel[(programs,)](
        _bits(x), partial, n, iters, BLOCK=block, BF16_BITS=x.dtype == torch.bfloat16,
        num_warps=NUM_WARPS)
    # a fixed-order reduction of the partials (not atomics): run-to-run identical bits
    return partial.sum()
