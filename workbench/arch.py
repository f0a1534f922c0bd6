"""Typed configuration of the reference MoE transformer, its presets, and the Qwen3-MoE bridge.

The field set mirrors transformers' `Qwen3MoeConfig` (names are ours, the mapping lives in
`from_hf_config` / `to_hf_config`), plus an optional shared expert (Qwen2-MoE / DeepSeek style),
which Qwen3-MoE itself does not have.

It lives at the top level, not in `workbench.model`, and imports only the standard library:
the launcher (`workbench.launch`) and the trainer's configuration (`workbench.train.config`)
read presets and checkpoint configs from here without loading torch, which importing anything
under `workbench.model` does (its `__init__` builds the modules). `workbench.model` re-exports
the public names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Every reduction dimension a block-scaled format touches (hidden for w1/w3, expert FFN for w2)
# must hold whole MX blocks; presets are checked against this in tests.
MX_BLOCK = 32


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    expert_ffn: int  # HF moe_intermediate_size
    num_experts: int
    top_k: int  # HF num_experts_per_tok
    dense_ffn: int = 0  # HF intermediate_size: FFN of the dense layers (mlp_only_layers / sparse step)
    norm_topk_prob: bool = True
    shared_expert_ffn: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE style sigmoid gate on the shared expert output
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    aux_loss_coef: float = 0.001
    max_seq_len: int = 4096
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "expert_ffn", "num_experts", "top_k", "max_seq_len",
                    "decoder_sparse_step")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        for name in ("dense_ffn", "shared_expert_ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MoEConfig.{name} must be an int >= 0 (0 = none), got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MoEConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds num_experts "
                             f"({self.num_experts})")
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
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.dense_ffn <= 0:
            raise ValueError("MoEConfig has dense layers (mlp_only_layers / decoder_sparse_step) "
                             "but dense_ffn is 0; set dense_ffn (HF intermediate_size)")
        for name in ("rope_theta", "rms_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MoEConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"MoEConfig.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: a layer is sparse unless listed in mlp_only_layers or off the step."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def replace(self, **changes: Any) -> MoEConfig:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Presets. Overrides go through `replace`, so every preset result is validated again.


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


PRESETS = {"tiny": tiny, "small": small, "qwen3_30b_a3b_like": qwen3_30b_a3b_like,
           "k3_like": k3_like}


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


# ---------------------------------------------------------------------------------------------
# transformers bridge (Qwen3-MoE). transformers is imported only inside to_hf_config.


def from_hf_config(hf: Any) -> MoEConfig:
    """Build a MoEConfig from a transformers `Qwen3MoeConfig` (or its `to_dict()`)."""
    get = (lambda k, d=None: hf.get(k, d)) if isinstance(hf, dict) else (
        lambda k, d=None: getattr(hf, k, d))
    model_type = get("model_type")
    if model_type not in (None, "qwen3_moe"):
        raise ValueError(f"from_hf_config expects a qwen3_moe config, got model_type={model_type!r}")
    # transformers 5 writes `rope_parameters`; checkpoints from transformers 4 (the released
    # Qwen3-MoE configs) have a top-level `rope_theta` and `rope_scaling` (null = default RoPE).
    rope = get("rope_parameters") or get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    if get("use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
    if get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported (Qwen3-MoE has no q/k/v bias)")
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (only silu)")
    num_experts = get("num_experts", None) or get("num_local_experts")
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    return MoEConfig(
        vocab_size=get("vocab_size"), hidden_size=hidden, num_layers=get("num_hidden_layers"),
        num_heads=heads, num_kv_heads=get("num_key_value_heads"),
        head_dim=get("head_dim", None) or hidden // heads, expert_ffn=get("moe_intermediate_size"),
        num_experts=num_experts, top_k=get("num_experts_per_tok"),
        dense_ffn=get("intermediate_size", 0) or 0, norm_topk_prob=bool(get("norm_topk_prob")),
        rope_theta=float(rope.get("rope_theta", get("rope_theta", 10_000.0))),
        rms_eps=float(get("rms_norm_eps")), aux_loss_coef=float(get("router_aux_loss_coef")),
        max_seq_len=get("max_position_embeddings"),
        decoder_sparse_step=get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(get("mlp_only_layers", None) or ()),
        tie_embeddings=bool(get("tie_word_embeddings", False)),
        init_std=float(get("initializer_range", 0.02)),
    )


def to_hf_config(cfg: MoEConfig) -> Any:
    """The transformers `Qwen3MoeConfig` of the same architecture."""
    if cfg.shared_expert_ffn:
        raise ValueError("Qwen3-MoE has no shared expert; a config with shared_expert_ffn > 0 "
                         "has no Qwen3MoeConfig equivalent")
    try:
        from transformers import Qwen3MoeConfig
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("to_hf_config needs transformers: pip install 'workbench[dev]'") from e
    return Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.dense_ffn or cfg.expert_ffn, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, moe_intermediate_size=cfg.expert_ffn, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_eps, router_aux_loss_coef=cfg.aux_loss_coef,
        max_position_embeddings=cfg.max_seq_len, decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers), tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, architectures=["Qwen3MoeForCausalLM"],
    )


# Architectures whose config.json maps onto this model (transformers' class names).
SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


class ModelConfigError(ValueError):
    """A checkpoint's config.json does not describe a model this workbench can build; the
    message names the file and the field."""


def from_checkpoint(path: str | Path) -> MoEConfig:
    """The MoEConfig of the checkpoint folder `path` (its config.json), without reading weights.

    Any Qwen3-MoE-family config (`architectures: ["Qwen3MoeForCausalLM"]` or
    `model_type: "qwen3_moe"`, any size) maps; another architecture is an error naming it.
    `quantization_config` (packed checkpoints) describes the stored weights, not the model, and
    is left to the checkpoint reader."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelConfigError(f"{file}: not found (a checkpoint folder needs its config.json "
                               "to build the model; or pass --preset)")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return config_from_dict(raw, source=str(file))


def config_from_dict(raw: dict[str, Any], *, source: str = "config.json") -> MoEConfig:
    """`from_checkpoint` on an already parsed config.json dict (no file access)."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not isinstance(archs, list):
        raise ModelConfigError(f"{source}: 'architectures' must be a list, got {archs!r}")
    unsupported = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if unsupported or (not archs and model_type != "qwen3_moe"):
        name = unsupported[0] if unsupported else f"model_type={model_type!r}"
        raise ModelConfigError(f"{source}: architecture {name} is not supported; the workbench "
                               f"builds {', '.join(SUPPORTED_ARCHITECTURES)} (model_type "
                               "'qwen3_moe')")
    if model_type not in (None, "qwen3_moe"):
        raise ModelConfigError(f"{source}: model_type {model_type!r} does not match architecture "
                               f"{archs[0]} (expected 'qwen3_moe')")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "moe_intermediate_size", "num_experts_per_tok",
                "rms_norm_eps", "max_position_embeddings")
    missing = [k for k in required if raw.get(k) is None]
    if raw.get("num_experts") is None and raw.get("num_local_experts") is None:
        missing.append("num_experts")
    if missing:
        raise ModelConfigError(f"{source}: missing field(s) {missing}")
    # Absent fields take Qwen3MoeConfig's defaults (transformers 5.24), as transformers would.
    raw = {"router_aux_loss_coef": 0.001, "norm_topk_prob": False, **raw}
    try:
        return from_hf_config(raw)
    except (TypeError, ValueError) as e:
        raise ModelConfigError(f"{source}: {e}") from e
