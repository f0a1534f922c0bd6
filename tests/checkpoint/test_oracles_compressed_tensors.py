"""compressed-tensors MXFP4 / NVFP4 checkpoints against compressed-tensors' own decompression."""

from __future__ import annotations

import json

import pytest
from oracle_checks import assert_bits_equal, check_all

pytest.importorskip("compressed_tensors", reason="compressed-tensors writes these oracles (.[dev])")
from workbench.checkpoint import open_checkpoint


@pytest.mark.parametrize("which", ["ct_mxfp4", "ct_nvfp4"])
def test_compressed_tensors_experts_match_library_decode(which, request):
    oracle = request.getfixturevalue(which)
    fmt = {"ct_mxfp4": "mxfp4-pack-quantized", "ct_nvfp4": "nvfp4-pack-quantized"}[which]
    assert oracle.meta["format"] == fmt  # the fixture really is the format it claims
    check_all(open_checkpoint(oracle.path), oracle)


@pytest.mark.parametrize("which", ["ct_mxfp4", "ct_nvfp4"])
def test_compressed_tensors_dense_quantized_layers_match(which, request):
    """Attention projections are packed too (target "Linear"): decode them through tensor()."""
    oracle = request.getfixturevalue(which)
    ck = open_checkpoint(oracle.path)
    decoded = oracle.meta["decoded"]
    attn = sorted(n for n in oracle.quantized if ".self_attn." in n)
    assert attn, "fixture should quantize attention projections"
    for name in attn:
        assert ck.scope.is_quantized(name), ck.scope.reason(name)
        assert_bits_equal(ck.tensor(name).materialize(), decoded[name], name)


def test_compressed_tensors_ignore_list_drives_scope(ct_mxfp4):
    """The router and lm_head are in the config's ignore list, and the reason says so."""
    ck = open_checkpoint(ct_mxfp4.path)
    config = json.loads((ct_mxfp4.path / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    assert "lm_head" in ignore
    for name in ["lm_head.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.1.mlp.gate.weight"]:
        assert not ck.scope.is_quantized(name)
        reason = ck.scope.reason(name)
        assert any(entry.removesuffix(".weight") in reason or "ignore" in reason.lower()
                   for entry in ignore), reason
    assert ck.scope.is_quantized("model.layers.0.self_attn.q_proj.weight")
    assert "Linear" in ck.scope.reason("model.layers.0.self_attn.q_proj.weight")


def test_compressed_tensors_heavy_tails_reach_the_codec(ct_nvfp4, ct_mxfp4):
    """The fixtures carry the edge cases they are meant to: zero blocks and outliers."""
    for oracle in (ct_nvfp4, ct_mxfp4):
        w = oracle.experts[(0, 0, "gate")].float()
        assert (w[0, :32] == 0).all()
        amax = oracle.experts[(0, 1, "up")].float().abs()
        assert amax.max() > 20 * amax.median()
