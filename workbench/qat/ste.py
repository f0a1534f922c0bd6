"""Fake quantization with an identity straight-through estimator (STE).

Forward: ``workbench.formats.fake_quantize`` (the reference codec), or on CUDA tensors the Triton
kernels of ``workbench.kernels`` with identical bits. Backward: the incoming gradient passes unchanged to the
BF16 master, including for elements that were clipped at the format maximum — the common QAT
choice (torchao's QAT, Megatron/TE fake quant), because MX/NVFP4 scales follow the block amax,
so nothing is clipped by design except by FLOOR-style scale rules.

NVFP4 weight stacks get one global amax per expert, which the weights only change at the
optimizer step: `expert_amax` computes it once per version of the weight (one amax pass, keyed
by the Parameter's version counter, which every in-place write bumps: the optimizer's update, a
`load_state_dict`, DCP loading into `state_dict()` tensors) and every later fake quantization of
that version, in this step's forward, an activation-checkpointing recompute or another
micro-batch, runs the one-pass quantize with the amax given. The amax is exact, never delayed:
the same bits as computing it in place. Writes through `param.data` bypass the version counter
(and so the cache): call `clear_amax_cache()` after them.

Every fake quantization (STE forward, `fake_quant_reference`, the fused SwiGLU's) passes through
one seam, `register_fake_quant_hook`: observers outside qat (the trainer's fake-quant timer) wrap the call
without patching this module. The STE backward is the identity and passes no hook.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from workbench.formats import Recipe, fake_quantize

_log = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str, str]] = set()
# id(param) -> (weakref to it, its signature when computed, [E, 1, 1] fp32 amax). An entry is
# dropped when its parameter is freed, so a new tensor that reuses the id never sees it.
_AMAX: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


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


def _compute_amax(w: torch.Tensor, fast) -> torch.Tensor:
    """[E, 1, 1] fp32 abs-max of each expert, NaN propagating (the reference's definition)."""
    if fast is not None:  # one launch over the whole stack, bit-equal to the line below
        return fast.global_amax(w, per_leading=True, ignore_nan=False)
    return w.detach().abs().amax(dim=(-2, -1), keepdim=True).float()


def _signature(w: torch.Tensor) -> tuple | None:
    try:
        version = w._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None
    return (version, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


def expert_amax(w: torch.Tensor, fast=None) -> torch.Tensor:
    """The per-expert NVFP4 global amax of the weight stack ``w`` [E, ...] (fp32, [E, 1, 1]).

    Cached for a ``nn.Parameter`` until its version counter, storage, shape or dtype changes;
    computed afresh for any other tensor and inside ``torch.compile`` traces."""
    if not isinstance(w, nn.Parameter) or torch.compiler.is_compiling():
        return _compute_amax(w, fast)
    sig = _signature(w)
    if sig is None:
        return _compute_amax(w, fast)
    hit = _AMAX.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == sig:
        return hit[2]
    amax = _compute_amax(w, fast)
    _store(w, sig, amax)
    return amax


def _store(w: nn.Parameter, sig: tuple, amax: torch.Tensor) -> None:
    key = id(w)
    hit = _AMAX.get(key)
    if hit is None or hit[0]() is not w:
        weakref.finalize(w, _AMAX.pop, key, None)
    _AMAX[key] = (weakref.ref(w), sig, amax)


def amax_wanted(w: torch.Tensor) -> bool:
    """Whether the per-expert amax of this Parameter has been asked for (by an NVFP4 weight fake
    quantization), whatever version it was computed for: the writer of its next version (the
    optimizer) may then produce the amax with the write and `seed_amax` it."""
    hit = _AMAX.get(id(w))
    return hit is not None and hit[0]() is w


def seed_amax(w: nn.Parameter, amax: torch.Tensor) -> None:
    """Record ``amax`` as the per-expert amax of ``w``'s current version, so the next fake
    quantization skips its amax pass. The caller vouches that it is exact: bit-equal to
    ``w.abs().amax(dim=(-2, -1), keepdim=True).float()`` (NaN propagating) for the values ``w``
    holds now, its write already counted by the version counter."""
    if not isinstance(w, nn.Parameter):
        raise TypeError(f"seed_amax takes an nn.Parameter, got {type(w).__name__}")
    want = (w.shape[0],) + (1,) * (w.dim() - 1)
    if w.dim() < 2 or tuple(amax.shape) != want or amax.dtype != torch.float32 \
            or amax.device != w.device:
        raise ValueError(f"seed_amax: amax must be float32 of shape {list(want)} on {w.device}, "
                         f"got {amax.dtype} {list(amax.shape)} on {amax.device}")
    sig = _signature(w)
    if sig is not None:
        _store(w, sig, amax)


def clear_amax_cache() -> None:
    """Forget every cached amax (after writing weights through ``.data``)."""
    _AMAX.clear()


def _fq(x: torch.Tensor, recipe: Recipe, dim: int, per_leading: bool,
        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if dim not in (-1, x.dim() - 1):
        return _fq(x.transpose(dim, -1).contiguous(), recipe, -1, per_leading,
                   out_dtype).transpose(dim, -1)
    fast = _kernels(x, recipe)
    kw = {}
    if recipe.fmt == "nvfp4" and per_leading and x.dim() == 3:
        # One NVFP4 per-tensor scale per expert, as each expert Linear has in a checkpoint:
        # the amax of this weight version (see the module doc), then one quantize pass.
        kw["global_amax"] = expert_amax(x, fast)
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
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is not None and out_dtype != x.dtype and x.dtype != torch.float32:
        # the kernels would keep a bf16 input's unrounded fp32 values, the reference not
        raise ValueError(f"fake quantization narrows fp32 to out_dtype; got a {x.dtype} input "
                         f"and out_dtype={out_dtype}")
    return hooked(partial(_fq, x, recipe, dim, per_leading, out_dtype), x)


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
    def forward(ctx, x, recipe: Recipe, dim: int, per_leading: bool, out_dtype):
        ctx.in_dtype = x.dtype
        return _fake_quant(x, recipe, dim, per_leading, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        # an fp32 master written as bf16 gets its gradient back in fp32, as from a cast
        return grad.to(ctx.in_dtype), None, None, None, None


def fake_quant_ste(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                   per_leading: bool = False,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` with blocks along ``dim``; gradient passes straight through.

    ``per_leading``: for a 3-D expert stack, NVFP4 gets one per-tensor scale per expert.
    ``out_dtype``: return the fp32 ``x``'s fake quantization in this (narrower) dtype, the
    same bits as ``.to(out_dtype)`` after it; the Triton kernels write it in their one pass.
    """
    return _FakeQuantSTE.apply(x, recipe, dim, per_leading, out_dtype)


def fake_quant_reference(x: torch.Tensor, recipe: Recipe, *, dim: int = -1,
                         per_leading: bool = False,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The same numbers without autograd: what ``convert``/tests compare against."""
    return _fake_quant(x, recipe, dim, per_leading, out_dtype)
