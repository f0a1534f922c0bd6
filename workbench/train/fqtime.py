"""Time spent in fake quantization per step, for the `fake_quant_share` metric.

Every QAT fake quantization of a training step (weights and activations, in the grouped GEMM
seam and in the per-Linear styles) runs `workbench.qat.ste._FakeQuantSTE.forward`, which calls
the module-level `_fq` of `workbench.qat.ste`; the STE backward is the identity and costs
nothing. `FakeQuantTimer` swaps that module global for a timing wrapper while it is entered:

* CPU: ops run synchronously, so wall time around the call is the op's cost; no synchronisation
  is added.
* CUDA: a pair of timing events is recorded on the current stream around each call (recording
  does not synchronise); `take_seconds()` reads them once per step, after the step's own
  host synchronisation (the loss `.item()`), so it waits on nothing that was not already done.

`_fq` is a private name of `workbench.qat.ste`: if it goes away, the timer reports itself
unavailable (`available` False) and the trainer logs no share, rather than a wrong one.
"""

from __future__ import annotations

import time
from typing import Any, Self

import torch


class FakeQuantTimer:
    def __init__(self) -> None:
        self._ste: Any = None
        self._orig = None
        self._hook = None
        self._depth = 0  # _fq calls itself for a transposed layout: time the outer call only
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.calls = 0

    @property
    def available(self) -> bool:
        return self._orig is not None

    def __enter__(self) -> Self:
        try:
            from workbench.qat import ste
        except ImportError:
            return self
        orig = getattr(ste, "_fq", None)
        if not callable(orig):
            return self
        self._ste, self._orig = ste, orig
        self._hook = self._timed  # one bound-method object, so __exit__ can recognise it
        ste._fq = self._hook
        return self

    def __exit__(self, *exc) -> None:
        # Restore only our own hook: a nested timer (entered later) restores to ours first.
        if self._orig is not None and self._ste._fq is self._hook:
            self._ste._fq = self._orig
        self._ste = self._orig = self._hook = None

    def _timed(self, x: torch.Tensor, *args, **kwargs):
        if self._depth or torch.compiler.is_compiling():
            return self._orig(x, *args, **kwargs)
        self._depth += 1
        self.calls += 1
        try:
            if x.is_cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = self._orig(x, *args, **kwargs)
                end.record()
                self._events.append((start, end))
                return out
            t0 = time.perf_counter()
            out = self._orig(x, *args, **kwargs)
            self._cpu_s += time.perf_counter() - t0
            return out
        finally:
            self._depth -= 1

    def take(self) -> tuple[float, int]:
        """(seconds of fake quantization, timed calls) since the last take; then reset."""
        total, calls = self._cpu_s, self.calls
        for start, end in self._events:
            end.synchronize()  # already complete after the step's loss .item()
            total += start.elapsed_time(end) / 1000.0
        self._cpu_s, self._events, self.calls = 0.0, [], 0
        return total, calls
