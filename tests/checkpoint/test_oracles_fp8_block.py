"""DeepSeek-V3 FP8 128x128-block checkpoints against an independent fp32 decode."""

from __future__ import annotations

import torch
from oracle_checks import assert_bits_equal, check_all
from oracles import fp8_block_dequantize, fp8_block_quantize

from workbench.checkpoint import open_checkpoint


def test_fp8_block_experts_match_independent_decode(fp8_block):
    check_all(open_checkpoint(fp8_block.path), fp8_block)


def test_fp8_block_row_window_across_tile_edge(fp8_block):
    """Rows 120..140 straddle the first 128-row tile edge; columns end in the ragged tile."""
    ck = open_checkpoint(fp8_block.path)
    want = fp8_block.experts[(1, 2, "down")]
    assert_bits_equal(ck.expert_weight(1, 2, "down")[120:140, 250:320], want[120:140, 250:320],
                      "down[120:140, 250:320]")


def test_fp8_block_oracle_is_a_real_round_trip():
    """The independent codec is itself sane: error within fp8 e4m3 precision per tile."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 260, generator=g) * torch.logspace(-3, 1, 260)).bfloat16()
    q, s = fp8_block_quantize(w)
    assert s.shape == (2, 3)
    back = fp8_block_dequantize(q, s).float()
    tile_amax = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :260] * 448
    assert ((back - w.float()).abs() <= tile_amax * 2.0**-4 + 1e-30).all()
