"""The config.json files of released checkpoints (released_configs.py) map onto the family
blocks field by field, the models they describe have the published parameter counts, and what
the workbench cannot build is refused by name. Expected values are read off those files and the
model cards by hand.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

pytest.importorskip("transformers", reason="transformers parses config.json (pip install 'workbench[data]')")

from family_oracle import CASES, ids, write
from released_configs import DEEPSEEK_V3, GLM_45, GPT_OSS_20B, GPT_OSS_120B, KIMI_K2

from workbench.arch import (
    AttentionConfig,
    ExpertConfig,
    RopeConfig,
    RouterConfig,
    config_from_dict,
    from_checkpoint,
)
from workbench.model import ModelConfigError, MoEForCausalLM, PretrainedError, from_pretrained

MLA_V3 = AttentionConfig(kind="mla", qk_norm=False, q_lora_rank=1536, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
YARN_V3 = RopeConfig(kind="yarn", interleaved=True, factor=40.0, original_max_position=4096,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def test_deepseek_v3_maps_every_block():
    cfg = config_from_dict(DEEPSEEK_V3)
    assert (cfg.family, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size) == ("deepseek_v3", 7168, 61, 128, 128, 192, 129280)
    assert cfg.attention == MLA_V3 and cfg.rope == YARN_V3 and cfg.rope_theta == 10000.0
    assert cfg.router == RouterConfig(kind="sigmoid", n_group=8, topk_group=4,
                                      routed_scaling_factor=2.5)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_ffn, cfg.shared_expert_ffn, cfg.dense_ffn,
            cfg.first_k_dense, cfg.mtp_layers) == (256, 8, 2048, 2048, 18432, 3, 1)
    assert cfg.norm_topk_prob and cfg.experts == ExpertConfig() and cfg.aux_loss_coef == 0
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    assert cfg.max_seq_len == 163840 and cfg.rms_eps == 1e-6 and not cfg.tie_embeddings
    # the MLA softmax scale carries YaRN's mscale(40, 1)^2 = (0.1 ln 40 + 1)^2
    assert cfg.rope.mla_softmax_mscale() == pytest.approx((0.1 * 3.6888794541139363 + 1) ** 2)


def test_kimi_k2_is_the_deepseek_v3_family():
    cfg = config_from_dict(KIMI_K2)
    assert cfg.family == "deepseek_v3" and cfg.attention.kind == "mla"
    assert (cfg.num_heads, cfg.num_experts, cfg.first_k_dense, cfg.vocab_size) == (64, 384, 1, 163840)
    assert cfg.router == RouterConfig(kind="sigmoid", routed_scaling_factor=2.827)
    assert (cfg.rope.factor, cfg.rope.beta_fast, cfg.rope.beta_slow, cfg.rope_theta) == (32.0, 1.0, 1.0, 5e4)
    assert cfg.mtp_layers == 0


def test_glm_45_maps_every_block():
    cfg = config_from_dict(GLM_45)
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_dim) == (
        "glm4_moe", 96, 8, 128, 64)
    assert cfg.attention == AttentionConfig(qk_norm=True, qkv_bias=True, o_bias=False)
    assert cfg.rope == RopeConfig(partial_factor=0.5) and cfg.rope_theta == 1e6
    assert cfg.router == RouterConfig(kind="sigmoid", routed_scaling_factor=2.5)
    assert (cfg.num_experts, cfg.expert_ffn, cfg.shared_expert_ffn, cfg.first_k_dense,
            cfg.mtp_layers, cfg.rms_eps) == (160, 1536, 1536, 3, 1, 1e-5)


def test_gpt_oss_maps_every_block():
    cfg = config_from_dict(GPT_OSS_120B)
    assert (cfg.family, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.expert_ffn, cfg.num_experts, cfg.top_k) == ("gpt_oss", 2880, 64, 8, 64, 2880, 128, 4)
    assert cfg.attention == AttentionConfig(
        qk_norm=False, qkv_bias=True, o_bias=True, sinks=True, sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * 18)
    assert [cfg.attention.window(i) for i in range(3)] == [128, 0, 128]
    assert cfg.rope == RopeConfig(kind="yarn", factor=32.0, original_max_position=4096,
                                  truncate=False) and cfg.rope_theta == 150000.0
    assert cfg.router == RouterConfig(kind="topk_softmax", bias=True)
    assert cfg.experts == ExpertConfig(activation="clamped_swiglu", alpha=1.702, limit=7.0,
                                       bias=True)
    assert cfg.aux_loss_coef == 0.9 and cfg.rms_eps == 1e-5 and cfg.max_seq_len == 131072
    assert all(cfg.is_moe_layer(i) for i in range(36))


# Published totals: DeepSeek-V3 technical report (arXiv 2412.19437): 671B total parameters, the
# 14B of the multi-token-prediction module not included (the model card: 685B = 671B + 14B);
# gpt-oss model card (arXiv 2508.10925, table 1): 116.83B and 20.91B.
@pytest.mark.parametrize("raw, published", [(DEEPSEEK_V3, 671.0e9), (GPT_OSS_120B, 116.83e9),
                                            (GPT_OSS_20B, 20.91e9)],
                         ids=["deepseek_v3", "gpt_oss_120b", "gpt_oss_20b"])
def test_model_built_from_released_config_has_the_published_size(raw, published):
    cfg = config_from_dict(raw)
    model = MoEForCausalLM(cfg, device="meta")  # shapes only, nothing allocated
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - published) / published < 5e-4, total


@pytest.mark.parametrize("raw, named", [
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, r"missing field\(s\) \['kv_lora_rank'\]"),
    ({k: v for k, v in GPT_OSS_120B.items() if k != "num_local_experts"}, "num_local_experts"),
    ({**DEEPSEEK_V3, "scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({**DEEPSEEK_V3, "topk_method": "group_limited_greedy"}, "topk_method"),
    ({**DEEPSEEK_V3, "model_type": "deepseek_v2"}, "model_type 'deepseek_v2'"),
    ({**GLM_45, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({**GPT_OSS_120B, "layer_types": ["sliding_attention"] * 35}, r"layer_types.*\(35\)"),
    ({**GPT_OSS_120B, "sliding_window": None}, "sliding_window is 0"),
    ({**DEEPSEEK_V3, "n_group": 3}, r"topk_group \(4\) exceeds n_group \(3\)"),
    ({**DEEPSEEK_V3, "n_group": 5}, "do not split into n_group=5"),
])
def test_what_cannot_be_built_is_named(tmp_path, raw, named):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=named) as e:
        from_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_multi_token_prediction_layer_is_skipped_with_one_log_line(tmp_path, caplog):
    """DeepSeek-V3 stores its MTP module as `model.layers.61.*`; the model has 61 layers. A
    checkpoint with such a layer loads (one INFO line naming it), one with a layer beyond the
    MTP count is refused."""
    from safetensors.torch import load_file, save_file

    cfg = CASES["deepseek_v3"]
    folder = tmp_path / "ds"
    hf = write(cfg, folder, seed=1)
    tensors = load_file(folder / "model.safetensors")
    n = cfg.num_layers
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone()
             for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="workbench.model.hf"):
        ours = from_pretrained(folder)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and f"model.layers.{n}.*" in lines[0]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids(cfg)).logits, hf(input_ids=ids(cfg)).logits,
                                   rtol=2e-5, atol=2e-5)
    config["num_nextn_predict_layers"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match=rf"model\.layers\.{n}\."):
        from_pretrained(folder)


def test_config_larger_than_its_tensors_fails_before_allocating(tmp_path):
    """A config.json that describes a 2^33-row embedding (2 TiB of fp32) over a tiny checkpoint is
    refused from the index, before any parameter is allocated."""
    cfg = CASES["glm4_moe"]
    folder = tmp_path / "glm"
    write(cfg, folder, seed=1)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 2**33
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(PretrainedError, match=r"model\.embed_tokens\.weight.*8589934592"):
        from_pretrained(folder)
