"""Small checkpoints for analysis tests, written with safetensors (plain BF16 tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def moe_weights(layers=2, experts=4, hidden=64, ffn=32, seed=0, shared=True, dense_layer=True):
    """Qwen3-MoE-style names; experts differ in scale and tails so metrics vary by expert."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for L in range(layers):
        p = f"model.layers.{L}.mlp"
        if dense_layer and L == 0:
            for n, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)),
                             ("down_proj", (hidden, ffn))):
                sd[f"{p}.{n}.weight"] = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
            continue
        for e in range(experts):
            tail = 1.0 + e  # heavier tails for later experts
            for n, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)),
                             ("down_proj", (hidden, ffn))):
                w = torch.randn(*shape, generator=g)
                w = w * torch.rand(*shape, generator=g).clamp_min(0.02).pow(-0.25 * tail)
                sd[f"{p}.experts.{e}.{n}.weight"] = (w * 0.02).bfloat16()
        if shared:
            for n, shape in (("gate_proj", (ffn, hidden)), ("up_proj", (ffn, hidden)),
                             ("down_proj", (hidden, ffn))):
                sd[f"{p}.shared_expert.{n}.weight"] = (torch.randn(*shape, generator=g) * 0.02).bfloat16()
        sd[f"{p}.gate.weight"] = (torch.randn(experts, hidden, generator=g) * 0.02).bfloat16()
    sd["model.embed_tokens.weight"] = torch.randn(16, hidden, generator=g).bfloat16()
    return sd


def write_dense(path: Path, sd: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return path
