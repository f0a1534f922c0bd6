"""AdamW whose update of an NVFP4 expert stack also produces that stack's per-expert amax.

Why this class exists: NVFP4 QAT fake-quantizes each expert weight stack with one global amax
per expert (`workbench.qat.ste.expert_amax`), a full read of the weights in every step's forward.
The weights only change here, at the optimizer step, so the kernel that writes the new weights can
reduce their abs-max on the way out and hand it to the fake quantization
(`ste.seed_amax`): the forward then skips its amax pass. The amax is exact (the abs-max of the
stored, rounded values, NaN propagating as `w.abs().amax()`), not delayed, so the fake-quantized
bits are the same as before.

The arithmetic is torch's single-tensor AdamW (`torch.optim.adam._single_tensor_adam`,
decoupled weight decay), on the state torch's `_init_group` creates, so state dicts,
`workbench.train.checkpointing` and DCP checkpoints are interchangeable with
`torch.optim.AdamW(foreach=False)`. Where it runs:
- fp32 parameters on a GPU (the trainer's masters): the whole step in one Triton kernel,
  `workbench.kernels.adamw_step_`, which mirrors torch's CUDA rounding op for op (torch's eight
  elementwise kernels move 84 bytes per element, this one 28; jobs/gpu/adamw_bits.py checks the
  bits) and, for a wanted NVFP4 stack, reduces its amax on the way out;
- bf16 expert stacks whose amax is wanted: torch's ops, then the last one,
  `param.addcdiv_(exp_avg, denom, value=-step_size)`, in `workbench.kernels.addcdiv_amax_`;
- everything else (CPU, DTensor parameters, `whole_step=False`, `amax_path="never"`): torch's
  ops unchanged, and no amax.

Only what the trainer uses is supported: float lr and betas; amsgrad, maximize, foreach, fused,
capturable and differentiable off (foreach/fused None means off here). Anything else raises a
ValueError naming the option.
"""

from __future__ import annotations

import logging

import torch

from workbench import kernels
from workbench.qat import ste

_log = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_path(key: str, what: str, path: str) -> None:
    """Log once per process which path ``what`` takes (keyed by device and path)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        _log.info("AdamW update of %s: %s", what, path)

# amax_path: where the update of a wanted 3-D stack runs fused with its amax.
#   "auto"   plain CUDA tensors, when the Triton kernels import (the trainer's setting)
#   "always" also CPU tensors: the kernel under the Triton interpreter (TRITON_INTERPRET=1), for
#            the CPU tests of the fused path
#   "never"  torch's ops everywhere (the amax is then computed by the next fake quantization)
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
    """``torch.optim.AdamW`` (single-tensor arithmetic) whose update of a wanted NVFP4 expert
    stack seeds that stack's per-expert amax; see the module doc.

    ``amax_path``: one of ``AMAX_PATHS`` (default "auto"); it also says where ``whole_step``
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
                 whole_step: bool = True) -> None:
        if amax_path not in AMAX_PATHS:
            raise ValueError(f"amax_path must be one of {AMAX_PATHS}, got {amax_path!r}")
        _check_group({"lr": lr, "betas": betas, "amsgrad": amsgrad, "maximize": maximize,
                      "foreach": foreach, "capturable": capturable,
                      "differentiable": differentiable, "fused": fused})
        self.amax_path = amax_path
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
        if not all(t.is_contiguous() for t in (p, exp_avg, denom)) or not ste.amax_wanted(p):
            return False
        fused = kernels.available()
        _log_path(f"{p.device.type}:{'fused' if fused else 'torch'}",
                  f"NVFP4 expert stacks on {p.device.type}",
                  "Triton update + amax (seeds the fake-quant amax)" if fused
                  else "torch ops (Triton unavailable; the forward computes the amax)")
        return fused

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step, the arithmetic of ``torch.optim.adam._single_tensor_adam``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            _check_group(group)
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            # torch's own lazy state initialisation: the same state layout by construction
            if self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps):
                raise ValueError("workbench.train.optim.AdamW does not support complex params")
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for param, grad, exp_avg, exp_avg_sq, step_t in zip(
                    params, grads, exp_avgs, exp_avg_sqs, steps):
                step_t += 1
                if self._whole(param, grad, exp_avg, exp_avg_sq):
                    wanted = param.dim() == 3 and ste.amax_wanted(param)
                    amax = kernels.adamw_step_(
                        param.detach(), grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=wd, step=step_t.item(),
                        amax=wanted, contract=self.contract)
                    # raw writes: bump the versions torch's in-place ops would have (the amax
                    # cache and the activation slot know a tensor's values by its version)
                    for t in (param, exp_avg, exp_avg_sq):
                        torch.autograd.graph.increment_version(t)
                    if wanted:
                        ste.seed_amax(param, amax)
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
                    # values would share the version the amax cache knows the old ones by
                    torch.autograd.graph.increment_version(param)
                    ste.seed_amax(param, amax)
                else:
                    param.addcdiv_(exp_avg, denom, value=-step_size)
        return loss
