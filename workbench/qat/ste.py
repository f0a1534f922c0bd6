"""Fake quantization with an identity straight-through estimator (STE).

Forward: ``workbench.formats.fake_quantize`` (the reference codec), or on CUDA tensors the Triton
kernels of ``workbench.kernels`` with identical bits. Backward: the incoming gradient passes unchanged to the
BF16 master, including for elements that were clipped at the format maximum — the common QAT
choice (torchao's QAT, Megatron/TE fake quant), because MX/NVFP4 scales follow the block amax,
so nothing is clipped by design except by FLOOR-style scale rules.
"""

from __future__ import annotations

import logging

import torch

from workbench.formats import Recipe, fake_quantize

_log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str, str]] = set()


def _kernels(x: torch.Tensor, recipe: Recipe):
    """``workbench.kernels`` when it serves this CUDA tensor and recipe (same bits), else None.
    The choice is logged once per (format, profile, path)."""
    mod = None
    if x.is_cuda:
        from workbench import kernels

        if kernels.supports(recipe) and kernels.available():
            mod = kernels
    key = (recipe.fmt, recipe.profile, "triton" if mod else "reference")
    # logging inside a torch.compile trace would break the graph: log from eager calls only
    if key not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(key)
        _log.info("fake quantization %s on %s: %s path", recipe, x.device.type, key[2])
    return mod


def _fq(x: torch.Tensor, recipe: Recipe, dim: int, per_leading: bool) -> torch.Tensor:
    if dim not in (-1, x.dim() - 1):
        return _fq(x.transpose(dim, -1).contiguous(), recipe, -1, per_leading).transpose(dim, -1)
    fast = _kernels(x, recipe)
    if recipe.fmt == "nvfp4" and per_leading and x.dim() == 3:
        # One NVFP4 per-tensor scale per expert, as each expert Linear has in a checkpoint.
        if fast is not None:  # one amax pass over the stack, then one quantize pass
            return fast.fake_quantize_experts(x, recipe)
        amax = x.detach().abs().amax(dim=(-2, -1), keepdim=True).float()
        return fake_quantize(x, recipe, global_amax=amax)
    if fast is not None:
        return fast.fake_quantize(x, recipe)
    return fake_quantize(x, recipe)


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recipe: Recipe, dim: int, per_leading: bool):
        return _fq(x, recipe, dim, per_leading)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quant_ste(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                   per_leading: bool = False) -> torch.Tensor:
    """Fake-quantize ``x`` with blocks along ``dim``; gradient passes straight through.

    ``per_leading``: for a 3-D expert stack, NVFP4 gets one per-tensor scale per expert.
    """
    return _FakeQuantSTE.apply(x, recipe, dim, per_leading)


def fake_quant_reference(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                         per_leading: bool = False) -> torch.Tensor:
    """The same numbers without autograd: what ``convert``/tests compare against."""
    return _fq(x, recipe, dim, per_leading)
