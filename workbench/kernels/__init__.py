"""Triton versions of the ``workbench.formats`` codecs (bit-exact), and the CUDA fast path of
the QAT grouped GEMM. Triton is imported on first use; without it, calls raise
``TritonUnavailable`` naming the ``gpu`` extra and ``workbench.qat`` keeps the reference path."""

from .adamw import adamw_step_, addcdiv_amax_
from .api import (
           SUPPORTED,
           TritonUnavailable,
           available,
           fake_quantize,
           fake_quantize_experts,
           global_amax,
           quantize,
           silu_mul_backward,
           silu_mul_fake_quantize,
           supports,
)

__all__ = ["SUPPORTED", "TritonUnavailable", "adamw_step_", "addcdiv_amax_", "available",
           "fake_quantize",
           "fake_quantize_experts", "global_amax",
           "quantize", "silu_mul_backward",
           "silu_mul_fake_quantize", "supports"]
