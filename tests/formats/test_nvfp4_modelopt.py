"""The ``modelopt-export`` NVFP4 profile against ModelOpt 0.47's ``NVFP4QTensor``, bit for bit.

Oracle: ``NVFP4QTensor.quantize`` (packed codes, e4m3 ``weights_scaling_factor``,
``weights_scaling_factor_2``) and ``NVFP4QTensor.dequantize`` (which decodes 0x8 as +0.0).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from nvfp4_cases import first_difference, gaussian, same_bits, special_tensors

from workbench.formats import dequantize, quantize
from workbench.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_parts, to_library_global

qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
NVFP4QTensor = qtensor.NVFP4QTensor


def modelopt_reference(x: torch.Tensor, wsf2: torch.Tensor | None = None):
    qt, wsf, wsf2 = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=wsf2)
    deq = qt.dequantize(x.dtype, scale=wsf, double_scale=wsf2, block_sizes={-1: 16})
    return qt._quantized_data, wsf, wsf2, deq


def check_against_modelopt(x: torch.Tensor) -> None:
    data, wsf, wsf2, deq = modelopt_reference(x)
    q = quantize(x, "nvfp4", "modelopt-export")
    assert torch.equal(q.data, data), first_difference(q.data, data)
    assert same_bits(q.scale, wsf), first_difference(q.scale.float(), wsf.float())
    assert same_bits(to_library_global(q.global_scale, "modelopt-export"), wsf2.float())
    ours = dequantize(q, x.dtype)
    assert same_bits(ours, deq), first_difference(ours, deq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_gaussian_matches_modelopt(dtype, scale):
    check_against_modelopt(gaussian((64, 256), dtype, seed=5, scale=scale))


def test_zero_block_scale_is_one_and_negative_zero_code_decodes_positive():
    x = gaussian((4, 48), seed=6)
    x[0, :16] = 0.0
    x[1, :16] = -0.0
    x[2, 3] = -1e-12  # rounds to a signed zero code
    check_against_modelopt(x)
    q = quantize(x, "nvfp4", "modelopt-export")
    assert q.scale[0, 0].float() == 1.0
    assert torch.signbit(dequantize(q, torch.float32)[2, 3]).item() is False


def test_per_expert_global_scales_match_per_expert_modelopt_calls():
    # ModelOpt exports MoE experts one Linear at a time, each with its own weight_scale_2.
    x = gaussian((3, 32, 64), torch.bfloat16, seed=7)
    x[1] *= 300.0
    amax_E11 = x.float().abs().amax(dim=(1, 2), keepdim=True)
    q = quantize(x, "nvfp4", "modelopt-export", global_amax=amax_E11)
    ours = dequantize(q, torch.bfloat16)
    for e in range(3):
        data, wsf, wsf2, deq = modelopt_reference(x[e], amax_E11[e].reshape(()) / 2688.0)
        assert torch.equal(q.data[e], data)
        assert same_bits(q.scale[e], wsf)
        assert same_bits(q.global_scale[e].reshape(()), wsf2)
        assert same_bits(ours[e], deq)


def test_decode_of_every_byte_matches_modelopt():
    data = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
    scale = torch.arange(0, 256, 8, dtype=torch.uint8).reshape(32, 1).view(torch.float8_e4m3fn)
    wsf2 = torch.tensor(7.5e-4)
    qt = NVFP4QTensor((32, 16), torch.float32, data)
    ref = qt.dequantize(torch.float32, scale=scale, double_scale=wsf2, block_sizes={-1: 16})
    assert same_bits(dequantize_nvfp4(data, scale, wsf2, "modelopt-export", torch.float32), ref)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=special_tensors())
def test_special_values_match_modelopt(x):
    check_against_modelopt(x)


def test_given_weights_scaling_factor_2_matches_modelopt():
    x = gaussian((8, 64), torch.bfloat16, seed=17, scale=3.0)
    wsf2 = torch.tensor(1.7e-3)  # calibrated elsewhere, not this tensor's amax / 2688
    data, wsf, _, deq = modelopt_reference(x, wsf2)
    p = quantize_nvfp4_parts(x, "modelopt-export", library_global=wsf2)
    assert torch.equal(p.data, data) and same_bits(p.scale, wsf)
    ours = dequantize_nvfp4(p.data, p.scale, p.global_scale, "modelopt-export", torch.bfloat16)
    assert same_bits(ours, deq)
