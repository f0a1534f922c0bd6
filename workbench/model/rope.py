"""Rotary position embedding: default and YaRN frequencies, half-split and interleaved pairs.

Legend: B batch, S sequence, H heads, R rotary dims of a head (`MoEConfig.rope_dim`).

Frequencies follow transformers' `compute_default_rope_parameters` / `_compute_yarn_parameters`
op for op (fp32), so cos/sin are the same bits. The pairs a frequency rotates:
- half split (Llama, Qwen3, GLM, gpt-oss): dims i and i + R/2, over the first R dims of the head
  (GLM-4.5 rotates half of each head and passes the rest through);
- interleaved (DeepSeek's rope_interleave): dims 2i and 2i+1; the rotated dims come out
  de-interleaved (evens then odds), as transformers writes them. q and k go through the same
  permutation, so their dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from workbench.arch import MoEConfig, yarn_mscale


def inv_freq_and_scale(cfg: MoEConfig, device: torch.device | None = None
                       ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] fp32, the factor on cos/sin) of `cfg`'s rotary embedding."""
    dim, base, r = cfg.rope_dim, cfg.rope_theta, cfg.rope
    if r.kind == "default":
        exponent = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
        return 1.0 / (base ** exponent), 1.0
    factor = r.factor
    if r.attention_factor is not None:
        scale = r.attention_factor
    elif r.mscale and r.mscale_all_dim:
        scale = float(yarn_mscale(factor, r.mscale) / yarn_mscale(factor, r.mscale_all_dim))
    else:
        scale = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(r.original_max_position / (rotations * 2 * math.pi))) \
            / (2 * math.log(base))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
                       / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, scale


class RotaryEmbedding(nn.Module):
    """cos/sin [B, S, R] for the positions of a batch (`cat(freqs, freqs)` layout, times the
    YaRN attention factor)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.scale = 1.0
        self.register_buffer("inv_freq", torch.empty(cfg.rope_dim // 2), persistent=False)
        self.reset_inv_freq()

    @torch.no_grad()
    def reset_inv_freq(self) -> None:
        """(Re)compute the frequencies in fp32 on the buffer's device (after meta init/to_empty)."""
        self.inv_freq, self.scale = inv_freq_and_scale(self.cfg, self.inv_freq.device)

    def forward(self, positions_BS: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs_BSh = positions_BS[..., None].float() * self.inv_freq.to(positions_BS.device)
        emb_BSR = torch.cat((freqs_BSh, freqs_BSh), dim=-1)
        cos, sin = emb_BSR.cos(), emb_BSR.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_BHSD: torch.Tensor, cos_BSR: torch.Tensor, sin_BSR: torch.Tensor, *,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate the first R dims of every head (R = cos's last dim); the rest pass through."""
    cos, sin = cos_BSR.unsqueeze(1), sin_BSR.unsqueeze(1)
    rot = cos.shape[-1]
    if interleaved:
        if rot != x_BHSD.shape[-1]:
            raise ValueError("interleaved rotary rotates whole heads")
        c, s = cos[..., : rot // 2], sin[..., : rot // 2]
        x1, x2 = x_BHSD[..., 0::2], x_BHSD[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    if rot == x_BHSD.shape[-1]:
        return x_BHSD * cos + _rotate_half(x_BHSD) * sin
    x_rot, x_pass = x_BHSD[..., :rot], x_BHSD[..., rot:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)
