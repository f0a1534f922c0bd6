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


def write_mxfp4(path: Path, sd: dict[str, torch.Tensor], encode: str = "mxfp4:even",
                scale_of: dict[str, float] | None = None) -> Path:
    """A compressed-tensors MXFP4 checkpoint (``weight_packed`` + E8M0 ``weight_scale``) of every
    MLP projection in ``sd``; the bytes come from the workbench codec ``encode`` (compressed-
    tensors itself writes EVEN-like bytes). ``scale_of`` multiplies chosen weights first (to put
    their scale bytes at the edges). Other tensors stay BF16."""
    from workbench.formats import quantize

    out = {}
    for name, w in sd.items():
        if name.endswith("_proj.weight"):
            w = (w.float() * (scale_of or {}).get(name, 1.0)).bfloat16()
            q = quantize(w, encode)
            base = name[: -len(".weight")]
            out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = q.data, q.scale
        else:
            out[name] = w
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"))
    group = {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
             "input_activations": None, "output_activations": None,
             "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                         "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}}
    cfg = {"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp\\.gate$"],
        "config_groups": {"group_0": group}}}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# The held-in checkpoints of every layout, each written by its own library
# (tests/checkpoint/oracles.py): name -> (the library module that must import, writer(oracles, path)).
LIBRARY_LAYOUTS = {
    "ct-mxfp4": ("compressed_tensors", lambda o, p: o.write_compressed_tensors(p, "MXFP4A16", seed=1)),
    "ct-nvfp4": ("compressed_tensors", lambda o, p: o.write_compressed_tensors(p, "NVFP4A16", seed=2)),
    "gpt-oss": ("transformers", lambda o, p: o.write_gpt_oss(p, seed=3)),
    "modelopt-nvfp4": ("modelopt.torch.quantization.qtensor", lambda o, p: o.write_modelopt(p, "nvfp4", seed=4)),
    "modelopt-mxfp8": ("modelopt.torch.quantization.qtensor", lambda o, p: o.write_modelopt(p, "mxfp8", seed=5)),
    "modelopt-mxfp4": ("modelopt.torch.quantization.qtensor", lambda o, p: o.write_modelopt(p, "mxfp4", seed=6)),
    "fp8-block": ("torch", lambda o, p: o.write_fp8_block(p, seed=7)),
}
