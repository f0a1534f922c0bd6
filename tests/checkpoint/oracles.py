"""Checkpoints written by third-party libraries, with those libraries' own decoded values.

No byte of a quantized tensor here is produced by workbench code. Each writer returns an
`Oracle`: the folder, the layout it claims, and the BF16 value of every routed expert as the
producing (or a consuming) library decodes it, keyed by (layer, expert, proj) in the Linear
convention [out, in]. Tests compare `workbench.checkpoint` against these values bit for bit.

Writers:
- compressed-tensors MXFP4 / NVFP4: a tiny transformers Qwen3-MoE, experts unfused into
  nn.Linear (transformers 5 fuses them into 3-D parameters, which compressed-tensors skips),
  scales from compressed-tensors' own `generate_gparam` / `calculate_qparams` (the same calls
  llm-compressor's min-max observer makes), `ModelCompressor.compress_model`, `save_pretrained`.
  Oracle: compressed-tensors' model-free `CompressedTensorsDequantizer` on the saved files.
- gpt-oss (`quant_method: mxfp4`): `_blocks`/`_scales` bytes written by hand (transformers cannot
  write them without Triton); oracle: transformers' `Mxfp4Config(dequantize=True)` load.
- ModelOpt NVFP4 / MXFP4 / MXFP8: ModelOpt's `*QTensor.quantize` per expert, config from ModelOpt's
  own `process_layer_quant_config` / `convert_hf_quant_config_format`; oracle: its `dequantize`.
- DeepSeek FP8 128x128 blocks: an independent fp32 computation (scale = amax/448, torch fp8 cast).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

PROJS = ("gate", "up", "down")
Key = tuple[int, int, str]  # (layer, expert, proj)


@dataclass
class Oracle:
    path: Path
    layout: str
    num_layers: int
    num_experts: int
    experts: dict[Key, torch.Tensor]  # oracle BF16 [out, in]
    quantized: set[str] = field(default_factory=set)  # logical weight names stored packed
    dense: set[str] = field(default_factory=set)  # logical weight names stored as plain BF16
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------
# Weights with heavy tails and edge cases: outliers, an all-zero block, -0.0 and tiny
# negatives, exact FP4 ties and values just above a binade edge.
# ----------------------------------------------------------------------------------------
def heavy_tailed(shape: tuple[int, int], gen: torch.Generator, block: int = 32) -> torch.Tensor:
    out, inp = shape
    u = torch.rand(out, inp, generator=gen, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    # Student-t with 2 degrees of freedom by inversion: heavy tails, finite median.
    w = ((2 * u - 1) / torch.sqrt(2 * u * (1 - u))).float() * 0.02
    # A few large outliers (x40 the typical scale).
    idx = torch.randint(0, out * inp, (max(1, out * inp // 500),), generator=gen)
    w.view(-1)[idx] *= 40.0
    if out >= 4 and inp >= block:
        w[0, :block] = 0.0  # an all-zero block
        w[1, :block] = -0.0
        w[1, 1:4] = torch.tensor([-1e-30, -3e-8, 1e-30])  # sign of tiny values
        # exact E2M1 ties and binade edges, relative to a block amax of 6 * 2^-4
        w[2, :block] = torch.tensor(
            [0.375, 0.25 * 0.0625, 0.75 * 0.0625, 1.25 * 0.0625, 1.75 * 0.0625, 2.5 * 0.0625,
             3.5 * 0.0625, 5.0 * 0.0625, -0.75 * 0.0625, -2.5 * 0.0625] + [0.01] * (block - 10)
        )
        w[3, :block] = 7.0 * 0.0625 * torch.linspace(-1, 1, block)  # amax in (6, 8) * 2^k
    return w.to(torch.bfloat16)


# ----------------------------------------------------------------------------------------
# compressed-tensors
# ----------------------------------------------------------------------------------------
def _tiny_qwen3_moe(num_experts: int = 4):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=128, hidden_size=96, intermediate_size=96, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
        num_experts=num_experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def _unfuse_experts(model, gen: torch.Generator) -> None:
    """Replace transformers 5's fused 3-D experts by per-expert nn.Linear (HF per-expert names)."""
    from torch import nn

    class Expert(nn.Module):
        def __init__(self, hidden: int, inter: int):
            super().__init__()
            self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
            self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=torch.bfloat16)
            self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=torch.bfloat16)

    for layer in model.model.layers:
        fused = layer.mlp.experts
        experts = nn.ModuleList(
            Expert(fused.hidden_dim, fused.intermediate_dim) for _ in range(fused.num_experts)
        )
        with torch.no_grad():
            for ex in experts:
                for lin in (ex.gate_proj, ex.up_proj, ex.down_proj):
                    lin.weight.copy_(heavy_tailed(tuple(lin.weight.shape), gen))
        layer.mlp.experts = experts


def write_compressed_tensors(path: Path, scheme_name: str, seed: int = 0,
                             num_experts: int = 4, max_shard_size: str | None = None) -> Oracle:
    """scheme_name: "MXFP4A16" or "NVFP4A16" (compressed-tensors preset schemes).

    `max_shard_size` (e.g. "40KB") makes transformers write several shards + an index."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    gen = torch.Generator().manual_seed(seed)
    model = _tiny_qwen3_moe(num_experts)
    _unfuse_experts(model, gen)
    with torch.no_grad():  # heavy tails in attention too, so dense-layer decode is exercised
        for layer in model.model.layers:
            q = layer.self_attn.q_proj.weight
            q.copy_(heavy_tailed(tuple(q.shape), gen))

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    qcfg = QuantizationConfig(config_groups={"group_0": scheme},
                              ignore=["lm_head", "re:.*mlp\\.gate$"])
    apply_quantization_config(model, qcfg)
    with torch.no_grad():
        for _, module in model.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            gscale = None
            if hasattr(module, "weight_global_scale"):  # NVFP4 (TENSOR_GROUP)
                gscale = generate_gparam(w.amin(), w.amax())
                module.weight_global_scale.copy_(gscale)
            grouped = w.unflatten(-1, (-1, args.group_size))
            scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args,
                                         global_scale=gscale)
            module.weight_scale.copy_(scale)

    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    compressor.update_config(path)
    return _ct_oracle(Path(path), num_layers=2, num_experts=num_experts)


def _ct_oracle(path: Path, num_layers: int, num_experts: int) -> Oracle:
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file

    stored = {}
    for shard in sorted(path.glob("*.safetensors")):
        stored.update(load_file(shard))
    quantized = {k.removesuffix("_packed") for k in stored if k.endswith(".weight_packed")}
    dense = {k for k in stored if k.endswith(".weight") and stored[k].dtype == torch.bfloat16}
    decoded = CompressedTensorsDequantizer(path, dtype=torch.bfloat16).process(dict(stored))
    experts = {
        (layer, e, p): decoded[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"]
        for layer in range(num_layers) for e in range(num_experts) for p in PROJS
    }
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["format"]
    return Oracle(path, "compressed-tensors", num_layers, num_experts, experts, quantized, dense,
                  meta={"format": fmt, "decoded": decoded})


# ----------------------------------------------------------------------------------------
# gpt-oss: bytes by hand, transformers decodes
# ----------------------------------------------------------------------------------------
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                         "model.embed_tokens", "lm_head"]


def write_gpt_oss(path: Path, seed: int = 0) -> Oracle:
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = GptOssConfig(
        vocab_size=128, hidden_size=96, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name in list(tensors):
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        n_exp, k_in, n_out = tensors.pop(name).shape  # transformers keeps [E, in, out]
        tensors[name + "_blocks"] = torch.randint(
            0, 256, (n_exp, n_out, k_in // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(112, 132, (n_exp, n_out, k_in // 32), dtype=torch.uint8,
                               generator=gen)
        scales[0, 0, 0], scales[0, 1, 0], scales[-1, -1, -1] = 0, 1, 252  # E8M0 range edges
        tensors[name + "_scales"] = scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg_dict = cfg.to_dict()
    cfg_dict["architectures"] = ["GptOssForCausalLM"]
    cfg_dict["quantization_config"] = {"quant_method": "mxfp4",
                                       "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2))

    loaded = GptOssForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    experts = {}
    for layer in range(cfg.num_hidden_layers):
        mod = loaded.model.layers[layer].mlp.experts
        for e in range(cfg.num_local_experts):
            gate_up = mod.gate_up_proj.data[e].t()  # [2I, in], gate/up rows interleaved
            experts[(layer, e, "gate")] = gate_up[0::2].contiguous()
            experts[(layer, e, "up")] = gate_up[1::2].contiguous()
            experts[(layer, e, "down")] = mod.down_proj.data[e].t().contiguous()
    quantized = {k.removesuffix("_blocks") for k in tensors if k.endswith("_blocks")}
    dense = {k for k in tensors if k.endswith(".weight")}
    return Oracle(path, "gpt-oss", cfg.num_hidden_layers, cfg.num_local_experts, experts,
                  quantized, dense, meta={"loaded": loaded})


# ----------------------------------------------------------------------------------------
# ModelOpt HF layout
# ----------------------------------------------------------------------------------------
MODELOPT_ALGOS = ("nvfp4", "mxfp4", "mxfp8")


def write_modelopt(path: Path, algo: str, seed: int = 0) -> Oracle:
    """algo: "nvfp4" | "mxfp4" | "mxfp8" (ModelOpt's QUANTIZATION_* names)."""
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.model_config import QUANTIZATION_NONE
    from modelopt.torch.export.quant_utils import process_layer_quant_config
    from modelopt.torch.quantization.qtensor import MXFP4QTensor, MXFP8QTensor, NVFP4QTensor
    from safetensors.torch import save_file

    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"algo must be one of {MODELOPT_ALGOS}, got {algo!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = _tiny_qwen3_moe()
    hidden, inter, n_layers, n_exp = 96, 64, 2, 4
    block = 16 if algo == "nvfp4" else 32
    gen = torch.Generator().manual_seed(seed)
    dense = {k: v.contiguous() for k, v in model.state_dict().items() if "mlp.experts" not in k}
    tensors: dict[str, torch.Tensor] = dict(dense)
    experts: dict[Key, torch.Tensor] = {}
    layer_cfg: dict[str, object] = {"lm_head.quantization": QUANTIZATION_NONE}
    for layer in range(n_layers):
        # experts-only recipe: router, attention (and lm_head below) keep BF16, and ModelOpt's
        # own summariser turns them into exclude_modules patterns
        layer_cfg[f"model.layers.{layer}.mlp.gate.quantization"] = QUANTIZATION_NONE
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            layer_cfg[f"model.layers.{layer}.self_attn.{proj}.quantization"] = QUANTIZATION_NONE
        for e in range(n_exp):
            for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                ("down", (hidden, inter))):
                mod = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                w = heavy_tailed(shape, gen)
                if algo == "nvfp4":
                    qt, scale, scale_2 = NVFP4QTensor.quantize(w, block)
                    tensors[f"{mod}.weight_scale"] = scale
                    tensors[f"{mod}.weight_scale_2"] = scale_2.reshape(())
                    # W4A4 export carries a static activation scale: amax / (6 * 448).
                    tensors[f"{mod}.input_scale"] = torch.tensor(3.5 / 2688.0)
                    ref = qt.dequantize(dtype=torch.bfloat16, scale=scale, double_scale=scale_2,
                                        block_sizes={-1: block})
                elif algo == "mxfp4":
                    qt, scale = MXFP4QTensor.quantize(w, block_size=block)
                    scale = scale.reshape(*shape[:-1], -1)  # as get_weight_scaling_factor does
                    tensors[f"{mod}.weight_scale"] = scale
                    ref = qt.dequantize(dtype=torch.bfloat16, scale=scale, block_sizes={-1: block})
                else:
                    qt, scale = MXFP8QTensor.quantize(w)
                    tensors[f"{mod}.weight_scale"] = scale
                    ref = qt.dequantize(dtype=torch.bfloat16, scale=scale)
                tensors[f"{mod}.weight"] = qt._quantized_data.contiguous()
                experts[(layer, e, proj)] = ref.reshape(shape)
                layer_cfg[f"{mod}.quantization"] = algo
                layer_cfg[f"{mod}.awq_block_size"] = block
    hf_quant_config = {"producer": {"name": "modelopt", "version": _modelopt_version()},
                       "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}
    hf_quant_config["quantization"].update(process_layer_quant_config(layer_cfg))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=4))
    cfg = model.config.to_dict()
    cfg["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg["quantization_config"] = convert_hf_quant_config_format(hf_quant_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    quantized = {f"model.layers.{k[0]}.mlp.experts.{k[1]}.{k[2]}_proj.weight" for k in experts}
    return Oracle(path, "modelopt", n_layers, n_exp, experts, quantized,
                  {k for k in dense if k.endswith(".weight")}, meta={"algo": algo})


def _modelopt_version() -> str:
    from importlib.metadata import version

    return version("nvidia-modelopt")


# ----------------------------------------------------------------------------------------
# DeepSeek-V3 FP8 (128x128 blocks), independent computation
# ----------------------------------------------------------------------------------------
FP8_BLOCK = 128


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 amax/448 per 128x128 tile (ragged edges allowed); returns (fp8 weight, scale_inv)."""
    out, inp = w.shape
    rows, cols = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    wf = w.float()
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = wf[r * FP8_BLOCK:(r + 1) * FP8_BLOCK, c * FP8_BLOCK:(c + 1) * FP8_BLOCK]
            s = tile.abs().amax().clamp(min=1e-12) / 448.0
            scale_inv[r, c] = s
            q[r * FP8_BLOCK:(r + 1) * FP8_BLOCK, c * FP8_BLOCK:(c + 1) * FP8_BLOCK] = (
                (tile / s).to(torch.float8_e4m3fn))
    return q, scale_inv


def fp8_block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek's weight_dequant: fp32 product, then a single rounding to BF16."""
    full = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return (q.float() * full[: q.shape[0], : q.shape[1]]).to(torch.bfloat16)


def write_fp8_block(path: Path, seed: int = 0) -> Oracle:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden, inter, n_layers, n_exp = 320, 192, 2, 4  # ragged last tiles in both dims
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, hidden, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(64, hidden, generator=gen).bfloat16(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    experts: dict[Key, torch.Tensor] = {}
    for layer in range(n_layers):
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(
            n_exp, hidden, generator=gen).bfloat16()
        for e in range(n_exp):
            for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                ("down", (hidden, inter))):
                mod = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj"
                q, s_inv = fp8_block_quantize(heavy_tailed(shape, gen))
                tensors[f"{mod}.weight"], tensors[f"{mod}.weight_scale_inv"] = q, s_inv
                experts[(layer, e, proj)] = fp8_block_dequantize(q, s_inv)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": hidden, "moe_intermediate_size": inter, "num_hidden_layers": n_layers,
           "n_routed_experts": n_exp, "vocab_size": 64,
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "dynamic",
                                   "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    quantized = {k for k in tensors
                 if k.endswith(".weight") and tensors[k].dtype == torch.float8_e4m3fn}
    dense = {k for k in tensors if k.endswith(".weight")} - quantized
    return Oracle(path, "fp8-block", n_layers, n_exp, experts, quantized, dense)
