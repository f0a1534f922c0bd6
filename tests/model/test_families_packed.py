"""`from_pretrained` of packed checkpoints: the masters are each writer's own decode, bit for bit.

- gpt-oss MXFP4 (`*_blocks` / `*_scales`, `quant_method: mxfp4`) made from a transformers
  gpt-oss model: the masters equal what transformers' `Mxfp4Config(dequantize=True)` load makes of
  the blocks, and the logits match that model's.
- DeepSeek FP8 (128 x 128 blocks, `weight_scale_inv`) made from a transformers DeepSeek-V3 model:
  every linear weight equals DeepSeek's `weight_dequant` (fp32 product, one rounding to BF16) and
  transformers' own CPU dequantization to BF16; the logits match.
- compressed-tensors MXFP4 / NVFP4 written by compressed-tensors itself (tests/checkpoint's
  oracle writer): every tensor equals compressed-tensors' `CompressedTensorsDequantizer`.
Tolerances as in test_families_parity.py (both sides compute in fp32 on the same weights).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the oracle (pip install 'workbench[dev]')")

from family_oracle import CASES, checkpoint_oracles, family_model, ids, write_gpt_oss_mxfp4
from safetensors.torch import load_file, save_file

from workbench.model import from_pretrained, hf_to_ours

ATOL = RTOL = 2e-5


def test_gpt_oss_mxfp4_masters_are_transformers_decode(tmp_path):
    from transformers import GptOssForCausalLM, Mxfp4Config

    cfg = CASES["gpt_oss"]
    folder = write_gpt_oss_mxfp4(cfg, tmp_path / "oss")
    ref = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                            dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    ours = from_pretrained(folder)
    want = hf_to_ours(ref.state_dict(), family="gpt_oss")
    for name, p in ours.named_parameters():
        assert torch.equal(p.data, want[name].float()), name
    e = ours.model.layers[1].mlp.experts
    assert e.w1.abs().max() > 0 and len(torch.unique(e.w1)) > 16  # decoded, not zeros
    with torch.no_grad():
        torch.testing.assert_close(ours(ids(cfg)).logits, ref(input_ids=ids(cfg)).logits,
                                   rtol=RTOL, atol=ATOL)


def test_deepseek_fp8_masters_are_deepseek_decode(tmp_path):
    from transformers import AutoModelForCausalLM

    oracles = checkpoint_oracles()
    cfg = CASES["deepseek_v3"]
    bf16 = tmp_path / "bf16"
    family_model(cfg, seed=7).to(torch.bfloat16).save_pretrained(bf16)
    tensors = load_file(bf16 / "model.safetensors")
    decoded = {}
    for name in list(tensors):  # DeepSeek's release: every linear except the router, FP8
        t = tensors[name]
        if t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, s_inv = oracles.fp8_block_quantize(t)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, s_inv
            decoded[name] = oracles.fp8_block_dequantize(q, s_inv)
    folder = tmp_path / "fp8"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                     "quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))

    ours = from_pretrained(folder)
    params = dict(ours.named_parameters())
    assert len(decoded) > 20
    want = hf_to_ours(decoded, family="deepseek_v3")
    for name, value in want.items():  # DeepSeek's decode
        assert torch.equal(params[name].data, value.float()), name
    # transformers dequantizes on CPU to BF16: the same values; then computes in fp32
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float().eval()
    ref.config._attn_implementation = "eager"
    theirs = hf_to_ours(ref.state_dict(), family="deepseek_v3")
    for name, p in params.items():
        assert torch.equal(p.data, theirs[name].float()), name
    with torch.no_grad():
        torch.testing.assert_close(ours(ids(cfg)).logits, ref(input_ids=ids(cfg)).logits,
                                   rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scheme", ["MXFP4A16", "NVFP4A16"])
def test_compressed_tensors_masters_are_compressed_tensors_decode(tmp_path, scheme):
    pytest.importorskip("compressed_tensors")
    oracles = checkpoint_oracles()
    oracle = oracles.write_compressed_tensors(tmp_path / scheme, scheme, seed=1)
    ours = from_pretrained(oracle.path)
    stored = {}
    for shard in sorted(oracle.path.glob("*.safetensors")):
        stored.update(load_file(shard))
    decoded = {**{k: v for k, v in stored.items() if v.dtype == torch.bfloat16},
               **oracle.meta["decoded"]}
    want = hf_to_ours({k: v for k, v in decoded.items() if k.endswith("weight")})
    params = dict(ours.named_parameters())
    assert len(oracle.quantized) > 8
    for name, p in params.items():
        assert torch.equal(p.data, want[name].float()), name
