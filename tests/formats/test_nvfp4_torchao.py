"""The ``torchao`` NVFP4 profile against torchao 0.18 itself, bit for bit.

Oracle: ``nvfp4_quantize`` (codes, block scales), ``per_tensor_amax_to_scale`` (global) and
``NVFP4Tensor.dequantize`` (decode), including per-expert ``[E, 1, 1]`` global scales.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from nvfp4_cases import first_difference, gaussian, same_bits, special_tensors

from workbench.formats import dequantize, fake_quantize, quantize
from workbench.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_parts

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def torchao_reference(x: torch.Tensor, per_tensor_scale: torch.Tensor):
    t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_scale)
    return t.qdata, t.scale, t.dequantize(x.dtype), t.dequantize(torch.float32)


def check_against_torchao(x: torch.Tensor, global_amax: torch.Tensor | None = None) -> None:
    amax = x.float().abs().amax() if global_amax is None else global_amax
    pts = nvfp4_tensor.per_tensor_amax_to_scale(amax)
    data, scale, deq, deq32 = torchao_reference(x, pts)
    q = quantize(x, "nvfp4", "torchao", global_amax=global_amax)
    assert torch.equal(q.data, data), first_difference(q.data, data)
    assert same_bits(q.scale, scale), first_difference(q.scale.float(), scale.float())
    assert same_bits(q.global_scale, pts)
    ours = dequantize(q, x.dtype)
    assert same_bits(ours, deq), first_difference(ours, deq)
    assert same_bits(dequantize(q, torch.float32), deq32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_gaussian_matches_torchao(dtype, scale):
    check_against_torchao(gaussian((64, 256), dtype, seed=1, scale=scale))


def test_block_scale_floor_and_nvfp4_quantize_directly():
    # Blocks 2^20 times smaller than the tensor amax hit torchao's 2^-6 block-scale floor.
    x = gaussian((8, 64), seed=2)
    x[1] *= 2.0**-20
    x[2, :16] = 0.0
    pts = nvfp4_tensor.per_tensor_amax_to_scale(x.abs().amax())
    scale, data = nvfp4_tensor.nvfp4_quantize(x, 16, pts)
    parts = quantize_nvfp4_parts(x, "torchao")
    assert torch.equal(parts.data, data)
    assert same_bits(parts.scale, scale)
    assert (parts.scale[1].float() == 2.0**-6).any()


def test_calibrated_global_amax_clips_like_torchao():
    x = gaussian((16, 128), seed=3, scale=4.0)
    check_against_torchao(x, global_amax=torch.tensor(2.5))  # below the true amax: saturates


def test_per_expert_global_scales_match_torchao():
    x = gaussian((4, 32, 64), torch.bfloat16, seed=4)
    x[1] *= 1000.0
    x[2] *= 1e-3
    amax_E11 = x.float().abs().amax(dim=(1, 2), keepdim=True)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(amax_E11)
    data, scale, deq, _ = torchao_reference(x, pts)
    q = quantize(x, "nvfp4", global_amax=amax_E11)
    assert q.global_scale.shape == (4, 1, 1)
    assert torch.equal(q.data, data) and same_bits(q.scale, scale)
    assert same_bits(q.global_scale, pts)
    assert same_bits(dequantize(q, torch.bfloat16), deq)
    # One global for the whole stack would lose the small expert almost entirely.
    shared = fake_quantize(x, "nvfp4")
    per_expert = dequantize(q, torch.bfloat16)
    err = lambda y: (y[2].float() - x[2].float()).abs().mean()
    assert err(per_expert) < err(shared)


def test_every_code_decodes_like_torchao():
    # All 256 byte values with a spread of e4m3 scales, including subnormal ones and NaN (0x7F).
    data = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
    scale = torch.arange(0, 256, 8, dtype=torch.uint8).reshape(32, 1).view(torch.float8_e4m3fn)
    pts = torch.tensor(3.0e-3)
    t = nvfp4_tensor.NVFP4Tensor(data, scale, 16, torch.float32, per_tensor_scale=pts)
    ours = dequantize_nvfp4(data, scale, pts, "torchao", torch.float32)
    assert same_bits(ours, t.dequantize(torch.float32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=special_tensors())
def test_special_values_match_torchao(x):
    check_against_torchao(x)


def test_single_level_scaling_is_a_unit_global():
    # torchao without per_tensor_scale: block scales alone; the same as a global amax of 2688.
    x = gaussian((8, 64), torch.bfloat16, seed=15, scale=20.0)
    t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x)
    q = quantize(x, "nvfp4", global_amax=2688.0)
    assert q.global_scale == 1.0
    assert torch.equal(q.data, t.qdata) and same_bits(q.scale, t.scale)
    assert same_bits(dequantize(q, torch.bfloat16), t.dequantize(torch.bfloat16))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=special_tensors(max_rows=2, max_blocks=2), b=special_tensors(max_rows=2, max_blocks=2))
def test_special_values_in_expert_stacks_match_torchao(a, b):
    # Two experts (rows/blocks aligned by tiling) with their own amax; an all-zero expert has
    # amax 0, for which torchao's 0/0 block scales are NaN: the profile must do the same.
    rows, k = max(a.shape[0], b.shape[0]), max(a.shape[1], b.shape[1])
    fit = lambda t: t.float().repeat(rows, k)[:rows, :k]
    x = torch.stack([fit(a), fit(b)]).to(a.dtype)
    amax_E11 = x.float().abs().amax(dim=(1, 2), keepdim=True)
    check_against_torchao(x, global_amax=amax_E11)


def test_given_per_tensor_scale_matches_torchao():
    # A calibrated per_tensor_scale that is not amax/2688 of this tensor, passed as torchao takes it.
    x = gaussian((4, 3, 64), torch.bfloat16, seed=16, scale=2.0)
    per_expert = torch.tensor([1e-3, 0.5, 7.0, 3e-3]).reshape(4, 1, 1)
    for pts in (torch.tensor(0.0123), per_expert):
        t = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
        p = quantize_nvfp4_parts(x, "torchao", library_global=pts)
        assert torch.equal(p.data, t.qdata) and same_bits(p.scale, t.scale)
        assert same_bits(p.global_scale, pts)
