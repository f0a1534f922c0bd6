"""What a QAT training run shares between its optimizer and its forward passes, owned by the trainer.

NVFP4 fake-quantizes each expert weight stack with one global amax per expert, a full read of the
weights. The weights only change at the optimizer step, so the optimizer can reduce the abs-max
of the values it writes on the way out (`workbench.train.optim.AdamW`'s amax sink) and the next
forward skips that read. `QATState` is where that amax travels: the trainer creates one, passes
it to `prepare(model, recipe, state=state)` (which tells it the parameter names of the NVFP4
stacks) and connects `state.optimizer_sink(model)` to the optimizer. Without a state the seam
computes every amax in the forward: the same bits, one read more.

The rule that keeps an amax from going stale: an entry describes the values of one parameter, by
name, as the optimizer wrote them, and it is used only for that same tensor object at that same
version-counter value and storage. Any write autograd counts (in-place ops, `copy_`,
`load_state_dict`, a DCP load into `p.detach()` tensors as `workbench.train.checkpointing` does),
a rebinding of `p.data`, or a replaced parameter makes it unusable, and the forward computes the
amax again. What that cannot see is an in-place write through `p.data` (a tensor with its own
version counter; autograd's own saved-tensor checks miss it for the same reason): after one, call
`clear()`. The trainer never writes weights that way after its first optimizer step. Cases:
- first step: the book is empty, the forward computes;
- FSDP2: the optimizer holds sharded DTensors and writes no amax (a shard's abs-max is not its
  expert's); the forward sees the all-gathered tensor, never a book entry's object, and computes;
- activation-checkpointing recompute, several micro-batches, validation: the same tensor at the
  same version, served from the book until the next write.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class _Entry:
    param: weakref.ref  # the parameter the values were written into
    version: int  # its version counter just after the write
    data_ptr: int  # its storage then (a `p.data = ...` rebinding keeps the version)
    amax: torch.Tensor  # [E, 1, 1] fp32


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors have no version counter
        return None


class QATState:
    """The NVFP4 per-expert amax book of one prepared model, by parameter name (see the module
    doc). Create it in the trainer, pass it to ``prepare``, connect ``optimizer_sink``."""

    def __init__(self) -> None:
        self._wanted: set[str] = set()
        self._book: dict[str, _Entry] = {}

    # -- prepare's side
    def want(self, name: str) -> None:
        """Ask for the per-expert amax of parameter ``name`` (an NVFP4 expert stack)."""
        self._wanted.add(name)

    def forget(self, names) -> None:
        """No longer ask for (nor keep) the amax of these parameters (``unprepare``)."""
        for n in names:
            self._wanted.discard(n)
            self._book.pop(n, None)

    @property
    def wanted(self) -> frozenset[str]:
        return frozenset(self._wanted)

    # -- the forward's side
    def amax(self, name: str, w: torch.Tensor) -> torch.Tensor | None:
        """The optimizer's amax of parameter ``name`` if it describes ``w`` as ``w`` is now
        (same object, same version, same storage), else None: the caller computes it."""
        e = self._book.get(name)
        if e is None or torch.compiler.is_compiling():
            return None
        if e.param() is not w or _version(w) != e.version or w.data_ptr() != e.data_ptr:
            return None
        return e.amax

    def clear(self) -> None:
        """Forget every amax (after writing weights in place through ``p.data``)."""
        self._book.clear()

    # -- the optimizer's side
    def put(self, name: str, param: nn.Parameter, amax: torch.Tensor) -> None:
        """Record ``amax`` as the per-expert abs-max of the values ``param`` (parameter ``name``)
        holds now, its write already counted by its version counter. The caller vouches that it
        is exact: bit-equal to ``workbench.qat.ste.expert_amax(param)``."""
        if name not in self._wanted:
            raise KeyError(f"QATState.put: {name!r} is not an NVFP4 expert stack prepare() "
                           f"registered (wanted: {sorted(self._wanted)[:4]}...)")
        if type(param) is not nn.Parameter or type(param.data) is not torch.Tensor:
            # a DTensor shard's abs-max is not its experts' (and nothing else is a master)
            raise TypeError(f"QATState.put: {name} must be a plain nn.Parameter, got "
                            f"{type(param).__name__} of {type(param.data).__name__}")
        want = (param.shape[0],) + (1,) * (param.dim() - 1)
        if param.dim() < 2 or tuple(amax.shape) != want or amax.dtype != torch.float32 \
                or amax.device != param.device:
            raise ValueError(f"QATState.put: amax of {name} must be float32 of shape {list(want)} "
                             f"on {param.device}, got {amax.dtype} {list(amax.shape)} on "
                             f"{amax.device}")
        version = _version(param)
        if version is None:
            self._book.pop(name, None)
            return
        self._book[name] = _Entry(weakref.ref(param), version, param.data_ptr(), amax)

    def optimizer_sink(self, model: nn.Module) -> AmaxBookSink:
        """The sink for ``workbench.train.optim.AdamW(amax_sink=...)``: it knows ``model``'s
        parameters as the optimizer holds them (build it after FSDP and EP have replaced them)."""
        return AmaxBookSink(self, model)

    def __repr__(self) -> str:
        return f"QATState({len(self._wanted)} NVFP4 stacks wanted, {len(self._book)} amax held)"


class AmaxBookSink:
    """Connects an optimizer's per-expert amax to a ``QATState``: ``wants(p)`` for the plain
    parameters whose name the state wants, ``put(p, amax)`` after the write."""

    def __init__(self, state: QATState, model: nn.Module) -> None:
        self.state = state
        # id -> (name, parameter): the parameter held too, so a recycled id never matches
        self._names = {id(p): (n, p) for n, p in model.named_parameters()}

    def _name(self, param: torch.Tensor) -> str | None:
        hit = self._names.get(id(param))
        return hit[0] if hit is not None and hit[1] is param else None

    def wants(self, param: torch.Tensor) -> bool:
        name = self._name(param)
        return (name is not None and name in self.state._wanted
                and type(param.data) is torch.Tensor and param.dim() == 3)

    def put(self, param: torch.Tensor, amax: torch.Tensor) -> None:
        name = self._name(param)
        if name is None:
            raise KeyError(f"amax sink: a parameter of shape {list(param.shape)} that is not one "
                           "of the model's (was it replaced after the optimizer was built?)")
        self.state.put(name, param, amax)
