"""Host side of the fused AdamW update: ``param.addcdiv_(exp_avg, denom, value=alpha)`` on an
expert stack [E, ...] that also returns the per-expert abs-max of the new values ([E, 1, ...]
fp32, NaN propagating), bit-equal to ``param.abs().amax(dim=(-2, -1), keepdim=True).float()``
read after the write. One launch; the caller bumps the version counter
(`workbench.train.optim.AdamW` does, then seeds the NVFP4 amax cache with the result)."""

from __future__ import annotations

import torch

from .api import _bits, _interpret, _triton, triton_cdiv

_DTYPES = (torch.bfloat16, torch.float32)


def _kernel():
    _triton()  # Triton, or TritonUnavailable naming the gpu extra (api's one check)
    from . import _adamw_kernel

    return _adamw_kernel


def addcdiv_amax_(param: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor,
                  value: float, *, contract: bool = True) -> torch.Tensor:
    """In place ``param += value * (exp_avg / denom)`` (fp32 arithmetic, IEEE division, one
    rounding to the param dtype) and the fp32 abs-max of each leading index of the stored result.

    ``param``, ``exp_avg`` and ``denom``: contiguous, one shape [E, ...] with E >= 1 and non-empty
    experts, one dtype (bf16 or fp32), one device (CUDA, or CPU under TRITON_INTERPRET=1).
    ``contract``: fuse the multiply and add into one fma (see ``_adamw_kernel``)."""
    if param.dtype not in _DTYPES:
        raise TypeError(f"addcdiv_amax_ takes bf16/fp32 params, got {param.dtype}")
    for name, t in (("exp_avg", exp_avg), ("denom", denom)):
        if t.shape != param.shape or t.dtype != param.dtype or t.device != param.device:
            raise ValueError(f"addcdiv_amax_: {name} is {t.dtype} {list(t.shape)} on {t.device}, "
                             f"param {param.dtype} {list(param.shape)} on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"addcdiv_amax_: {name} must be contiguous")
    if not param.is_contiguous():
        raise ValueError("addcdiv_amax_: param must be contiguous (it is written in place)")
    if param.dim() < 2 or param.numel() == 0:
        raise ValueError(f"addcdiv_amax_ expects a non-empty [E, ...] stack, got shape "
                         f"{list(param.shape)}")
    if not (param.is_cuda or _interpret()):
        raise ValueError("Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    k = _kernel()
    n_exp = param.shape[0]
    n_per = param.numel() // n_exp
    bits = torch.zeros(n_exp, dtype=torch.int32, device=param.device)
    # 4096 elements per program (8 KiB of bf16 per operand), as the codecs' MX tile; the
    # interpreter costs ~5 ms per program, so it gets few big ones
    block = 1 << 20 if _interpret() else 4096
    block = min(block, 1 << max(4, (n_per - 1).bit_length()))
    extra = {} if contract else {"enable_fp_fusion": False}
    k.addcdiv_amax_kernel[(n_exp, triton_cdiv(n_per, block))](
        _bits(param), _bits(exp_avg), _bits(denom), bits, n_per, float(value), BLOCK=block,
        BF16_BITS=param.dtype == torch.bfloat16, HW=not _interpret(), CONTRACT=contract,
        num_warps=4, **extra)
    return bits.view(torch.float32).reshape((n_exp,) + (1,) * (param.dim() - 1))
