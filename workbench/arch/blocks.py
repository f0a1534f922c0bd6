"""The blocks a model family is made of: attention, rotary embedding, router, experts.

Each is a small frozen dataclass, validated where it is built. `MoEConfig` (config.py) holds one
of each; the defaults are Qwen3-MoE's, so a config that names none of them is the model the
workbench always built. What each family's `config.json` sets is mapped in `families.py`:

| block | Qwen3-MoE | gpt-oss | DeepSeek-V3 / Kimi K2 | GLM-4.5 |
|---|---|---|---|---|
| attention | GQA, q/k RMSNorm | GQA, biases, sinks, sliding/full layers | MLA | GQA, q/k/v bias, optional q/k norm, half rotary |
| rotary | default | YaRN | YaRN, interleaved pairs | default |
| router | softmax, top-k | top-k of biased logits, softmax | sigmoid, correction bias, group-limited top-k, scale | as DeepSeek-V3 |
| experts | SwiGLU | clamped SwiGLU, biases | SwiGLU + shared expert | SwiGLU + shared expert |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATTENTION_KINDS = ("gqa", "mla")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_KINDS = ("default", "yarn")
ROUTER_KINDS = ("softmax", "topk_softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "clamped_swiglu")


def _positive(owner: str, **values: object) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Causal self-attention of one family.

    kind "gqa": grouped-query attention over `MoEConfig.num_heads / num_kv_heads / head_dim`,
    with optional per-head q/k RMSNorm (`qk_norm`), biases on q/k/v (`qkv_bias`) and on the
    output projection (`o_bias`), learned per-head sinks (gpt-oss: a logit every query sees,
    with no value) and sliding-window layers (`layer_types[i] == "sliding_attention"` attends
    to the last `sliding_window` positions, itself included).

    kind "mla": DeepSeek's multi-head latent attention. q is `q_proj` (q_lora_rank 0) or
    `q_b_proj(norm(q_a_proj(x)))`; keys and values come from one latent of `kv_lora_rank` plus
    a shared rotary key of `qk_rope_head_dim`; per head q/k have `qk_nope_head_dim` dims without
    and `qk_rope_head_dim` dims with rotary, values `v_head_dim`. `qkv_bias` puts biases on
    `q_a_proj` and `kv_a_proj_with_mqa`, `o_bias` on `o_proj` (transformers' attention_bias).
    """

    kind: str = "gqa"
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    sliding_window: int = 0  # 0: no sliding-window layers
    layer_types: tuple[str, ...] = ()  # per layer; () = every layer full attention
    q_lora_rank: int = 0  # MLA; 0 = plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        _choice("AttentionConfig", "kind", self.kind, ATTENTION_KINDS)
        if not isinstance(self.layer_types, tuple):
            raise TypeError("AttentionConfig.layer_types must be a tuple, got "
                            f"{type(self.layer_types).__name__}")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"AttentionConfig.layer_types: {bad} are not among {LAYER_TYPES}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError("AttentionConfig.sliding_window must be an int >= 0, got "
                             f"{self.sliding_window!r}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("AttentionConfig has sliding_attention layers but sliding_window "
                             "is 0; set the window (transformers' sliding_window)")
        if self.kind == "mla":
            _positive("AttentionConfig", kv_lora_rank=self.kv_lora_rank,
                      qk_nope_head_dim=self.qk_nope_head_dim,
                      qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
            if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
                raise ValueError("AttentionConfig.q_lora_rank must be an int >= 0 (0 = plain "
                                 f"q_proj), got {self.q_lora_rank!r}")
            if self.qk_rope_head_dim % 2:
                raise ValueError("AttentionConfig.qk_rope_head_dim must be even for RoPE, got "
                                 f"{self.qk_rope_head_dim}")
            for name in ("qk_norm", "sinks"):
                if getattr(self, name):
                    raise ValueError(f"AttentionConfig.{name} is a GQA option; MLA has none")
            if self.layer_types and set(self.layer_types) != {"full_attention"}:
                raise ValueError("MLA has no sliding-window layers")
        elif any((self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                  self.qk_rope_head_dim, self.v_head_dim)):
            raise ValueError("AttentionConfig: the MLA dims (q_lora_rank, kv_lora_rank, "
                             "qk_*_head_dim, v_head_dim) are set but kind is 'gqa'")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def window(self, layer: int) -> int:
        """Positions a query of `layer` sees (itself included); 0 = all earlier positions."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else 0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding (the base frequency is `MoEConfig.rope_theta`).

    kind "yarn" follows transformers' `_compute_yarn_parameters`: inverse frequencies blended
    between interpolation (/ factor) and extrapolation over the ramp [beta_fast, beta_slow]
    rotations of `original_max_position`, and cos/sin scaled by the attention factor
    (given, or from factor, mscale and mscale_all_dim). MLA also multiplies its softmax scale
    by mscale(factor, mscale_all_dim)^2 (DeepSeek-V3).
    `partial_factor`: the share of each head's dims that rotate (GLM-4.5: 0.5, the first half).
    `interleaved`: rotary pairs are adjacent dims (x0, x1), (x2, x3)... (DeepSeek's
    rope_interleave), not the two halves of the head.
    """

    kind: str = "default"
    partial_factor: float = 1.0
    interleaved: bool = False
    factor: float = 1.0
    original_max_position: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _choice("RopeConfig", "kind", self.kind, ROPE_KINDS)
        if not 0 < self.partial_factor <= 1:
            raise ValueError(f"RopeConfig.partial_factor must be in (0, 1], got "
                             f"{self.partial_factor!r}")
        if self.kind == "yarn":
            if not self.factor > 0:
                raise ValueError(f"RopeConfig.factor must be > 0 for YaRN, got {self.factor!r}")
            _positive("RopeConfig", original_max_position=self.original_max_position)
            if not self.beta_fast > 0 or not self.beta_slow > 0:
                raise ValueError("RopeConfig.beta_fast / beta_slow must be > 0, got "
                                 f"{self.beta_fast!r} / {self.beta_slow!r}")

    def mla_softmax_mscale(self) -> float:
        """DeepSeek-V3's factor on the MLA softmax scale: mscale(factor, mscale_all_dim)^2,
        1 without YaRN or without mscale_all_dim (transformers' yarn_apply_mscale)."""
        if self.kind == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class RouterConfig:
    """How a token picks its experts and their weights (`MoEConfig.top_k`, `norm_topk_prob`).

    kind "softmax" (Qwen3-MoE): softmax over all experts, top-k, optionally renormalised.
    kind "topk_softmax" (gpt-oss): top-k of the logits (with the router's `bias`), softmax over
    the k chosen.
    kind "sigmoid" (DeepSeek-V3, GLM-4.5): sigmoid scores; experts are chosen on scores plus
    `e_score_correction_bias` (selection only), first the `topk_group` best of `n_group`
    groups (a group's score is the sum of its two best), then the top-k inside them; weights
    are the unbiased scores of the chosen, renormalised if `norm_topk_prob`, times
    `routed_scaling_factor`.
    """

    kind: str = "softmax"
    bias: bool = False  # a learned bias on the router logits (gpt-oss)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        _choice("RouterConfig", "kind", self.kind, ROUTER_KINDS)
        _positive("RouterConfig", n_group=self.n_group, topk_group=self.topk_group)
        if self.topk_group > self.n_group:
            raise ValueError(f"RouterConfig.topk_group ({self.topk_group}) exceeds n_group "
                             f"({self.n_group})")
        if self.kind != "sigmoid" and (self.n_group, self.topk_group) != (1, 1):
            raise ValueError("RouterConfig: group-limited routing (n_group, topk_group) needs "
                             "kind 'sigmoid'")
        if self.kind != "sigmoid" and self.routed_scaling_factor != 1.0:
            raise ValueError("RouterConfig.routed_scaling_factor needs kind 'sigmoid'")
        if not self.routed_scaling_factor > 0:
            raise ValueError("RouterConfig.routed_scaling_factor must be > 0, got "
                             f"{self.routed_scaling_factor!r}")


@dataclass(frozen=True)
class ExpertConfig:
    """The routed experts' activation and biases.

    "swiglu": silu(gate) * up. "clamped_swiglu" (gpt-oss): gate clamped above at `limit`, up
    clamped to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). `bias`: per-expert
    biases on gate, up and down (gpt-oss).
    """

    activation: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False

    def __post_init__(self) -> None:
        _choice("ExpertConfig", "activation", self.activation, ACTIVATIONS)
        if self.activation == "clamped_swiglu" and not (self.alpha > 0 and self.limit > 0):
            raise ValueError("ExpertConfig: clamped_swiglu needs alpha > 0 and limit > 0, got "
                             f"{self.alpha!r}, {self.limit!r}")
