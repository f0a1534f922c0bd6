"""The model built from a checkpoint's own config.json: real Qwen3-MoE configs map field by
field (no weights allocated), other architectures are refused by name, and a model built from a
transformers-written checkpoint gives transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

from workbench.arch import config_from_dict
from workbench.model import ModelConfigError, MoEForCausalLM, from_checkpoint

# The config.json files of the released checkpoints (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B on
# the Hugging Face hub, written by transformers 4.51), copied verbatim.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_235B_A22B = {
    **QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
    "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94,
}
# (hidden, layers, heads, kv heads, head_dim, expert FFN, experts, top-k, vocab): public facts.
SHAPES = {"30b": (QWEN3_30B_A3B, (2048, 48, 32, 4, 128, 768, 128, 8, 151936)),
          "235b": (QWEN3_235B_A22B, (4096, 94, 64, 4, 128, 1536, 128, 8, 151936))}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_released_qwen3_moe_configs_map(tmp_path, name):
    raw, shape = SHAPES[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = from_checkpoint(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.expert_ffn, cfg.num_experts, cfg.top_k, cfg.vocab_size) == shape
    assert cfg.rope_theta == 1e6 and cfg.rms_eps == 1e-6 and cfg.norm_topk_prob is True
    assert cfg.max_seq_len == 40960 and not cfg.tie_embeddings and cfg.shared_expert_ffn == 0
    assert all(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    # The same dict through transformers' own config class maps to the same model.
    from transformers import Qwen3MoeConfig

    from workbench.model import from_hf_config

    assert from_hf_config(Qwen3MoeConfig(**raw)) == cfg
    # Built on the meta device: the architecture's parameter count, nothing allocated.
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    expected = {"30b": 30.5e9, "235b": 235.1e9}[name]  # the model cards' totals
    assert abs(total - expected) / expected < 0.01


def test_absent_fields_take_transformers_defaults():
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("norm_topk_prob", "rope_theta")}
    from transformers import Qwen3MoeConfig

    from workbench.model import from_hf_config

    assert config_from_dict(raw) == from_hf_config(Qwen3MoeConfig(**raw))


@pytest.mark.parametrize("raw, named", [
    ({**QWEN3_30B_A3B, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
     "MixtralForCausalLM"),
    ({"model_type": "llama", "vocab_size": 8}, "model_type='llama'"),
    ({**QWEN3_30B_A3B, "architectures": ["DeepseekV3ForCausalLM"]}, "model_type 'qwen3_moe'"),
    ({**QWEN3_30B_A3B, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "dynamic"),
    ({**QWEN3_30B_A3B, "hidden_act": "gelu"}, "hidden_act"),
    ({**QWEN3_30B_A3B, "hidden_size": "2048"}, "hidden_size"),
])
def test_unsupported_architecture_is_named(tmp_path, raw, named):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=named) as e:
        from_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


def test_missing_config_and_fields_are_named(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json: not found"):
        from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}))
    with pytest.raises(ModelConfigError, match=r"missing field\(s\) \['num_experts'\]"):
        from_checkpoint(tmp_path)


def test_model_from_transformers_checkpoint_matches_transformers_logits(tmp_path):
    """A tiny Qwen3MoeForCausalLM written by transformers (vocab 512): our model is built from
    its config.json alone and filled through the trainer's --init reader (DCP, per-expert keys).
    The transformers side is loaded back from the same folder, in fp32.

    Tolerance: both sides run in fp32 with the same op order except the expert GEMMs (ours
    batched per expert group, transformers one Linear per expert) and attention (SDPA vs eager
    softmax), so results differ only by fp32 summation order, ~1e-7 relative per op; after 2
    layers logits of magnitude ~1 agree to well under 1e-5, while any mapping
    error (a swapped projection, a wrong norm or router setting) moves them by >1e-2."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from workbench.train.distributed import DistInfo
    from workbench.train.init import load_init

    hf_cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                            architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial norms and a sharp router, so mapping errors show
        for n, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if n.endswith("norm.weight") else
                    (0.5 if "mlp.gate." in n else 0.08) * noise)
    # Stored in BF16 like the released checkpoints (the --init reader serves BF16 views);
    # both sides then compute in fp32 from the same BF16 values.
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    cfg = from_checkpoint(tmp_path)
    assert cfg.vocab_size == 512 and cfg.num_experts == 8 and cfg.norm_topk_prob
    ours = MoEForCausalLM(cfg, device="meta")
    ours.to_empty(device="cpu")
    ours.model.rotary_emb.reset_inv_freq()
    load_init(tmp_path, ours, DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"),
                                       group=None, owns_group=False))
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = hf(input_ids=ids).logits, ours.eval()(ids).logits
    assert ref.abs().mean() > 0.1  # not a degenerate near-zero output
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
