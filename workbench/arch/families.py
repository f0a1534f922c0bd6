"""config.json <-> MoEConfig for each supported family, through transformers' config classes.

A checkpoint's config.json is parsed by the family's own transformers config class
(`Qwen3MoeConfig`, `DeepseekV3Config`, `Glm4MoeConfig`, `GptOssConfig`; never remote code), so an
absent optional field takes the default transformers documents for that family, and the rotary
parameters come out standardised (`rope_scaling` of older files and `rope_parameters` of newer
ones alike). The shape fields of each family must be present: a truncated config.json is an
error naming them, not a model built from another model's defaults. Features transformers would
run differently from the workbench (another activation, scoring function or rotary kind) are
refused by name.

transformers is imported inside the functions (importing it loads torch), so `workbench.arch`
stays importable without torch; parsing a checkpoint's config needs the `data` extra.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.arch.blocks import AttentionConfig, ExpertConfig, RopeConfig, RouterConfig
from workbench.arch.config import MoEConfig

CONFIG_LIMIT = 1 << 20  # bytes; a config.json is a few KiB


class ModelConfigError(ValueError):
    """A checkpoint's config.json does not describe a model this workbench can build; the
    message names the file and the field."""


@dataclass(frozen=True)
class Family:
    name: str  # MoEConfig.family
    architecture: str  # config.json "architectures"
    config_class: str  # the transformers config class
    model_types: tuple[str, ...]  # config.json "model_type" values of this architecture
    required: tuple[str, ...]  # shape fields config.json must state
    examples: str  # released models, for docs and messages


FAMILIES = (
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", ("qwen3_moe",),
           ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "moe_intermediate_size", "num_experts_per_tok",
            "rms_norm_eps", "max_position_embeddings"), "Qwen3-30B-A3B, Qwen3-235B-A22B"),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
           ("deepseek_v3", "kimi_k2"),
           ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
           "DeepSeek-V3, DeepSeek-R1, Kimi K2"),
    Family("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig", ("glm4_moe",),
           ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "moe_intermediate_size", "n_routed_experts",
            "num_experts_per_tok"), "GLM-4.5, GLM-4.5-Air"),
    Family("gpt_oss", "GptOssForCausalLM", "GptOssConfig", ("gpt_oss",),
           ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "num_local_experts",
            "num_experts_per_tok"), "gpt-oss-20b, gpt-oss-120b"),
)
BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
# Architectures whose config.json maps onto the workbench model (transformers' class names).
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES)
# Keys of config.json that describe the file, not the model (the config class would keep them).
_NOT_MODEL = ("architectures", "model_type", "auto_map", "quantization_config", "torch_dtype",
              "dtype", "transformers_version", "_name_or_path", "compression_config")


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading a checkpoint's config.json needs transformers: "
                          "pip install 'workbench[data]'") from e
    return transformers


def _family_of(raw: dict[str, Any], source: str) -> Family:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not isinstance(archs, list):
        raise ModelConfigError(f"{source}: 'architectures' must be a list, got {archs!r}")
    unsupported = [a for a in archs if a not in BY_ARCHITECTURE]
    if archs and not unsupported:
        fam = BY_ARCHITECTURE[archs[0]]
        if model_type is not None and model_type not in fam.model_types:
            raise ModelConfigError(f"{source}: model_type {model_type!r} does not match "
                                   f"architecture {archs[0]} (expected "
                                   f"{' or '.join(map(repr, fam.model_types))})")
        return fam
    if not archs:
        for fam in FAMILIES:
            if model_type in fam.model_types:
                return fam
    name = unsupported[0] if unsupported else f"model_type={model_type!r}"
    raise ModelConfigError(f"{source}: architecture {name} is not supported; the workbench "
                           f"builds {', '.join(SUPPORTED_ARCHITECTURES)}")


def config_from_dict(raw: dict[str, Any], *, source: str = "config.json") -> MoEConfig:
    """The MoEConfig of an already parsed config.json dict (no file access)."""
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    fam = _family_of(raw, source)
    missing = [k for k in fam.required if raw.get(k) is None]
    if fam.name == "qwen3_moe" and raw.get("num_experts") is None \
            and raw.get("num_local_experts") is None:
        missing.append("num_experts")
    if missing:
        raise ModelConfigError(f"{source}: missing field(s) {missing}")
    try:
        hf = _hf_config_object(fam, raw)
        return from_hf_config(hf, family=fam.name)
    except ModelConfigError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ModelConfigError(f"{source}: {e}") from e
    except Exception as e:  # huggingface_hub's strict-dataclass errors name the field
        if type(e).__name__.startswith("StrictDataclass"):
            raise ModelConfigError(f"{source}: {e}") from e
        raise


def from_checkpoint(path: str | Path) -> MoEConfig:
    """The MoEConfig of the checkpoint folder `path` (its config.json), without reading weights.

    `quantization_config` (packed checkpoints) describes the stored weights, not the model, and
    is left to the checkpoint reader."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelConfigError(f"{file}: not found (a checkpoint folder needs its config.json "
                               "to build the model; or pass --preset)")
    if file.stat().st_size > CONFIG_LIMIT:
        raise ModelConfigError(f"{file}: larger than {CONFIG_LIMIT >> 20} MiB, not a model "
                               "config")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file}: not valid JSON ({e})") from e
    return config_from_dict(raw, source=str(file))


def _hf_config_object(fam: Family, raw: dict[str, Any]):
    cls = getattr(_transformers(), fam.config_class)
    kwargs = {k: v for k, v in raw.items() if k not in _NOT_MODEL}
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------------
# transformers config -> MoEConfig


def from_hf_config(hf: Any, *, family: str | None = None) -> MoEConfig:
    """Build a MoEConfig from a transformers config of a supported family (or its `to_dict()`).

    A dict goes through the family's config class first, so its defaults are transformers'."""
    if isinstance(hf, dict):
        fam = BY_NAME.get(family) if family else None
        if fam is None:
            model_type = hf.get("model_type")
            fam = next((f for f in FAMILIES if model_type in f.model_types), None)
            if fam is None:
                raise ValueError(f"from_hf_config expects a config of {[f.name for f in FAMILIES]}"
                                 f", got model_type={model_type!r}")
        hf = _hf_config_object(fam, hf)
    if family is None:
        family = next((f.name for f in FAMILIES if type(hf).__name__ == f.config_class), None)
        if family is None:
            raise ValueError(f"from_hf_config expects a config of {[f.name for f in FAMILIES]}, "
                             f"got {type(hf).__name__} (model_type="
                             f"{getattr(hf, 'model_type', None)!r})")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf.hidden_act!r} is not supported (only silu)")
    return _READERS[family](hf)


def _get(hf: Any, key: str, default: Any = None) -> Any:
    value = getattr(hf, key, default)
    return default if value is None else value


def _rope(hf: Any, *, interleaved: bool = False) -> tuple[float, RopeConfig]:
    """(theta, RopeConfig) from the standardised `rope_parameters` transformers built."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        raise ValueError("no rotary parameters (rope_parameters / rope_theta)")
    theta = float(params["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    partial = float(params.get("partial_rotary_factor") or 1.0)
    if kind == "default":
        return theta, RopeConfig(partial_factor=partial, interleaved=interleaved)
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r} is not supported (default or yarn)")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths (DeepSeek-style files)
        factor = hf.max_position_embeddings / original

    def opt(key):
        v = params.get(key)
        return None if v is None else float(v)

    return theta, RopeConfig(
        kind="yarn", partial_factor=partial, interleaved=interleaved, factor=float(factor),
        original_max_position=int(original),
        # transformers takes 32 / 1 when these are absent or zero
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"), truncate=bool(params.get("truncate", True)))


def _common(hf: Any) -> dict[str, Any]:
    return {"vocab_size": hf.vocab_size, "hidden_size": hf.hidden_size,
            "num_layers": hf.num_hidden_layers, "num_heads": hf.num_attention_heads,
            "top_k": hf.num_experts_per_tok, "rms_eps": float(hf.rms_norm_eps),
            "max_seq_len": hf.max_position_embeddings,
            "tie_embeddings": bool(_get(hf, "tie_word_embeddings", False)),
            "init_std": float(_get(hf, "initializer_range", 0.02))}


def _head_dim(hf: Any) -> int:
    return _get(hf, "head_dim") or hf.hidden_size // hf.num_attention_heads


def _qwen3(hf: Any) -> MoEConfig:
    if _get(hf, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported (use_sliding_window=True)")
    theta, rope = _rope(hf)
    if rope.partial_factor != 1.0:
        raise ValueError("partial_rotary_factor is not supported for qwen3_moe")
    bias = bool(_get(hf, "attention_bias", False))
    return MoEConfig(
        **_common(hf), num_kv_heads=hf.num_key_value_heads, head_dim=_head_dim(hf),
        expert_ffn=hf.moe_intermediate_size,
        num_experts=_get(hf, "num_experts") or hf.num_local_experts,
        dense_ffn=_get(hf, "intermediate_size", 0), norm_topk_prob=bool(hf.norm_topk_prob),
        rope_theta=theta, rope=rope, aux_loss_coef=float(hf.router_aux_loss_coef),
        decoder_sparse_step=_get(hf, "decoder_sparse_step", 1),
        mlp_only_layers=tuple(_get(hf, "mlp_only_layers", ())),
        attention=AttentionConfig(qk_norm=True, qkv_bias=bias, o_bias=bias))


def _sigmoid_router(hf: Any) -> RouterConfig:
    return RouterConfig(kind="sigmoid", n_group=_get(hf, "n_group", 1),
                        topk_group=_get(hf, "topk_group", 1),
                        routed_scaling_factor=float(hf.routed_scaling_factor))


def _check_remote_fields(hf: Any) -> None:
    # Fields only DeepSeek's remote code reads; transformers' model is sigmoid + noaux_tc.
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        have = getattr(hf, key, None)
        if have is not None and have != want:
            raise ValueError(f"{key} {have!r} is not supported ({want!r} only)")


def _deepseek_v3(hf: Any) -> MoEConfig:
    _check_remote_fields(hf)
    theta, rope = _rope(hf, interleaved=bool(_get(hf, "rope_interleave", True)))
    bias = bool(_get(hf, "attention_bias", False))
    nope, rot = hf.qk_nope_head_dim, hf.qk_rope_head_dim
    return MoEConfig(
        **_common(hf), num_kv_heads=hf.num_attention_heads, head_dim=nope + rot,
        expert_ffn=hf.moe_intermediate_size, num_experts=hf.n_routed_experts,
        dense_ffn=_get(hf, "intermediate_size", 0), norm_topk_prob=bool(hf.norm_topk_prob),
        shared_expert_ffn=_get(hf, "n_shared_experts", 0) * hf.moe_intermediate_size,
        rope_theta=theta, rope=rope, aux_loss_coef=0.0, family="deepseek_v3",
        attention=AttentionConfig(kind="mla", qk_norm=False, qkv_bias=bias, o_bias=bias,
                                  q_lora_rank=_get(hf, "q_lora_rank", 0),
                                  kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=nope,
                                  qk_rope_head_dim=rot, v_head_dim=hf.v_head_dim),
        router=_sigmoid_router(hf), first_k_dense=_get(hf, "first_k_dense_replace", 0),
        mtp_layers=_get(hf, "num_mtp_layers", 0))


def _glm4_moe(hf: Any) -> MoEConfig:
    theta, rope = _rope(hf)
    return MoEConfig(
        **_common(hf), num_kv_heads=hf.num_key_value_heads, head_dim=_head_dim(hf),
        expert_ffn=hf.moe_intermediate_size, num_experts=hf.n_routed_experts,
        dense_ffn=_get(hf, "intermediate_size", 0), norm_topk_prob=bool(hf.norm_topk_prob),
        shared_expert_ffn=_get(hf, "n_shared_experts", 0) * hf.moe_intermediate_size,
        rope_theta=theta, rope=rope, aux_loss_coef=0.0, family="glm4_moe",
        # attention_bias covers q/k/v only: GLM-4.5's o_proj never has a bias
        attention=AttentionConfig(qk_norm=bool(_get(hf, "use_qk_norm", False)),
                                  qkv_bias=bool(_get(hf, "attention_bias", False))),
        router=_sigmoid_router(hf), first_k_dense=_get(hf, "first_k_dense_replace", 0),
        mtp_layers=_get(hf, "num_mtp_layers", 0))


def _gpt_oss(hf: Any) -> MoEConfig:
    theta, rope = _rope(hf)
    if rope.partial_factor != 1.0:
        raise ValueError("partial_rotary_factor is not supported for gpt_oss")
    bias = bool(_get(hf, "attention_bias", True))
    return MoEConfig(
        **_common(hf), num_kv_heads=hf.num_key_value_heads, head_dim=_head_dim(hf),
        expert_ffn=hf.intermediate_size, num_experts=hf.num_local_experts,
        rope_theta=theta, rope=rope, aux_loss_coef=float(hf.router_aux_loss_coef),
        family="gpt_oss",
        attention=AttentionConfig(qk_norm=False, qkv_bias=bias, o_bias=bias, sinks=True,
                                  sliding_window=_get(hf, "sliding_window", 0),
                                  layer_types=tuple(hf.layer_types)),
        router=RouterConfig(kind="topk_softmax", bias=True),
        experts=ExpertConfig(activation="clamped_swiglu",
                             alpha=float(_get(hf, "swiglu_alpha", 1.702)),
                             limit=float(hf.swiglu_limit), bias=True))


_READERS = {"qwen3_moe": _qwen3, "deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe,
            "gpt_oss": _gpt_oss}


# ---------------------------------------------------------------------------------------------
# MoEConfig -> transformers config


def to_hf_config(cfg: MoEConfig) -> Any:
    """The transformers config of the same model, of `cfg.family`'s class. A config using a
    feature that family's transformers model cannot express is an error naming it."""
    problems = _unrepresentable(cfg)
    if problems:
        raise ValueError(f"{BY_NAME[cfg.family].config_class} cannot express this config: "
                         + "; ".join(problems))
    fam = BY_NAME[cfg.family]
    cls = getattr(_transformers(), fam.config_class)
    return cls(**_WRITERS[cfg.family](cfg), architectures=[fam.architecture])


def _rope_parameters(cfg: MoEConfig) -> dict[str, Any]:
    r = cfg.rope
    out: dict[str, Any] = {"rope_type": r.kind, "rope_theta": cfg.rope_theta}
    if r.partial_factor != 1.0:
        out["partial_rotary_factor"] = r.partial_factor
    if r.kind == "yarn":
        out.update(factor=r.factor, original_max_position_embeddings=r.original_max_position,
                   beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        for key, v in (("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim),
                       ("attention_factor", r.attention_factor)):
            if v is not None:
                out[key] = v
    return out


def _unrepresentable(cfg: MoEConfig) -> list[str]:
    a, r, x = cfg.attention, cfg.router, cfg.experts
    out = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.append(what)

    gqa_like = cfg.family in ("qwen3_moe", "glm4_moe", "gpt_oss")
    need(a.kind == ("gqa" if gqa_like else "mla"), f"attention kind {a.kind!r}")
    need(not cfg.rope.interleaved or cfg.family == "deepseek_v3", "interleaved rotary pairs")
    need(cfg.rope.partial_factor == 1.0 or cfg.family == "glm4_moe", "partial rotary")
    if cfg.family == "qwen3_moe":
        need(a.qk_norm, "no q/k norm")
        need(a.qkv_bias == a.o_bias, "q/k/v bias without the output bias")
        need(not a.sinks and not a.layer_types, "attention sinks / sliding windows")
        need(r.kind == "softmax" and not r.bias, f"router {r.kind!r}")
        need(x == ExpertConfig(), "expert activation / biases")
        need(not cfg.shared_expert_ffn, "a shared expert (Qwen3-MoE has none)")
        need(not cfg.first_k_dense, "first_k_dense")
    elif cfg.family in ("deepseek_v3", "glm4_moe"):
        need(r.kind == "sigmoid", f"router {r.kind!r}")
        need(x == ExpertConfig(), "expert activation / biases")
        need(cfg.shared_expert_ffn % cfg.expert_ffn == 0,
             "a shared expert FFN that is not n_shared_experts x expert_ffn")
        need(not cfg.shared_expert_gate, "a shared expert gate")
        need(not cfg.mlp_only_layers and cfg.decoder_sparse_step == 1,
             "dense layers other than the first k")
        if cfg.family == "glm4_moe":
            need(not a.o_bias and not a.sinks and not a.layer_types, "output bias / sinks / windows")
        else:
            need(a.qkv_bias == a.o_bias, "MLA input biases without the output bias")
    else:  # gpt_oss
        need(not a.qk_norm, "q/k norm")
        need(a.qkv_bias == a.o_bias, "q/k/v bias without the output bias")
        need(a.sinks, "no attention sinks")
        need(r.kind == "topk_softmax" and r.bias, f"router {r.kind!r} / without bias")
        need(x.activation == "clamped_swiglu" and x.bias, "expert activation / biases")
        need(not cfg.shared_expert_ffn, "a shared expert")
        need(all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)), "dense layers")
    return out


def _qwen3_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_ffn or cfg.expert_ffn, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "moe_intermediate_size": cfg.expert_ffn, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob,
        "rope_parameters": _rope_parameters(cfg), "rms_norm_eps": cfg.rms_eps,
        "router_aux_loss_coef": cfg.aux_loss_coef, "max_position_embeddings": cfg.max_seq_len,
        "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "hidden_act": "silu", "attention_bias": cfg.attention.qkv_bias, "use_sliding_window": False}


def _sigmoid_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_ffn or cfg.expert_ffn, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "moe_intermediate_size": cfg.expert_ffn,
        "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.shared_expert_ffn // cfg.expert_ffn,
        "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.router.routed_scaling_factor,
        "n_group": cfg.router.n_group, "topk_group": cfg.router.topk_group,
        "first_k_dense_replace": cfg.first_k_dense, "rope_parameters": _rope_parameters(cfg),
        "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "hidden_act": "silu", "attention_bias": cfg.attention.qkv_bias,
        "num_nextn_predict_layers": cfg.mtp_layers}


def _deepseek_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    a = cfg.attention
    return dict(_sigmoid_kwargs(cfg), num_key_value_heads=cfg.num_heads,
                q_lora_rank=a.q_lora_rank or None, kv_lora_rank=a.kv_lora_rank,
                qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                v_head_dim=a.v_head_dim, rope_interleave=cfg.rope.interleaved)


def _glm_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    kw = dict(_sigmoid_kwargs(cfg), num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              use_qk_norm=cfg.attention.qk_norm)
    # Glm4MoeConfig defaults partial_rotary_factor to 0.5 when the kwarg is absent
    kw["partial_rotary_factor"] = cfg.rope.partial_factor
    return kw


def _gpt_oss_kwargs(cfg: MoEConfig) -> dict[str, Any]:
    a = cfg.attention
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.expert_ffn,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.top_k,
        "sliding_window": a.sliding_window or None,
        "layer_types": list(a.layer_types) or ["full_attention"] * cfg.num_layers,
        "rope_parameters": _rope_parameters(cfg), "rms_norm_eps": cfg.rms_eps,
        "router_aux_loss_coef": cfg.aux_loss_coef, "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "hidden_act": "silu", "attention_bias": a.qkv_bias, "swiglu_alpha": cfg.experts.alpha,
        "swiglu_limit": cfg.experts.limit}


_WRITERS = {"qwen3_moe": _qwen3_kwargs, "deepseek_v3": _deepseek_kwargs,
            "glm4_moe": _glm_kwargs, "gpt_oss": _gpt_oss_kwargs}
