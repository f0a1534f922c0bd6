"""Time spent in fake quantization per step, for the `fake_quant_share` metric.

Every QAT fake quantization of a training step (weights and activations, in the grouped GEMM
seam and in the per-Linear styles) passes through qat's one hook seam,
`workbench.qat.register_fake_quant_hook`, once per call whatever the block layout; the STE
backward is the identity and costs nothing. `FakeQuantTimer` registers a timing hook while it is
entered:

* CPU: ops run synchronously, so wall time around the call is the op's cost; no synchronisation
  is added.
* CUDA: a pair of timing events is recorded on the current stream around each call (recording
  does not synchronise); `take()` reads them once per step, after the step's own host
  synchronisation (the loss `.item()`), so it waits on nothing that was not already done.

Under torch.compile the seam runs no hooks (a compiled region is one cost), so compiled fake
quantization is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Self

import torch
from torch.utils.hooks import RemovableHandle

from workbench.qat import register_fake_quant_hook


class FakeQuantTimer:
    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.calls = 0

    @property
    def available(self) -> bool:
        """True while entered: the hook is registered and every fake quantization is timed."""
        return self._handle is not None

    def __enter__(self) -> Self:
        self._handle = register_fake_quant_hook(self._timed)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()  # removes only this timer's hook; others stay in place
        self._handle = None

    def _timed(self, call: Callable[[], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = call()
            end.record()
            self._events.append((start, end))
            return out
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            self._cpu_s += time.perf_counter() - t0

    def take(self) -> tuple[float, int]:
        """(seconds of fake quantization, timed calls) since the last take; then reset."""
        total, calls = self._cpu_s, self.calls
        for start, end in self._events:
            end.synchronize()  # already complete after the step's loss .item()
            total += start.elapsed_time(end) / 1000.0
        self._cpu_s, self._events, self.calls = 0.0, [], 0
        return total, calls
