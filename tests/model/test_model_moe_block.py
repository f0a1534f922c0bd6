"""The MoE block alone: shared expert against transformers' Qwen2-MoE block (which has one), and
the ungated variant against Qwen3-MoE's routed block plus a separate dense MLP."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")

from workbench.model import MoEBlock, hf_to_ours, tiny


def _randomise_(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.5 if name.startswith("gate.") else 0.1
            p.copy_(scale * torch.randn(p.shape, generator=gen))


def _load_block(ours: MoEBlock, hf_sd):
    # The block-level state dict uses the same relative names as inside a full model.
    prefixed = hf_to_ours({f"model.layers.0.mlp.{k}": v for k, v in hf_sd.items()})
    ours.load_state_dict({k.removeprefix("model.layers.0.mlp."): v for k, v in prefixed.items()})


def _compare(ours, ref_fn, ref_params, x):
    x_ref = x.clone().requires_grad_(True)
    x_ours = x.clone().requires_grad_(True)
    y_ref = ref_fn(x_ref)
    y_ours, _ = ours(x_ours)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-5, atol=1e-6)
    upstream = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4))
    (y_ref * upstream).sum().backward()
    (y_ours * upstream).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    ref_grads = hf_to_ours({f"model.layers.0.mlp.{n}": p.grad for n, p in ref_params})
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[f"model.layers.0.mlp.{name}"], rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_gated_shared_expert_matches_qwen2_moe_block():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tiny(shared_expert_ffn=64, shared_expert_gate=True, norm_topk_prob=False)
    hf_cfg = Qwen2MoeConfig(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                            num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_ffn,
                            shared_expert_intermediate_size=cfg.shared_expert_ffn,
                            norm_topk_prob=cfg.norm_topk_prob)
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).float()
    _randomise_(hf, seed=1)
    ours = MoEBlock(cfg)
    _load_block(ours, hf.state_dict())
    x = torch.randn(2, 12, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _compare(ours, hf, list(hf.named_parameters()), x)


def test_ungated_shared_expert_is_routed_block_plus_dense_mlp():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP, Qwen3MoeSparseMoeBlock

    from workbench.model import to_hf_config

    cfg = tiny(shared_expert_ffn=32)
    hf_cfg = to_hf_config(cfg.replace(shared_expert_ffn=0))
    routed = Qwen3MoeSparseMoeBlock(hf_cfg).float()
    shared = Qwen3MoeMLP(hf_cfg, intermediate_size=cfg.shared_expert_ffn).float()
    _randomise_(routed, seed=3)
    _randomise_(shared, seed=4)
    sd = dict(routed.state_dict())
    sd.update({f"shared_expert.{k}": v for k, v in shared.state_dict().items()})
    ours = MoEBlock(cfg)
    _load_block(ours, sd)
    params = list(routed.named_parameters()) + [(f"shared_expert.{n}", p)
                                                for n, p in shared.named_parameters()]
    x = torch.randn(3, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    _compare(ours, lambda t: routed(t) + shared(t), params, x)
