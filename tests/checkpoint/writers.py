"""Small checkpoint writers for the checkpoint tests (every layout and naming we read).

Packing goes through `workbench.formats.quantize` (MX / NVFP4), compressed-tensors' own
`pack_to_int32` (INT4) and torch's float8 casts (FP8 block); files are written by safetensors.
These are *our* writers: the third-party writers live in oracles.py (another helper's file).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from workbench.formats import quantize


def gen(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.05).to(dtype)


def save_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 1,
                 config: dict | None = None, extra_files: dict[str, dict] | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(folder / "model.safetensors"))
    else:
        wmap = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n].contiguous() for n in names[i::shards]}
            save_file(part, str(folder / fname))
            wmap.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": wmap}))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "test"}))
    for fname, doc in (extra_files or {}).items():
        (folder / fname).write_text(json.dumps(doc))
    return folder


def qwen_moe_names(layers=2, experts=4, dense_layer0=False, shared=False,
                   naming="qwen", H=64, F=32) -> dict[str, tuple[int, int]]:
    """Linear weights of a tiny MoE: name -> [out, in]."""
    out = {}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for proj, shape in (("q_proj", (H, H)), ("k_proj", (H, H)), ("v_proj", (H, H)),
                            ("o_proj", (H, H))):
            out[f"{p}.self_attn.{proj}.weight"] = shape
        if dense_layer0 and layer == 0:
            for proj, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
                out[f"{p}.mlp.{proj}.weight"] = shape
            continue
        blk = "block_sparse_moe" if naming == "kimi" else "mlp"
        names = {"qwen": ("gate_proj", "up_proj", "down_proj"), "kimi": ("w1", "w3", "w2")}[naming]
        out[f"{p}.{blk}.gate.weight"] = (experts, H)
        for e in range(experts):
            for proj, shape in zip(names, ((F, H), (F, H), (H, F))):
                out[f"{p}.{blk}.experts.{e}.{proj}.weight"] = shape
        if shared:
            for proj, shape in zip(names, ((F, H), (F, H), (H, F))):
                out[f"{p}.{blk}.shared_experts.{proj}.weight"] = shape
    return out


def dense_extras(layers=2, H=64, V=96) -> dict[str, torch.Tensor]:
    t = {"model.embed_tokens.weight": gen((V, H), 1), "lm_head.weight": gen((V, H), 2),
         "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    for layer in range(layers):
        t[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    return t


CT_SCHEMES = {
    "mxfp4": ("mxfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "group",
                                       "group_size": 32, "symmetric": True, "scale_dtype": "uint8"}),
    "nvfp4": ("nvfp4-pack-quantized", {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                       "group_size": 16, "symmetric": True}),
    "mxfp8": ("mxfp8-quantized", {"num_bits": 8, "type": "float", "strategy": "group",
                                  "group_size": 32, "symmetric": True, "scale_dtype": "uint8"}),
    "int4": ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group",
                                "group_size": 32, "symmetric": True}),
}


def ct_quantize(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stored companions of one weight in compressed-tensors naming (without the prefix)."""
    if fmt == "mxfp4":
        q = quantize(w, "mxfp4")
        return {"weight_packed": q.data, "weight_scale": q.scale}
    if fmt == "nvfp4":
        q = quantize(w, "nvfp4")
        return {"weight_packed": q.data, "weight_scale": q.scale,
                "weight_global_scale": (1.0 / q.global_scale.float()).reshape(1)}
    if fmt == "mxfp8":
        q = quantize(w, "mxfp8_e4m3")
        return {"weight": q.data, "weight_scale": q.scale}
    if fmt == "int4":
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        wf = w.float().unflatten(-1, (-1, 32))
        s = (wf.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
        qi = torch.round(wf / s.float().unsqueeze(-1)).clamp(-8, 7).flatten(-2).to(torch.int8)
        return {"weight_packed": pack_to_int32(qi, 4), "weight_scale": s,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    raise ValueError(fmt)


def write_ct(folder, fmt="mxfp4", naming="qwen", shards=2, ignore=None, targets=("Linear",),
             layers=2, experts=4, shared=False, dense_layer0=False, text_config=False) -> Path:
    """compressed-tensors checkpoint; attention + experts quantized, router/lm_head ignored."""
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"] if ignore is None else ignore
    from workbench.scope import QuantScope

    ct_fmt, wargs = CT_SCHEMES[fmt]
    qc = {"quant_method": "compressed-tensors", "format": ct_fmt, "quantization_status":
          "compressed", "ignore": list(ignore),
          "config_groups": {"group_0": {"targets": list(targets), "weights": wargs,
                                        "input_activations": None}}}
    shapes = qwen_moe_names(layers, experts, dense_layer0, shared, naming)
    scope = QuantScope.from_patterns(list(targets), list(ignore), fmt, names=shapes)
    tensors = dense_extras(layers)
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        w = gen(shape, seed=100 + i)
        if scope.is_quantized(name):
            base = name[: -len("weight")]
            tensors.update({base + k: v for k, v in ct_quantize(fmt, w).items()})
        else:
            tensors[name] = w
    cfg = {"model_type": "qwen3_moe"}
    if text_config:
        cfg["text_config"] = {"quantization_config": qc}
    else:
        cfg["quantization_config"] = qc
    return save_sharded(folder, tensors, shards, cfg)


def write_gpt_oss(folder, layers=2, E=4, F=32, H=64, shards=2) -> Path:
    t = dense_extras(layers, H)
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp"
        for proj, (N, K) in (("gate_up_proj", (2 * F, H)), ("down_proj", (H, F))):
            q = quantize(gen((E, N, K), seed=10 * layer + len(proj)), "mxfp4")
            t[f"{p}.experts.{proj}_blocks"] = q.data.reshape(E, N, K // 32, 16)
            t[f"{p}.experts.{proj}_scales"] = q.scale
            t[f"{p}.experts.{proj}_bias"] = gen((E, N), seed=7)
        t[f"{p}.router.weight"] = gen((E, H), seed=8)
        t[f"{p}.router.bias"] = gen((E,), seed=9)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"model.layers.{layer}.self_attn.{proj}.weight"] = gen((H, H), seed=11)
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                              "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
    return save_sharded(folder, t, shards, {"model_type": "gpt_oss", "quantization_config": qc})


def write_modelopt(folder, algo="NVFP4", layers=2, experts=4, shards=2, in_config=True) -> Path:
    shapes = qwen_moe_names(layers, experts)
    t = dense_extras(layers)
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        w = gen(shape, seed=200 + i)
        base = name[: -len("weight")]
        if name.endswith("mlp.gate.weight"):
            t[name] = w
            continue
        if algo == "NVFP4":
            q = quantize(w, "nvfp4")
            t.update({base + "weight": q.data, base + "weight_scale": q.scale,
                      base + "weight_scale_2": q.global_scale.float().reshape(()),
                      base + "input_scale": torch.tensor(1.0)})
        elif algo == "MXFP4":
            q = quantize(w, "mxfp4")
            t.update({base + "weight": q.data, base + "weight_scale": q.scale})
        else:
            q = quantize(w, "mxfp8_e4m3")
            t.update({base + "weight": q.data, base + "weight_scale": q.scale})
    q = {"quant_algo": algo, "group_size": 16 if algo == "NVFP4" else 32,
         "exclude_modules": ["lm_head", "*.mlp.gate"]}
    if in_config:
        return save_sharded(folder, t, shards, {"model_type": "qwen3_moe", "quantization_config":
                                                {"quant_method": "modelopt", **q}})
    return save_sharded(folder, t, shards, {"model_type": "qwen3_moe"},
                        {"hf_quant_config.json": {"producer": {"name": "modelopt"},
                                                  "quantization": q}})


def write_fp8_block(folder, layers=2, experts=4, shards=2, H=160, F=200) -> Path:
    """DeepSeek-V3 style: fp8 weight + fp32 weight_scale_inv [ceil(out/128), ceil(in/128)]."""
    shapes = qwen_moe_names(layers, experts, H=H, F=F)
    t = dense_extras(layers, H)
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        w = gen(shape, seed=300 + i, dtype=torch.float32)
        if name.endswith("mlp.gate.weight"):
            t[name] = w.to(torch.bfloat16)
            continue
        R, C = shape
        s = torch.rand(math.ceil(R / 128), math.ceil(C / 128),
                       generator=torch.Generator().manual_seed(i)) * 1e-3 + 1e-4
        sx = s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]
        t[name] = (w / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = s
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [128, 128]}
    return save_sharded(folder, t, shards, {"model_type": "deepseek_v3", "quantization_config": qc})


def write_te(folder, layers=2, ep=2, local=2, H=64, F=32, style="te") -> Path:
    """Megatron / TE per-rank files `model-ep{r}.safetensors` with local expert weights."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fc1, fc2 = ("linear_fc1", "linear_fc2") if style == "te" else ("fc1", "fc2")
    for r in range(ep):
        t = {"decoder.final_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)}
        for layer in range(layers):
            p = f"decoder.layers.{layer}.mlp.experts"
            for k in range(local):
                g = r * local + k
                t[f"{p}.{fc1}.weight{k}"] = gen((2 * F, H), seed=1000 * layer + g)
                t[f"{p}.{fc2}.weight{k}"] = gen((H, F), seed=5000 + 1000 * layer + g)
        save_file(t, str(folder / f"model-ep{r}.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "megatron"}))
    return folder
