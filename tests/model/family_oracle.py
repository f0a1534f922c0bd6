"""transformers models of every supported family, random and with every feature made to matter
(the oracle side of the family tests), and the checkpoints they write.

Each case is a workbench preset with its features switched on and sized so they bite on a
24-token sequence: q/k norms and norm weights away from 1, sharp routers, nonzero
e_score_correction_bias (they change which experts are picked), attention / router / expert
biases, attention sinks around 1, a sliding window (8) shorter than the sequence, YaRN, and a
SwiGLU clamp (0.6) below the typical gate and up activations.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from workbench.arch import AttentionConfig, ExpertConfig, RopeConfig, RouterConfig
from workbench.formats import quantize
from workbench.model import tiny, tiny_deepseek, tiny_glm, tiny_gpt_oss, to_hf_config

SEQ = 24
CASES = {
    "qwen3_moe": tiny(norm_topk_prob=True),
    "qwen3_moe_yarn_bias": tiny(attention=AttentionConfig(qk_norm=True, qkv_bias=True,
                                                          o_bias=True),
                                rope=RopeConfig(kind="yarn", factor=4.0,
                                                original_max_position=64)),
    "gpt_oss": tiny_gpt_oss(experts=ExpertConfig(activation="clamped_swiglu", alpha=1.702,
                                                 limit=0.6, bias=True)),
    "deepseek_v3": tiny_deepseek(attention=AttentionConfig(
        kind="mla", qk_norm=False, qkv_bias=True, o_bias=True, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)),
    # Kimi K2's variant of the architecture: one expert group, no q LoRA, half-split rotary
    "deepseek_v3_plain_q": tiny_deepseek(
        attention=AttentionConfig(kind="mla", qk_norm=False, q_lora_rank=0, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        rope=RopeConfig(kind="yarn", interleaved=False, factor=4.0, original_max_position=64,
                        beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
        router=RouterConfig(kind="sigmoid", routed_scaling_factor=2.827)),
    "glm4_moe": tiny_glm(),
}


def family_model(cfg, seed: int = 0):
    """transformers' CausalLM of `cfg`'s family, fp32, eager attention, every parameter (and the
    correction-bias buffers) random."""
    from transformers import AutoModelForCausalLM

    hf_cfg = to_hf_config(cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.copy_(0.5 * noise)  # sharp routing, so a routing bug changes the logits
            elif name.endswith("sinks"):
                p.copy_(1.0 + noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


def write(cfg, folder: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save `family_model(cfg)` with transformers' save_pretrained; returns the fp32 model."""
    hf = family_model(cfg, seed)
    hf.to(dtype).save_pretrained(folder)
    return hf.float()


def ids(cfg, batch: int = 2, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def checkpoint_oracles():
    """tests/checkpoint/oracles.py (the third-party writers and decodes), loaded by path: a
    `tests/checkpoint` entry on sys.path would shadow this folder's conftest."""
    path = Path(__file__).resolve().parents[1] / "checkpoint" / "oracles.py"
    spec = importlib.util.spec_from_file_location("_checkpoint_oracles", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                         "model.embed_tokens", "lm_head"]


def write_gpt_oss_mxfp4(cfg, folder, seed=7):
    """The released gpt-oss layout: expert stacks as MXFP4 `_blocks` [E, out, in/32, 16] and
    `_scales` [E, out, in/32] (rows = transformers' output features: gate/up interleaved),
    everything else BF16."""
    hf = family_model(cfg, seed=seed).to(torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous()  # transformers keeps [E, in, out]
        E, N, K = w.shape
        q = quantize(w, "mxfp4")
        tensors[name + "_blocks"] = q.data.reshape(E, N, K // 32, 16)
        tensors[name + "_scales"] = q.scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
