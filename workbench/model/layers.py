"""Dense building blocks every family shares: RMSNorm and the SwiGLU MLP.

Legend: D hidden, F FFN width. Attention lives in `attention.py`, rotary in `rope.py`.
Parameter names equal transformers' so the dense part of every key map is identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.model.cast import Linear


class RMSNorm(nn.Module):
    """`cast_last=False` (Llama, Qwen3, DeepSeek, GLM): normalise in fp32, cast back to the
    input dtype, then multiply by the weight. `cast_last=True` (gpt-oss): multiply in fp32,
    then cast. The order changes bf16 results, never fp32 ones."""

    def __init__(self, dim: int, eps: float, *, cast_last: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast_last = cast_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_last:
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class SwiGLU(nn.Module):
    """Dense FFN (HF `Qwen3MoeMLP`, `DeepseekV3MLP`): down(silu(gate(x)) * up(x)). Also the
    shared expert."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, ffn, bias=False)
        self.up_proj = Linear(hidden, ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
