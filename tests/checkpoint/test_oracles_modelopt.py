"""ModelOpt HF-layout NVFP4 / MXFP4 / MXFP8 experts against ModelOpt's own dequantize."""

from __future__ import annotations

import json

from oracle_checks import check_all

from workbench.checkpoint import open_checkpoint


def test_modelopt_experts_match_modelopt_dequantize(modelopt_ckpt):
    check_all(open_checkpoint(modelopt_ckpt.path), modelopt_ckpt)


def test_modelopt_config_is_modelopt_own(modelopt_ckpt):
    """Both config files came from ModelOpt's export helpers and agree on the algorithm."""
    hf = json.loads((modelopt_ckpt.path / "hf_quant_config.json").read_text())
    cfg = json.loads((modelopt_ckpt.path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt"
    assert hf["quantization"]["quant_algo"].lower() == modelopt_ckpt.meta["algo"]
    assert cfg["quant_algo"] == hf["quantization"]["quant_algo"]
    ck = open_checkpoint(modelopt_ckpt.path)
    for name in ["lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.1.self_attn.o_proj.weight"]:
        assert not ck.scope.is_quantized(name), ck.scope.reason(name)
