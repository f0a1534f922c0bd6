"""The ``compressed-tensors`` NVFP4 profile against compressed-tensors 0.20.1, bit for bit.

Oracle: the library's own parameter math (``generate_gparam`` for ``weight_global_scale``,
``calculate_qparams`` for ``weight_scale``, fed fp32 min/max statistics) and its
``NVFP4PackedCompressor.compress`` / ``decompress``.

Restriction (documented in ``nvfp4_profiles.py``): where the library's scaled value is NaN its
packer runs ``(NaN * 2).to(int8)``, undefined behaviour, so codes are compared elsewhere only;
the decoded values of such blocks are NaN in both, because their scale is NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from nvfp4_cases import first_difference, gaussian, same_bits, special_tensors

from workbench.formats import dequantize, quantize
from workbench.formats.elements import unpack_fp4
from workbench.formats.nvfp4 import dequantize_nvfp4, from_library_global, quantize_nvfp4_parts

ct_q = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    generate_gparam,
)

SCHEME = ct_q.preset_name_to_scheme("NVFP4A16", ["Linear"])


def compressed_tensors_reference(x: torch.Tensor, stats_dtype: torch.dtype | None = None):
    """What an NVFP4A16 calibration + compression of weight ``x`` stores, and its decompression.

    The min/max statistics are taken in the weight's own dtype, as llm-compressor's observers
    and our checkpoint fixtures do, unless ``stats_dtype`` says otherwise.
    """
    xs = x if stats_dtype is None else x.to(stats_dtype)
    g = generate_gparam(xs.amin(), xs.amax())
    xb = xs.reshape(x.shape[0], -1, 16)
    scale, _ = calculate_qparams(xb.amin(-1), xb.amax(-1), SCHEME.weights, global_scale=g)
    sd = NVFP4PackedCompressor.compress({"weight": x, "weight_scale": scale,
                                         "weight_global_scale": g}, SCHEME)
    fp4_values = ct_quantize(x=x, scale=scale, zero_point=None, args=SCHEME.weights, global_scale=g)
    deq = NVFP4PackedCompressor.decompress(dict(sd), SCHEME)["weight"]
    return sd["weight_packed"], sd["weight_scale"], g, deq, torch.isnan(fp4_values)


def check_against_compressed_tensors(x: torch.Tensor) -> None:
    packed, scale, g, deq, undefined = compressed_tensors_reference(x)
    p = quantize_nvfp4_parts(x, "compressed-tensors")
    ours_codes, lib_codes = unpack_fp4(p.data), unpack_fp4(packed)
    assert torch.equal(ours_codes[~undefined], lib_codes[~undefined]), \
        first_difference(ours_codes[~undefined], lib_codes[~undefined])
    assert same_bits(p.scale, scale), first_difference(p.scale.float(), scale.float())
    assert same_bits(p.library_global, g.reshape(()))
    ours = dequantize_nvfp4(p.data, p.scale, p.global_scale, "compressed-tensors",
                            deq.dtype, library_global=g)
    assert same_bits(ours, deq), first_difference(ours, deq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_gaussian_matches_compressed_tensors(dtype, scale):
    check_against_compressed_tensors(gaussian((64, 256), dtype, seed=8, scale=scale))


def test_fp32_statistics_are_the_fp32_input_route():
    # bf16 statistics round 2688/amax and amax/6 to bf16; an fp32 observer does not. Feeding the
    # profile x.float() (an exact upcast) reproduces the fp32-statistics checkpoint instead.
    x = gaussian((32, 128), torch.bfloat16, seed=19, scale=0.37)
    packed, scale, g, _, _ = compressed_tensors_reference(x, stats_dtype=torch.float32)
    p32 = quantize_nvfp4_parts(x.float(), "compressed-tensors")
    assert torch.equal(p32.data, packed) and same_bits(p32.scale, scale)
    assert same_bits(p32.library_global, g.reshape(()))
    p16 = quantize_nvfp4_parts(x, "compressed-tensors")
    assert not same_bits(p16.library_global, p32.library_global)  # the routes really differ


def test_zero_blocks_get_eps_scale_and_zero_tensor_gets_unit_global():
    x = gaussian((4, 32), seed=9)
    x[0, :16] = 0.0
    check_against_compressed_tensors(x)
    assert quantize(x, "nvfp4", "compressed-tensors").scale[0, 0].float() == 0.125
    z = torch.zeros(2, 32)
    check_against_compressed_tensors(z)
    assert quantize_nvfp4_parts(z, "compressed-tensors").library_global == 1.0


def test_public_dequantize_is_the_library_decompress_and_the_bare_global_is_close():
    # quantize keeps weight_global_scale itself (library_global), so the public dequantize is
    # NVFP4PackedCompressor.decompress bit for bit. Without it, 1/(1/g) can miss g by an ulp and
    # the decode (s / g, then times the code) moves by at most two fp32 ulps; it does move here.
    worst = 0
    for seed in range(12):
        x = gaussian((16, 64), seed=seed, scale=float(seed + 1) * 0.37)
        _, _, g, deq, _ = compressed_tensors_reference(x)
        q = quantize(x, "nvfp4", "compressed-tensors")
        assert same_bits(q.library_global, g.reshape(()))
        got = dequantize(q, deq.dtype)
        assert same_bits(got, deq), first_difference(got, deq)
        exact = dequantize(q, torch.float32)
        bare = dequantize(dataclasses.replace(q, library_global=None), torch.float32)
        worst = max(worst, (exact.view(torch.int32) - bare.view(torch.int32)).abs().max().item())
    assert 0 < worst <= 2


@pytest.mark.parametrize("amax", [7.0, 5.0, 11.0])
def test_global_uses_the_librarys_reciprocal_multiply(amax):
    # `2688.0 / amax` in torch is reciprocal(amax) * 2688, one ulp off a true division for these.
    x = gaussian((2, 32), seed=30)
    x = x / x.abs().amax() * amax
    check_against_compressed_tensors(x)
    g = quantize_nvfp4_parts(x, "compressed-tensors").library_global
    assert g != torch.tensor(2688.0) / torch.tensor(amax)


def test_library_global_converts_from_checkpoint_shape():
    g = generate_gparam(torch.tensor(-3.0), torch.tensor(2.0))  # shape [1], encode direction
    d = from_library_global(g, "compressed-tensors")
    assert d.shape == () and torch.isclose(d, torch.tensor(3.0 / 2688.0))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=special_tensors())
def test_special_values_match_compressed_tensors(x):
    check_against_compressed_tensors(x)


def test_given_weight_global_scale_matches_compressed_tensors():
    # compress() takes whatever weight_global_scale calibration produced, e.g. a shared one.
    x = gaussian((8, 64), torch.bfloat16, seed=18)
    g = torch.tensor([357.25])
    xb = x.reshape(8, -1, 16)
    scale, _ = calculate_qparams(xb.amin(-1), xb.amax(-1), SCHEME.weights, global_scale=g)
    sd = NVFP4PackedCompressor.compress({"weight": x, "weight_scale": scale,
                                         "weight_global_scale": g}, SCHEME)
    p = quantize_nvfp4_parts(x, "compressed-tensors", library_global=g)
    assert torch.equal(p.data, sd["weight_packed"])
    assert same_bits(p.scale, sd["weight_scale"])
    deq = NVFP4PackedCompressor.decompress(dict(sd), SCHEME)["weight"]
    assert same_bits(dequantize_nvfp4(p.data, p.scale, p.global_scale, "compressed-tensors",
                                      torch.bfloat16, library_global=p.library_global), deq)
