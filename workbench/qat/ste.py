"""Fake quantization with an identity straight-through estimator (STE).

Forward: ``workbench.formats.fake_quantize`` (the reference codec), or on CUDA tensors the Triton
kernels of ``workbench.kernels`` with identical bits. Backward: the incoming gradient passes unchanged to the
BF16 master, including for elements that were clipped at the format maximum — the common QAT
choice (torchao's QAT, Megatron/TE fake quant), because MX/NVFP4 scales follow the block amax,
so nothing is clipped by design except by FLOOR-style scale rules.

NVFP4 weight stacks get one global amax per expert (`expert_amax`, the abs-max of each expert's
values), computed here unless the caller passes it (`global_amax`: the QAT seam passes the amax
the optimizer produced with its write, `workbench.qat.state`).

Every fake quantization (STE forward, `fake_quant_reference`, the fused SwiGLU's) passes through
one seam, `register_fake_quant_hook`: observers outside qat (the trainer's fake-quant timer) wrap the call
without patching this module. The STE backward is the identity and passes no hook.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle

from workbench import kernels
from workbench.formats import Recipe, fake_quantize

_log = logging.getLogger(__name__)
# (format, profile, path) already logged: the path choice is logged once per process
_LOGGED: set[tuple[str, str, str]] = set()


def _kernels(x: torch.Tensor, recipe: Recipe):
    """``workbench.kernels`` when it serves this CUDA tensor and recipe (same bits), else None.
    The choice is logged once per (format, profile, path)."""
    mod = None
    if x.is_cuda and kernels.supports(recipe) and kernels.available():
        mod = kernels
    key = (recipe.fmt, recipe.profile, "triton" if mod else "reference")
    # logging inside a torch.compile trace would break the graph: log from eager calls only
    if key not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(key)
        _log.info("fake quantization %s on %s: %s path", recipe, x.device.type, key[2])
    return mod


def expert_amax(w: torch.Tensor, fast=None) -> torch.Tensor:
    """The per-expert NVFP4 global amax of the stack ``w`` [E, ...]: [E, 1, ...] fp32 abs-max of
    each expert, NaN propagating (the reference's definition). ``fast``: ``workbench.kernels``
    for one launch over the whole stack, bit-equal to the torch line."""
    if fast is not None:
        return fast.global_amax(w, per_leading=True, ignore_nan=False)
    return w.detach().abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).float()


def _per_expert(x: torch.Tensor, recipe: Recipe, per_leading: bool) -> bool:
    # One NVFP4 per-tensor scale per expert, as each expert Linear has in a checkpoint
    return recipe.fmt == "nvfp4" and per_leading and x.dim() == 3


def _fq(x: torch.Tensor, recipe: Recipe, dim: int, per_leading: bool,
        out_dtype: torch.dtype | None = None,
        global_amax: torch.Tensor | None = None) -> torch.Tensor:
    if dim not in (-1, x.dim() - 1):  # an expert's abs-max does not depend on the layout
        return _fq(x.transpose(dim, -1).contiguous(), recipe, -1, per_leading,
                   out_dtype, global_amax).transpose(dim, -1)
    fast = _kernels(x, recipe)
    kw = {}
    if _per_expert(x, recipe, per_leading):
        # the amax given (the optimizer's, for these values) or computed: then one quantize pass
        kw["global_amax"] = expert_amax(x, fast) if global_amax is None else global_amax
    if fast is not None:  # the kernel writes out_dtype itself: no second pass to cast
        return fast.fake_quantize(x, recipe, out_dtype=out_dtype, **kw)
    y = fake_quantize(x, recipe, **kw)
    return y if out_dtype is None else y.to(out_dtype)


# hook(call, x) -> tensor: runs `call()` (the fake quantization of `x`, or the next hook) and
# returns its result. Called once per fake quantization, whatever the block layout (a transposed
# call recurses inside `_fq`, below the hooks), in registration order (the first registered is
# outermost).
FakeQuantHook = Callable[[Callable[[], torch.Tensor], torch.Tensor], torch.Tensor]
_HOOKS: OrderedDict[int, FakeQuantHook] = OrderedDict()


def register_fake_quant_hook(hook: FakeQuantHook) -> RemovableHandle:
    """Wrap every eager fake quantization with `hook(call, x)` until `handle.remove()`.

    Hooks are skipped while torch.compile traces: host-side work (timers, counters) cannot run
    inside a graph, and a compiled region is one opaque cost to its caller anyway."""
    if not callable(hook):
        raise TypeError(f"fake-quant hook must be callable, got {type(hook).__name__}")
    handle = RemovableHandle(_HOOKS)
    _HOOKS[handle.id] = hook
    return handle


def _fake_quant(x: torch.Tensor, recipe: Recipe, dim: int, per_leading: bool,
                out_dtype: torch.dtype | None = None,
                global_amax: torch.Tensor | None = None) -> torch.Tensor:
    if out_dtype is not None and out_dtype != x.dtype and x.dtype != torch.float32:
        # the kernels would keep a bf16 input's unrounded fp32 values, the reference not
        raise ValueError(f"fake quantization narrows fp32 to out_dtype; got a {x.dtype} input "
                         f"and out_dtype={out_dtype}")
    if global_amax is not None:
        want = (x.shape[0],) + (1,) * (x.dim() - 1)
        if not _per_expert(x, recipe, per_leading):
            raise ValueError(f"global_amax is the per-expert amax of an NVFP4 3-D stack with "
                             f"per_leading=True; got {recipe} on shape {list(x.shape)}")
        if tuple(global_amax.shape) != want or global_amax.dtype != torch.float32 \
                or global_amax.device != x.device:
            raise ValueError(f"global_amax must be float32 of shape {list(want)} on {x.device}, "
                             f"got {global_amax.dtype} {list(global_amax.shape)} on "
                             f"{global_amax.device}")
    return hooked(partial(_fq, x, recipe, dim, per_leading, out_dtype, global_amax), x)


def hooked(call: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``call()``, a fake quantization of ``x``, through the registered hooks: the one seam
    every fake quantization passes, here and in the fused SwiGLU of ``workbench.qat.grouped``."""
    if not _HOOKS or torch.compiler.is_compiling():
        return call()
    for hook in reversed(tuple(_HOOKS.values())):  # innermost first, so the first is outermost
        call = partial(hook, call, x)
    return call()


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, recipe: Recipe, dim: int, per_leading: bool, out_dtype, global_amax):
        ctx.in_dtype = x.dtype
        return _fake_quant(x, recipe, dim, per_leading, out_dtype, global_amax)

    @staticmethod
    def backward(ctx, grad):
        # an fp32 master written as bf16 gets its gradient back in fp32, as from a cast
        return grad.to(ctx.in_dtype), None, None, None, None, None


def fake_quant_ste(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                   per_leading: bool = False, out_dtype: torch.dtype | None = None,
                   global_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` with blocks along ``dim``; gradient passes straight through.

    ``per_leading``: for a 3-D expert stack, NVFP4 gets one per-tensor scale per expert.
    ``out_dtype``: return the fp32 ``x``'s fake quantization in this (narrower) dtype, the
    same bits as ``.to(out_dtype)`` after it; the Triton kernels write it in their one pass.
    ``global_amax``: that per-expert scale's amax, [E, 1, 1] fp32, when the caller has it for
    these very values (``expert_amax(x)`` bit for bit); computed here when None.
    """
    return _FakeQuantSTE.apply(x, recipe, dim, per_leading, out_dtype, global_amax)


def fake_quant_reference(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                         per_leading: bool = False, out_dtype: torch.dtype | None = None,
                         global_amax: torch.Tensor | None = None) -> torch.Tensor:
    """The same numbers without autograd: what ``convert``/tests compare against."""
    return _fake_quant(x, recipe, dim, per_leading, out_dtype, global_amax)
