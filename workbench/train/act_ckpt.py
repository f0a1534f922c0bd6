"""Activation checkpointing per decoder layer: off, full, or selective (op-level).

- `full`: each decoder layer keeps only its input; backward re-runs the layer's forward.
- `selective`: the layer re-runs, but the outputs of its matrix multiplies, attention and the
  grouped expert GEMMs are kept (the expensive ops), so backward recomputes only the cheap
  element-wise ops between them (norms, RoPE, SiLU, routing softmax).

Recomputation reruns the layer's forward exactly as the first time: the same fake quantization
(QAT's seam is a pure function of the weights), the same routing (no randomness in the model)
and, under expert parallelism, the same all-to-alls, in the same order on every rank (autograd
walks the layers in reverse on every rank alike). So losses and gradients equal those of the
run without checkpointing (tests: `tests/train/test_memory_plan.py`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workbench.train.memory import ACT_CKPT_MODES

# The ops whose outputs `selective` keeps. The CPU grouped GEMM of the experts is a loop of
# plain matmuls (aten.mm), the CUDA one torch._grouped_mm; attention is one SDPA op.
_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _SAVE.add(torch.ops.aten._grouped_mm.default)
# windows and sinks on CUDA run FlexAttention (workbench.model.attention), a higher-order op
_SAVE.add(torch.ops.higher_order.flex_attention)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed_forward(module: nn.Module, mode: str, original, *args, **kwargs):
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    return checkpoint(original, *args, use_reentrant=False, **extra, **kwargs)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint every decoder layer of a `workbench.model.MoEForCausalLM` in `mode`; returns the
    number of layers wrapped. Parameter names, state_dict and optimizer state are unchanged
    (the layer's forward is replaced on the instance, not the module tree)."""
    if mode not in ACT_CKPT_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {ACT_CKPT_MODES}")
    if mode == "off":
        return 0
    layers = model.model.layers
    for layer in layers:
        if getattr(layer, "_act_ckpt", None) is not None:
            raise ValueError("apply_activation_checkpointing: the model is already checkpointed")
        original = layer.forward
        layer.forward = functools.partial(_checkpointed_forward, layer, mode, original)
        layer._act_ckpt = mode
    return len(layers)
