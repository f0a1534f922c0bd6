"""Host side of the fused AdamW updates (`workbench.train.optim.AdamW` calls them):

- ``adamw_step_``: the whole single-tensor AdamW step of an fp32 master in one launch, torch's
  CUDA bits (the kernel's docstring lists the ops and the rounding switches below);
- ``addcdiv_amax_``: only its last op, ``param.addcdiv_(exp_avg, denom, value=alpha)``, on an
  expert stack [E, ...] of bf16 or fp32.

Both can return the per-expert abs-max of the new values ([E, 1, ...] fp32, NaN propagating),
bit-equal to ``param.abs().amax(dim=(-2, -1), keepdim=True).float()`` read after the write. The
caller bumps the version counter (the optimizer does, then hands the amax to its sink).
"""

from __future__ import annotations

import numpy as np
import torch

from .api import _bits, _interpret, _require_device, _triton, triton_cdiv

_DTYPES = (torch.bfloat16, torch.float32)

# How torch's CUDA AdamW ops round where the source leaves it to the compiler or to a host-side
# rewrite (``_adamw_kernel.adamw_kernel``); jobs/gpu/adamw_bits.py measures every combination
# against torch on a GPU, and these are the ones that gave torch's bits.
LERP_FMA = True  # exp_avg.lerp_: self + w * (end - self) contracted into one fma by nvcc
ADDCMUL_FMA = True  # addcmul_: ATen's explicit fma(value, t1 * t2, self)
DIV_RECIP = True  # sqrt(v) / bc2: ATen multiplies by the host scalar's reciprocal instead
CONTRACT = True  # addcdiv_: fma(value, t1 / t2, self)


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
    _require_device(param)
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


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as ATen converts a host scalar to a CUDA kernel's fp32 opmath."""
    return float(np.float32(x))


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: float, amax: bool = False,
                lerp_fma: bool | None = None, addcmul_fma: bool | None = None,
                div_recip: bool | None = None, contract: bool | None = None):
    """One AdamW step in place, the arithmetic of ``torch.optim.adam._single_tensor_adam``
    (decoupled weight decay, no amsgrad) at optimizer step ``step`` (already incremented):
    ``param``, ``exp_avg`` and ``exp_avg_sq`` are written. All four tensors fp32, contiguous,
    one shape and device (CUDA, or CPU under TRITON_INTERPRET=1).

    ``amax``: ``param`` is an expert stack [E, ...]; return the fp32 abs-max of each expert's
    new values ([E, 1, ...]), else None. The four rounding switches default to the module's
    measured constants (jobs/gpu/adamw_bits.py passes each value)."""
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.shape != param.shape or t.device != param.device:
            raise ValueError(f"adamw_step_: {name} is {t.dtype} {list(t.shape)} on {t.device}; "
                             f"every operand must be fp32 of param's shape {list(param.shape)} "
                             f"on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"adamw_step_: {name} must be contiguous")
    if param.numel() == 0 or (amax and param.dim() < 2):
        raise ValueError(f"adamw_step_ expects a non-empty tensor (an [E, ...] stack with amax), "
                         f"got shape {list(param.shape)}")
    _require_device(param)
    k = _kernel()
    n_exp = param.shape[0] if amax else 1
    n_per = param.numel() // n_exp
    bits = torch.zeros(n_exp if amax else 1, dtype=torch.int32, device=param.device)
    # the scalars as torch's host code computes them (Python floats) and its kernels take them
    # (rounded to fp32); ATen's reciprocal of the divisor is taken in double, then rounded
    # (jobs/gpu/adamw_bits.py: taken from the fp32 divisor instead, the bits differ)
    bc1 = 1 - beta1**step
    bc2_sqrt = (1 - beta2**step) ** 0.5
    w1, c2, alpha = _f32(1 - beta1), _f32(1 - beta2), _f32(-(lr / bc1))
    bc2, inv_bc2 = _f32(bc2_sqrt), _f32(1.0 / bc2_sqrt)
    block = 1 << 20 if _interpret() else 4096  # as addcdiv_amax_ (16 KiB per fp32 operand)
    block = min(block, 1 << max(4, (n_per - 1).bit_length()))
    pick = (lambda v, default: default if v is None else bool(v))
    k.adamw_kernel[(triton_cdiv(n_per, block), n_exp)](
        param, grad, exp_avg, exp_avg_sq, bits, n_per, _f32(1 - lr * weight_decay), w1,
        _f32(beta2), c2, inv_bc2, bc2, _f32(eps), alpha,
        BLOCK=block, DECAY=weight_decay != 0, LERP_SMALL=abs(w1) < 0.5,
        LERP_FMA=pick(lerp_fma, LERP_FMA), ADDCMUL_FMA=pick(addcmul_fma, ADDCMUL_FMA),
        C2_ONE=c2 == 1.0, DIV_RECIP=pick(div_recip, DIV_RECIP),
        CONTRACT=pick(contract, CONTRACT), ALPHA_ONE=alpha == 1.0, AMAX=bool(amax),
        num_warps=4, enable_fp_fusion=False)
    if not amax:
        return None
    return bits.view(torch.float32).reshape((n_exp,) + (1,) * (param.dim() - 1))
