"""Builds transformers' Qwen3-MoE models with every parameter randomised (the oracle side)."""

from __future__ import annotations

import torch


def random_hf_model(cfg, seed: int = 0):
    """transformers `Qwen3MoeForCausalLM` for our config, fp32, eager attention, all parameters
    random (norm weights around 1, so a mis-mapped norm cannot hide behind all-ones)."""
    from transformers import Qwen3MoeForCausalLM

    from workbench.model import to_hf_config

    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif "mlp.gate." in name:
                p.copy_(0.5 * noise)  # sharp routing, so a routing bug changes the logits
            else:
                p.copy_(0.08 * noise)
    return model
