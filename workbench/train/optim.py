"""AdamW whose update of an expert weight stack can also produce that stack's per-expert abs-max.

Why this class exists: NVFP4 QAT fake-quantizes each expert weight stack with one global amax
per expert, a full read of the weights in every step's forward. The weights only change here, at
the optimizer step, so the kernel that writes the new weights can reduce their abs-max on the way
out and hand it on: to an ``amax_sink`` (``AmaxSink``: which parameters it wants, where the result
goes), which the trainer connects to QAT (``workbench.qat.QATState.optimizer_sink``); the forward
then skips its amax pass. This module knows nothing of quantization: it produces, for the
parameters the sink wants, the exact abs-max of the stored, rounded values (NaN propagating as
``w.abs().amax()``), not a delayed one, so the fake-quantized bits are the same as without it.

The arithmetic is torch's single-tensor AdamW (`torch.optim.adam._single_tensor_adam`,
decoupled weight decay), on torch's state layout (created in ``_state``), so state dicts,
`workbench.train.checkpointing` and DCP checkpoints are interchangeable with
`torch.optim.AdamW(foreach=False)`. Where it runs:
- fp32 parameters on a GPU (the trainer's masters): the whole step in one Triton kernel,
  `workbench.kernels.adamw_step_`, which mirrors torch's CUDA rounding op for op (torch's eight
  elementwise kernels move 84 bytes per element, this one 28; jobs/gpu/adamw_bits.py checks the
  bits) and, for a wanted stack, reduces its amax on the way out;
- bf16 expert stacks the sink wants: torch's ops, then the last one,
  `param.addcdiv_(exp_avg, denom, value=-step_size)`, in `workbench.kernels.addcdiv_amax_`;
- everything else (CPU, DTensor parameters, `whole_step=False`, `amax_path="never"`): torch's
  ops unchanged, and no amax.

Only what the trainer uses is supported: float lr and betas; amsgrad, maximize, foreach, fused,
capturable and differentiable off (foreach/fused None means off here). Anything else raises a
ValueError naming the option.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from workbench import kernels

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # (device, path) keys already logged: once per process


def _log_path(key: str, what: str, path: str) -> None:
    """Log once per process which path ``what`` takes (keyed by device and path)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.info("AdamW update of %s: %s", what, path)



class AmaxSink(Protocol):
    """Where the per-expert abs-max of an updated expert stack goes.

    ``wants(param)``: whether the update of this parameter (a plain [E, ...] tensor) should
    produce it; ``put(param, amax)``: after the write (its version counter already bumped), the
    [E, 1, ...] fp32 abs-max of each expert's stored values, NaN propagating."""

    def wants(self, param: torch.Tensor) -> bool: ...

    def put(self, param: torch.Tensor, amax: torch.Tensor) -> None: ...


# amax_path: where the update of a wanted 3-D stack runs fused with its amax.
#   "auto"   plain CUDA tensors, when the Triton kernels import (the trainer's setting)
#   "always" also CPU tensors: the kernel under the Triton interpreter (TRITON_INTERPRET=1), for
#            the CPU tests of the fused path
#   "never"  torch's ops everywhere, no amax (the forward then computes it)
AMAX_PATHS = ("auto", "always", "never")
_OFF_OPTIONS = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")


def _check_group(group: dict) -> None:
    for name in _OFF_OPTIONS:
        if group.get(name):
            raise ValueError(f"workbench.train.optim.AdamW does not support {name}=True "
                             f"(it runs torch's single-tensor AdamW arithmetic only)")
    if isinstance(group.get("lr"), torch.Tensor):
        raise ValueError("workbench.train.optim.AdamW needs a float lr, got a Tensor lr")
    if any(isinstance(b, torch.Tensor) for b in group.get("betas", ())):
        raise ValueError("workbench.train.optim.AdamW needs float betas, got Tensor betas")


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (single-tensor arithmetic) whose update of an expert stack that
    ``amax_sink`` wants also produces that stack's per-expert abs-max; see the module doc.

    ``amax_sink``: an ``AmaxSink`` (None: no amax is produced). ``amax_path``: one of ``AMAX_PATHS`` (default "auto"); it also says where ``whole_step``
    may run. ``whole_step``: fp32 parameters take the whole update in one kernel
    (``kernels.adamw_step_``, torch's CUDA bits), an NVFP4 stack's amax included; False keeps
    torch's ops for all but the amax-producing last op. ``contract``: the fused kernels'
    last multiply-add as one fma (True) or a multiply then an add; which one is torch's CUDA
    bits is what jobs/gpu/adamw_bits.py measures."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 amax_path: str = "auto", contract: bool = True,
                 whole_step: bool = True, amax_sink: AmaxSink | None = None) -> None:
        if amax_path not in AMAX_PATHS:
            raise ValueError(f"amax_path must be one of {AMAX_PATHS}, got {amax_path!r}")
        _check_group({"lr": lr, "betas": betas, "amsgrad": amsgrad, "maximize": maximize,
                      "foreach": foreach, "capturable": capturable,
                      "differentiable": differentiable, "fused": fused})
        self.amax_path = amax_path
        self.amax_sink = amax_sink
        self.contract = bool(contract)
        self.whole_step = bool(whole_step)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            _check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _whole(self, p: torch.Tensor, *state: torch.Tensor) -> bool:
        """Whether this parameter's whole update runs in one kernel (``kernels.adamw_step_``)."""
        if not self.whole_step or self.amax_path == "never" or type(p.data) is not torch.Tensor:
            return False
        if not (p.is_cuda or self.amax_path == "always") or p.numel() == 0:
            return False
        if not all(type(t.data) is torch.Tensor and t.dtype == torch.float32 and t.is_contiguous()
                   and t.shape == p.shape for t in (p, *state)):
            return False
        whole = kernels.available()
        _log_path(f"{p.device.type}:{'whole' if whole else 'ops'}",
                  f"fp32 parameters on {p.device.type}",
                  "one Triton kernel per parameter" if whole else "torch ops (Triton unavailable)")
        return whole

    def _fused(self, p: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor) -> bool:
        """Whether this parameter's update runs in the kernel that also reduces its amax."""
        if self.amax_path == "never" or p.dim() != 3 or type(p.data) is not torch.Tensor:
            return False  # type(p.data): a DTensor (or any tensor subclass) keeps torch's ops
        if not (p.is_cuda or self.amax_path == "always"):
            return False
        if p.dtype not in (torch.bfloat16, torch.float32) or p.numel() == 0:
            return False
        if not all(t.is_contiguous() for t in (p, exp_avg, denom)) or not self._wants(p):
            return False
        fused = kernels.available()
        _log_path(f"{p.device.type}:{'fused' if fused else 'torch'}",
                  f"expert stacks whose amax is wanted, on {p.device.type}",
                  "Triton update + amax (to the amax sink)" if fused
                  else "torch ops (Triton unavailable; no amax)")
        return fused

    def _wants(self, p: torch.Tensor) -> bool:
        return self.amax_sink is not None and p.dim() >= 2 and self.amax_sink.wants(p)

    def _state(self, p: torch.Tensor) -> dict:
        """``p``'s state, created on its first step as torch's AdamW creates it (non-capturable,
        non-fused): the layout its state dicts and our checkpoints hold (tests/train/test_optim.py
        compares both ways), without torch's private ``_init_group``."""
        st = self.state[p]
        if not st:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            st["step"] = torch.tensor(0.0, dtype=scalar)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step, the arithmetic of ``torch.optim.adam._single_tensor_adam``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.is_sparse or torch.is_complex(param):
                    raise ValueError("workbench.train.optim.AdamW does not support sparse "
                                     "gradients or complex parameters")
                st = self._state(param)
                exp_avg, exp_avg_sq, step_t = st["exp_avg"], st["exp_avg_sq"], st["step"]
                step_t += 1
                if self._whole(param, grad, exp_avg, exp_avg_sq):
                    wanted = param.dim() == 3 and self._wants(param)
                    amax = kernels.adamw_step_(
                        param.detach(), grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=wd, step=step_t.item(),
                        amax=wanted, contract=self.contract)
                    # raw writes: bump the versions torch's in-place ops would have (readers
                    # that know a tensor's values by its version, autograd's saved-tensor
                    # checks and the amax sink's entries, see the new values as new)
                    for t in (param, exp_avg, exp_avg_sq):
                        torch.autograd.graph.increment_version(t)
                    if wanted:
                        self.amax_sink.put(param, amax)
                    continue
                if wd != 0:
                    param.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                if self._fused(param, exp_avg, denom):
                    amax = kernels.addcdiv_amax_(param.detach(), exp_avg, denom, -step_size,
                                                 contract=self.contract)
                    # a kernel's raw write does not count as one: without the bump the new
                    # values would share the version the old ones were known by
                    torch.autograd.graph.increment_version(param)
                    self.amax_sink.put(param, amax)
                else:
                    param.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
