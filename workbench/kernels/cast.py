"""Host side of the exact bf16 -> fp32 widening (``workbench.model.cast`` uses it for the
gradients of fp32 masters that bf16 autocast cast down).

``widen_bf16(x)`` is ``x.float()`` bit for bit in one vectorised pass. torch 2.11's CUDA copy
widens bf16 through its generic casting kernel (``unrolled_elementwise_kernel`` of
``direct_copy_kernel_cuda``, one element per thread per load; the vectorised
``bfloat16tofloat32`` copy is ROCm-only), about half the rate of the narrowing copy of the
same gradients (docs/kernels.md).
"""

from __future__ import annotations

import torch

from .api import _interpret, _require_device, _triton, triton_cdiv

# 2048 elements per program with 4 warps: 16 bf16 per thread (two 16-byte loads, four 16-byte
# stores); the grid is cdiv(n, 2048) programs (axis 0 holds 2^31 - 1 of them)
BLOCK = 2048
NUM_WARPS = 4
_INTERPRET_BLOCK = 1 << 16  # the interpreter: few programs of big blocks


def _kernel():
    _triton()  # Triton, or TritonUnavailable naming the gpu extra (api's one check)
    from . import _cast_kernel

    return _cast_kernel


def widen_bf16(x: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """A new contiguous fp32 tensor equal to ``x.float()`` bit for bit (NaN payloads included).
    ``x``: bf16, contiguous, on CUDA (or CPU under TRITON_INTERPRET=1). ``block``: override the
    tile (a power of two >= 16; tests use small ones to get many programs)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise TypeError(f"widen_bf16 takes a bf16 tensor, got {getattr(x, 'dtype', x)}")
    if not x.is_contiguous():
        raise ValueError(f"widen_bf16: x must be contiguous (shape {list(x.shape)}, stride "
                         f"{list(x.stride())})")
    _require_device(x)
    if block is None:
        block = _INTERPRET_BLOCK if _interpret() else BLOCK
    if block < 16 or block & (block - 1):
        raise ValueError(f"widen_bf16: block must be a power of two >= 16, got {block}")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _kernel().widen_kernel[(triton_cdiv(n, block),)](
            x.view(torch.int16), out, n, BLOCK=block, num_warps=NUM_WARPS)
    return out
