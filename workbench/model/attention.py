"""Causal self-attention: GQA (Qwen3, GLM-4.5, gpt-oss options) and DeepSeek's MLA.

Legend: B batch, S sequence, D hidden, H query heads, G kv heads, Dh head dim, R rotary dims,
N MLA no-rotary dims, V MLA value dims, Lq / Lkv MLA q / kv latent ranks.

Parameter names equal transformers' for each family (`q_proj`, `q_norm`, `sinks`,
`q_a_proj`, `kv_a_proj_with_mqa`, ...), so the attention part of every key map is identity.
Scores go through `torch.nn.functional.scaled_dot_product_attention`; windows and sinks become
its boolean mask and one extra key (`attend_sdpa`, the reference). On CUDA a window or sinks run
FlexAttention instead (`workbench.model.flex`): SDPA has no fused kernel for a boolean mask with GQA, so
its math path would hold every [S, S + 1] score of a gpt-oss layer for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.arch import MoEConfig
from workbench.model.cast import Linear
from workbench.model.layers import RMSNorm
from workbench.model.rope import apply_rope

# transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with RMSNorm's default
# eps, not rms_norm_eps
MLA_NORM_EPS = 1e-6
# A sink key widens q and k by a few zero dims; 8 keeps the head dim a multiple of 8 for the
# fused SDPA kernels.
_SINK_PAD = 8


def attention_mask(S: int, window: int, sink: bool, device: torch.device) -> torch.Tensor:
    """[S, S (+1)] bool: query i sees key j <= i, within the last `window` positions (itself
    included) when window > 0 (transformers: kv_idx > q_idx - sliding_window); a sink column
    last, seen by every query."""
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    mask = j <= i
    if window:
        mask = mask & (j > i - window)
    if sink:
        mask = torch.cat([mask, mask.new_ones(S, 1)], dim=1)
    return mask


def attend(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *, scale: float,
           window: int = 0, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale * q k^T + causal/window mask) v, per head; with sinks, each head's softmax
    also counts a logit sinks[h] that no value follows (gpt-oss). A window or sinks on CUDA run
    `workbench.model.flex.attend_flex`; everything else, and the CPU, the reference
    `attend_sdpa`."""
    if (window or sinks_H is not None) and q_BHSD.is_cuda:
        # imported here: FlexAttention's module loads torch._dynamo (and Triton), which a CPU
        # user of the model should not pay for
        from workbench.model.flex import attend_flex

        return attend_flex(q_BHSD, k_BGSD, v_BGSD, scale=scale, window=window, sinks_H=sinks_H)
    return attend_sdpa(q_BHSD, k_BGSD, v_BGSD, scale=scale, window=window, sinks_H=sinks_H)


def attend_sdpa(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *,
                scale: float, window: int = 0,
                sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` through SDPA, the reference: a window is a boolean mask, a sink one more key.

    A sink is one more key: q gains a dim holding sinks[h] / scale, the sink key a 1 there (all
    other keys 0), its value 0, and every query sees it. Its score is then sinks[h] (up to the
    rounding of the division), it enters the denominator and adds nothing to the output; the
    other scores are unchanged (the extra dims add exact zeros)."""
    H, G = q_BHSD.shape[1], k_BGSD.shape[1]
    gqa = H != G
    if not window and sinks_H is None:
        return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    B, _, S, Dh = q_BHSD.shape
    mask = attention_mask(S, window, sinks_H is not None, q_BHSD.device)
    if sinks_H is not None:
        extra_q = q_BHSD.new_zeros(B, H, S, _SINK_PAD)
        extra_q[..., 0] = (sinks_H.to(q_BHSD.dtype) / scale)[None, :, None]
        q_BHSD = torch.cat([q_BHSD, extra_q], dim=-1)
        k_BGSD = torch.cat([k_BGSD, k_BGSD.new_zeros(B, G, S, _SINK_PAD)], dim=-1)
        sink_k = k_BGSD.new_zeros(B, G, 1, Dh + _SINK_PAD)
        sink_k[..., Dh] = 1.0
        k_BGSD = torch.cat([k_BGSD, sink_k], dim=2)
        # v padded like q and k: fused SDPA kernels (CPU and CUDA flash) need one head dim;
        # the extra output columns are zeros and are cut off
        v_BGSD = F.pad(v_BGSD, (0, _SINK_PAD, 0, 1))
        o = F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        return o[..., :Dh]
    return F.scaled_dot_product_attention(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)


class Attention(nn.Module):
    """Grouped-query attention. Options (`AttentionConfig`): q/k RMSNorm per head before RoPE
    (Qwen3, GLM `use_qk_norm`), q/k/v and output biases, per-head sinks, a sliding window."""

    def __init__(self, cfg: MoEConfig, layer: int = 0) -> None:
        super().__init__()
        a = cfg.attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = a.window(layer)
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=a.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=a.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=a.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if a.sinks else None

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, -1, self.head_dim)
        k = self.k_proj(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q_BHSDh, k_BGSDh = q.transpose(1, 2), k.transpose(1, 2)
        v_BGSDh = self.v_proj(x_BSD).view(B, S, -1, self.head_dim).transpose(1, 2)
        q_BHSDh = apply_rope(q_BHSDh, *rope)
        k_BGSDh = apply_rope(k_BGSDh, *rope)
        o_BHSDh = attend(q_BHSDh, k_BGSDh, v_BGSDh, scale=self.head_dim ** -0.5,
                         window=self.window, sinks_H=self.sinks)
        return self.o_proj(o_BHSDh.transpose(1, 2).reshape(B, S, -1))


class MLAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (transformers' `DeepseekV3Attention`).

    q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with a q LoRA; per head N dims
    without rotary then R with. kv_a_proj_with_mqa(x) = [latent Lkv | one shared rotary key R];
    kv_b_proj(kv_a_layernorm(latent)) = per head [k without rotary N | value V]. The softmax
    scale is (N + R)^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2."""

    def __init__(self, cfg: MoEConfig, layer: int = 0) -> None:
        super().__init__()
        a = cfg.attention
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.nope, self.rot, self.v_dim = H, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank = a.kv_lora_rank
        self.interleaved = cfg.rope.interleaved
        qk = self.nope + self.rot
        if a.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(D, a.q_lora_rank, bias=a.qkv_bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = Linear(a.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = Linear(D, H * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(D, a.kv_lora_rank + self.rot, bias=a.qkv_bias)
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = Linear(a.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, D, bias=a.o_bias)
        self.scale = qk ** -0.5 * cfg.rope.mla_softmax_mscale()

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H = self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x_BSD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        q_BHSQ = q.view(B, S, H, self.nope + self.rot).transpose(1, 2)
        q_pass, q_rot = torch.split(q_BHSQ, [self.nope, self.rot], dim=-1)
        kv_nope, k_rot = torch.split(self.kv_a_proj_with_mqa(x_BSD),
                                     [self.kv_lora_rank, self.rot], dim=-1)
        k_rot_B1SR = k_rot.view(B, 1, S, self.rot)
        q_rot = apply_rope(q_rot, *rope, interleaved=self.interleaved)
        k_rot_B1SR = apply_rope(k_rot_B1SR, *rope, interleaved=self.interleaved)
        kv_BHSX = self.kv_b_proj(self.kv_a_layernorm(kv_nope)).view(
            B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v_BHSV = torch.split(kv_BHSX, [self.nope, self.v_dim], dim=-1)
        k_BHSQ = torch.cat([k_nope, k_rot_B1SR.expand(-1, H, -1, -1)], dim=-1)
        q_BHSQ = torch.cat([q_pass, q_rot], dim=-1)
        # values padded to the q/k head dim: fused SDPA kernels (CPU and CUDA flash) need one
        # head dim, and without them the math path keeps the [S, S] probabilities for backward
        pad = self.nope + self.rot - self.v_dim
        v = F.pad(v_BHSV, (0, pad)) if pad > 0 else v_BHSV
        o_BHSV = F.scaled_dot_product_attention(q_BHSQ, k_BHSQ, v, is_causal=True,
                                                scale=self.scale)[..., :self.v_dim]
        return self.o_proj(o_BHSV.transpose(1, 2).reshape(B, S, -1))


def make_attention(cfg: MoEConfig, layer: int) -> nn.Module:
    return (MLAttention if cfg.attention.kind == "mla" else Attention)(cfg, layer)
