"""`MoEConfig`: the typed description of every model the workbench builds.

The flat fields are the shape every family shares (their names are ours; `families.py` maps each
family's config.json onto them); the block fields (`attention`, `rope`, `router`, `experts`)
carry what differs between families (blocks.py), with Qwen3-MoE's behaviour as the default.
`family` names the checkpoint convention (tensor names, config class) the model reads and
writes: "qwen3_moe", "deepseek_v3" (also Kimi K2), "glm4_moe" or "gpt_oss".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from workbench.arch.blocks import AttentionConfig, ExpertConfig, RopeConfig, RouterConfig

# Every reduction dimension a block-scaled format touches (hidden for w1/w3, expert FFN for w2)
# must hold whole MX blocks; presets are checked against this in tests.
MX_BLOCK = 32

FAMILY_NAMES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # MLA: = num_heads
    head_dim: int  # MLA: the q/k head dim, qk_nope_head_dim + qk_rope_head_dim
    expert_ffn: int  # HF moe_intermediate_size (gpt-oss: intermediate_size)
    num_experts: int
    top_k: int  # HF num_experts_per_tok
    dense_ffn: int = 0  # HF intermediate_size: FFN of the dense layers
    norm_topk_prob: bool = True
    shared_expert_ffn: int = 0  # 0 = no shared expert (DeepSeek: n_shared_experts * expert_ffn)
    shared_expert_gate: bool = False  # Qwen2-MoE style sigmoid gate on the shared expert output
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    aux_loss_coef: float = 0.001
    max_seq_len: int = 4096
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_embeddings: bool = False
    init_std: float = 0.02
    family: str = "qwen3_moe"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    rope: RopeConfig = field(default_factory=RopeConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    experts: ExpertConfig = field(default_factory=ExpertConfig)
    first_k_dense: int = 0  # DeepSeek / GLM first_k_dense_replace: layers [0, k) are dense
    mtp_layers: int = 0  # multi-token-prediction layers a checkpoint stores after the model

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "expert_ffn", "num_experts", "top_k", "max_seq_len",
                    "decoder_sparse_step")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        for name in ("dense_ffn", "shared_expert_ffn", "first_k_dense", "mtp_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"MoEConfig.{name} must be an int >= 0 (0 = none), got {value!r}")
        for name, cls in (("attention", AttentionConfig), ("rope", RopeConfig),
                          ("router", RouterConfig), ("experts", ExpertConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"MoEConfig.{name} must be a {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.family not in FAMILY_NAMES:
            raise ValueError(f"MoEConfig.family must be one of {FAMILY_NAMES}, got "
                             f"{self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MoEConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        att = self.attention
        if att.kind == "mla":
            if self.head_dim != att.qk_nope_head_dim + att.qk_rope_head_dim:
                raise ValueError(f"MoEConfig.head_dim ({self.head_dim}) must be qk_nope_head_dim"
                                 f" + qk_rope_head_dim ({att.qk_nope_head_dim} + "
                                 f"{att.qk_rope_head_dim}) for MLA")
            if self.num_kv_heads != self.num_heads:
                raise ValueError("MLA expands keys and values to every head: num_kv_heads must "
                                 f"equal num_heads ({self.num_heads}), got {self.num_kv_heads}")
            if self.rope.partial_factor != 1.0:
                raise ValueError("MLA rotates qk_rope_head_dim dims; partial_factor must be 1")
        if self.rope_dim % 2 or self.rope_dim <= 0:
            raise ValueError(f"MoEConfig: the rotary dims ({self.rope_dim} = head_dim x "
                             f"partial_factor) must be a positive even number")
        if att.layer_types and len(att.layer_types) != self.num_layers:
            raise ValueError(f"AttentionConfig.layer_types lists {len(att.layer_types)} layers, "
                             f"the model has {self.num_layers}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts})")
        r = self.router
        if r.kind == "sigmoid":
            if self.num_experts % r.n_group:
                raise ValueError(f"MoEConfig: {self.num_experts} experts do not split into "
                                 f"n_group={r.n_group} groups")
            per_group = self.num_experts // r.n_group
            if r.n_group > 1 and per_group < 2:
                raise ValueError("MoEConfig: group-limited routing scores a group by its two "
                                 f"best experts; {per_group} per group is too few")
            if self.top_k > r.topk_group * per_group:
                raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds the experts of the "
                                 f"{r.topk_group} groups a token may use ({per_group} each)")
            if self.aux_loss_coef:
                raise ValueError("MoEConfig.aux_loss_coef must be 0 with a sigmoid router: "
                                 "these families balance experts through e_score_correction_"
                                 "bias (the trainer's router bias update), not an aux loss")
        if self.shared_expert_gate and not self.shared_expert_ffn:
            raise ValueError("MoEConfig.shared_expert_gate needs shared_expert_ffn > 0")
        if not isinstance(self.mlp_only_layers, tuple):
            # Lists would make the frozen config unhashable; say how to fix it.
            raise TypeError("MoEConfig.mlp_only_layers must be a tuple of layer indices, got "
                            f"{type(self.mlp_only_layers).__name__}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"MoEConfig.mlp_only_layers has indices outside [0, {self.num_layers}):"
                             f" {bad}")
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"MoEConfig.first_k_dense ({self.first_k_dense}) exceeds "
                             f"num_layers ({self.num_layers})")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.dense_ffn <= 0:
            raise ValueError("MoEConfig has dense layers (first_k_dense / mlp_only_layers / "
                             "decoder_sparse_step) but dense_ffn is 0; set dense_ffn (HF "
                             "intermediate_size)")
        for name in ("rope_theta", "rms_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoEConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    @property
    def rope_dim(self) -> int:
        """Dims of each q/k head that rotate."""
        if self.attention.kind == "mla":
            return self.attention.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """A layer is sparse unless it is among the first `first_k_dense` (DeepSeek), listed in
        mlp_only_layers or off the sparse step (Qwen3-MoE)."""
        return (layer >= self.first_k_dense and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)

    def with_layers(self, num_layers: int) -> MoEConfig:
        """The same model with `num_layers` layers (the planner's and benchmarks' "a few layers
        of this model"): per-layer lists are cut, or continued with their own pattern."""
        a = self.attention
        types = tuple(a.layer_types[i % len(a.layer_types)] for i in range(num_layers)) \
            if a.layer_types else ()
        return self.replace(
            num_layers=num_layers, attention=dataclasses.replace(a, layer_types=types),
            first_k_dense=min(self.first_k_dense, num_layers),
            mlp_only_layers=tuple(i for i in self.mlp_only_layers if i < num_layers))
