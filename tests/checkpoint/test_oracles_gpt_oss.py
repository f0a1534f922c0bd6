"""gpt-oss `_blocks/_scales` layout against transformers' Mxfp4Config(dequantize=True) load."""

from __future__ import annotations

import pytest
import torch
from oracle_checks import assert_bits_equal, check_all

pytest.importorskip("transformers", reason="transformers decodes this oracle (.[dev])")
from workbench.checkpoint import open_checkpoint


def test_gpt_oss_experts_match_transformers(gpt_oss):
    check_all(open_checkpoint(gpt_oss.path), gpt_oss)


def test_gpt_oss_stacked_experts_match_transformers(gpt_oss):
    """A range of experts from the fused tensor, gate/up de-interleaved, equals transformers'."""
    ck = open_checkpoint(gpt_oss.path)
    for proj in ("gate", "up", "down"):
        stack = ck.stacked_experts(1, proj)
        want = torch.stack([gpt_oss.experts[(1, e, proj)] for e in range(gpt_oss.num_experts)])
        assert tuple(stack.shape) == tuple(want.shape)
        assert_bits_equal(stack[1:3, 5:40, 7:90], want[1:3, 5:40, 7:90], f"stack {proj}")


def test_gpt_oss_modules_to_not_convert_drive_scope(gpt_oss):
    ck = open_checkpoint(gpt_oss.path)
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.router.weight",
                 "model.embed_tokens.weight", "lm_head.weight"]:
        assert not ck.scope.is_quantized(name), ck.scope.reason(name)


def test_gpt_oss_fixture_covers_scale_edges(gpt_oss):
    """Scale bytes 0 (2^-127) and 252 are in the file, so their decode is compared above."""
    from safetensors import safe_open

    with safe_open(gpt_oss.path / "model.safetensors", "pt") as f:
        s = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_scales")
    assert int(s.min()) == 0 and int(s.max()) == 252
