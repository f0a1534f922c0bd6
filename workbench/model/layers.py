"""Dense building blocks of the Qwen3-MoE family: RMSNorm, RoPE, GQA attention with q/k norm, SwiGLU.

Legend: B batch, S sequence, D hidden, H query heads, G kv heads, Dh head dim, F FFN width.
Parameter names equal transformers' Qwen3-MoE names so the dense part of the key map is identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.arch import MoEConfig
from workbench.model.cast import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back *before* the weight multiply, exactly as transformers
        # does; changing the order changes bf16 results.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE with the half-split rotation convention of Llama/Qwen."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_inv_freq()

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        """(Re)compute the frequencies in fp32 on the buffer's device (after meta init/to_empty)."""
        device = self.inv_freq.device
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        self.inv_freq = 1.0 / (self.theta ** exponent)

    def forward(self, positions_BS: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BSh = positions_BS[..., None].float() * self.inv_freq.to(positions_BS.device)
        emb_BSDh = torch.cat((freqs_BSh, freqs_BSh), dim=-1)
        return emb_BSDh.cos().to(dtype), emb_BSDh.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHSDh: torch.Tensor, cos_BSDh: torch.Tensor, sin_BSDh: torch.Tensor
               ) -> torch.Tensor:
    cos, sin = cos_BSDh.unsqueeze(1), sin_BSDh.unsqueeze(1)
    return x_BHSDh * cos + _rotate_half(x_BHSDh) * sin


class Attention(nn.Module):
    """Causal grouped-query attention; q and k are RMS-normalised per head before RoPE (Qwen3)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BHSDh = self.q_norm(self.q_proj(x_BSD).view(B, S, -1, self.head_dim)).transpose(1, 2)
        k_BGSDh = self.k_norm(self.k_proj(x_BSD).view(B, S, -1, self.head_dim)).transpose(1, 2)
        v_BGSDh = self.v_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        q_BHSDh = apply_rope(q_BHSDh, *rope)
        k_BGSDh = apply_rope(k_BGSDh, *rope)
        o_BHSDh = F.scaled_dot_product_attention(
            q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True, scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(o_BHSDh.transpose(1, 2).reshape(B, S, -1))


class SwiGLU(nn.Module):
    """Dense FFN (HF `Qwen3MoeMLP`): down(silu(gate(x)) * up(x)). Also the shared expert."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, ffn, bias=False)
        self.up_proj = Linear(hidden, ffn, bias=False)
        self.down_proj = Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
