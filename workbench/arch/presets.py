"""Model presets: Python functions of keyword overrides returning a `MoEConfig`.

Overrides go through `replace`, so every preset result is validated again. The `*_like` presets
keep the expert GEMM and attention shapes of a released model with a few layers (and, where the
real expert count would not fit one GPU with its training state, fewer experts), for the GPU
benchmarks; the `tiny*` presets are CPU test models, one per family.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from workbench.arch.blocks import AttentionConfig, ExpertConfig, RopeConfig, RouterConfig
from workbench.arch.config import MoEConfig


def tiny(**overrides: Any) -> MoEConfig:
    """CPU tests: byte-level vocab, seconds per step."""
    return MoEConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, expert_ffn=32, num_experts=8, top_k=2, dense_ffn=128,
                     rope_theta=10_000.0, max_seq_len=256).replace(**overrides)


def small(**overrides: Any) -> MoEConfig:
    """CPU demo: a few minutes of training shows a falling loss."""
    return MoEConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=4,
                     head_dim=16, expert_ffn=64, num_experts=16, top_k=4, dense_ffn=256,
                     rope_theta=10_000.0, max_seq_len=512).replace(**overrides)


def tiny_gpt_oss(**overrides: Any) -> MoEConfig:
    """CPU tests of the gpt-oss blocks: sinks, a sliding and a full layer, YaRN, biases, the
    clamped SwiGLU."""
    return MoEConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        expert_ffn=32, num_experts=8, top_k=2, rope_theta=10_000.0, rms_eps=1e-5,
        aux_loss_coef=0.01, max_seq_len=256, family="gpt_oss",
        attention=AttentionConfig(qk_norm=False, qkv_bias=True, o_bias=True, sinks=True,
                                  sliding_window=8,
                                  layer_types=("sliding_attention", "full_attention")),
        rope=RopeConfig(kind="yarn", factor=4.0, original_max_position=64, truncate=False),
        router=RouterConfig(kind="topk_softmax", bias=True),
        experts=ExpertConfig(activation="clamped_swiglu", bias=True)).replace(**overrides)


def tiny_deepseek(**overrides: Any) -> MoEConfig:
    """CPU tests of the DeepSeek-V3 blocks: MLA with q LoRA, interleaved YaRN rotary, sigmoid
    group-limited routing, a shared expert and a dense first layer."""
    return MoEConfig(
        vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=24,
        expert_ffn=32, num_experts=8, top_k=2, dense_ffn=96, shared_expert_ffn=32,
        rope_theta=10_000.0, aux_loss_coef=0.0, max_seq_len=256, family="deepseek_v3",
        attention=AttentionConfig(kind="mla", qk_norm=False, q_lora_rank=32, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        rope=RopeConfig(kind="yarn", interleaved=True, factor=4.0, original_max_position=64,
                        mscale=1.0, mscale_all_dim=1.0),
        router=RouterConfig(kind="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5),
        first_k_dense=1).replace(**overrides)


def tiny_glm(**overrides: Any) -> MoEConfig:
    """CPU tests of the GLM-4.5 blocks: GQA with q/k/v bias and q/k norm, half rotary, sigmoid
    routing, a shared expert and a dense first layer."""
    return MoEConfig(
        vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        expert_ffn=32, num_experts=8, top_k=2, dense_ffn=96, shared_expert_ffn=32,
        rope_theta=10_000.0, rms_eps=1e-5, aux_loss_coef=0.0, max_seq_len=256,
        family="glm4_moe", attention=AttentionConfig(qk_norm=True, qkv_bias=True),
        rope=RopeConfig(partial_factor=0.5),
        router=RouterConfig(kind="sigmoid", routed_scaling_factor=1.5),
        first_k_dense=1).replace(**overrides)


def qwen3_30b_a3b_like(num_layers: int = 4, **overrides: Any) -> MoEConfig:
    """Expert and attention shapes of Qwen3-30B-A3B (48 layers in the real model)."""
    return MoEConfig(vocab_size=151_936, hidden_size=2048, num_layers=num_layers, num_heads=32,
                     num_kv_heads=4, head_dim=128, expert_ffn=768, num_experts=128, top_k=8,
                     dense_ffn=6144, rope_theta=1_000_000.0, max_seq_len=40_960).replace(**overrides)


def k3_like(num_layers: int = 4, **overrides: Any) -> MoEConfig:
    """K3-like expert shape (hidden 3584, expert FFN 3072) with a shared expert.

    Only the expert GEMM shapes are meant to match; expert count, attention and vocab are
    illustrative choices that fit the GPU benchmarks.
    """
    return MoEConfig(vocab_size=163_840, hidden_size=3584, num_layers=num_layers, num_heads=28,
                     num_kv_heads=4, head_dim=128, expert_ffn=3072, num_experts=64, top_k=8,
                     dense_ffn=3072 * 4, shared_expert_ffn=3072, rope_theta=1_000_000.0,
                     max_seq_len=32_768).replace(**overrides)


def gpt_oss_20b_like(num_layers: int = 4, **overrides: Any) -> MoEConfig:
    """gpt-oss-20b with fewer layers (24 in the real model): every block and shape of its
    config.json (hidden 2880, 32 experts of FFN 2880, top-4, 64 query / 8 kv heads of 64,
    sinks, alternating 128-token sliding and full layers, YaRN x32, clamped SwiGLU, biases)."""
    return MoEConfig(
        vocab_size=201_088, hidden_size=2880, num_layers=num_layers, num_heads=64, num_kv_heads=8,
        head_dim=64, expert_ffn=2880, num_experts=32, top_k=4, rope_theta=150_000.0,
        rms_eps=1e-5, aux_loss_coef=0.9, max_seq_len=131_072, family="gpt_oss",
        attention=AttentionConfig(qk_norm=False, qkv_bias=True, o_bias=True, sinks=True,
                                  sliding_window=128, layer_types=tuple(
                                      ("sliding_attention", "full_attention")[i % 2]
                                      for i in range(num_layers))),
        rope=RopeConfig(kind="yarn", factor=32.0, original_max_position=4096, truncate=False),
        router=RouterConfig(kind="topk_softmax", bias=True),
        experts=ExpertConfig(activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True),
    ).replace(**overrides)


def _mla_v3(**overrides: Any) -> AttentionConfig:
    return AttentionConfig(kind="mla", qk_norm=False, q_lora_rank=1536, kv_lora_rank=512,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, **overrides)


def deepseek_v3_like(num_layers: int = 3, num_experts: int = 32, **overrides: Any) -> MoEConfig:
    """DeepSeek-V3's layers (hidden 7168, MLA with q LoRA 1536 / kv LoRA 512, 128 heads,
    expert FFN 2048, top-8 in 8 groups of which 4, routed scale 2.5, one shared expert, dense
    first layer of FFN 18432, interleaved YaRN x40) with few layers and 32 of its 256 experts,
    so a few layers train on one GPU with fp32 masters and AdamW state."""
    return MoEConfig(
        vocab_size=129_280, hidden_size=7168, num_layers=num_layers, num_heads=128,
        num_kv_heads=128, head_dim=192, expert_ffn=2048, num_experts=num_experts, top_k=8,
        dense_ffn=18_432, shared_expert_ffn=2048, rope_theta=10_000.0, aux_loss_coef=0.0,
        max_seq_len=163_840, family="deepseek_v3", attention=_mla_v3(),
        rope=RopeConfig(kind="yarn", interleaved=True, factor=40.0, original_max_position=4096,
                        mscale=1.0, mscale_all_dim=1.0),
        router=RouterConfig(kind="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5),
        first_k_dense=1).replace(**overrides)


def kimi_k2_like(num_layers: int = 3, num_experts: int = 32, **overrides: Any) -> MoEConfig:
    """Kimi K2's layers (DeepSeek-V3's architecture with 64 heads, 384 experts in one group,
    routed scale 2.827, vocab 163840, YaRN x32 on theta 50000) with few layers and 32 experts."""
    return deepseek_v3_like(
        num_layers, num_experts, vocab_size=163_840, num_heads=64, num_kv_heads=64,
        rope_theta=50_000.0, max_seq_len=131_072,
        rope=RopeConfig(kind="yarn", interleaved=True, factor=32.0, original_max_position=4096,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        router=RouterConfig(kind="sigmoid", routed_scaling_factor=2.827)).replace(**overrides)


PRESETS: dict[str, Callable[..., MoEConfig]] = {
    "tiny": tiny, "small": small, "tiny_gpt_oss": tiny_gpt_oss, "tiny_deepseek": tiny_deepseek,
    "tiny_glm": tiny_glm, "qwen3_30b_a3b_like": qwen3_30b_a3b_like, "k3_like": k3_like,
    "gpt_oss_20b_like": gpt_oss_20b_like, "deepseek_v3_like": deepseek_v3_like,
    "kimi_k2_like": kimi_k2_like,
}


_PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def register_preset(name: str, fn: Callable[..., MoEConfig]) -> str:
    """Add a model preset (a function of keyword overrides returning a `MoEConfig`) under `name`,
    for this process: what drivers that sweep shapes (the EP protocol's `BASE-L<n>-V<v>`) call
    instead of writing into `PRESETS`. Names are checked because they travel into run folders,
    Slurm job names and shell lines; an existing name is never replaced."""
    if not isinstance(name, str) or not _PRESET_NAME.fullmatch(name):
        raise ValueError(f"preset name {name!r}: 1-64 letters, digits, '_', '.', '-' "
                         "(starting with a letter or digit)")
    if name in PRESETS:
        raise ValueError(f"preset {name!r} is already registered")
    PRESETS[name] = fn
    return name


def preset(name: str, **overrides: Any) -> MoEConfig:
    try:
        fn = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return fn(**overrides)
