"""NVFP4 through the public API: errors, padding, global-scale forms, 3-D stacks, quality floors.

Library bit-exactness lives in the per-library files; these tests check what holds for every
profile and that bad input fails loudly with a message naming the problem.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_cases import gaussian, same_bits, sqnr_db

from workbench.formats import dequantize, fake_quantize, quantize
from workbench.formats.nvfp4 import (
    PROFILES,
    dequantize_nvfp4,
    from_library_global,
    quantize_nvfp4_parts,
    to_library_global,
)

ALL = sorted(PROFILES)


@pytest.mark.parametrize("profile", ALL)
def test_gaussian_sqnr_floor(profile):
    # E2M1 with e4m3 block scales on N(0,1) lands near 20.4 dB; a codec that truncates instead of
    # rounding, or mis-scales blocks by a binade, falls well below this floor.
    x = gaussian((128, 512), seed=20)
    assert sqnr_db(x, fake_quantize(x, "nvfp4", profile)) > 19.5


@pytest.mark.parametrize("profile", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_is_dequantize_of_quantize(profile, dtype):
    x = gaussian((3, 8, 32), dtype, seed=21)
    fq = fake_quantize(x, "nvfp4", profile)
    assert fq.shape == x.shape and fq.dtype == dtype
    assert same_bits(fq, dequantize(quantize(x, "nvfp4", profile), dtype))


@pytest.mark.parametrize("profile", ALL)
def test_per_expert_globals_equal_one_call_per_expert(profile):
    x = gaussian((3, 16, 48), torch.bfloat16, seed=22)
    x[0] *= 1e-4
    x[2] *= 1e3
    amax_E11 = x.float().abs().amax(dim=(1, 2), keepdim=True)
    stack = quantize_nvfp4_parts(x, profile, amax_E11)
    assert stack.global_scale.shape == (3, 1, 1)
    for e in range(3):
        one = quantize_nvfp4_parts(x[e], profile, amax_E11[e])
        assert torch.equal(stack.data[e], one.data)
        assert same_bits(stack.scale[e], one.scale)
        assert same_bits(stack.global_scale[e].reshape(()), one.global_scale)
    deq = dequantize(quantize(x, "nvfp4", profile, global_amax=amax_E11), torch.float32)
    for e in range(3):
        assert sqnr_db(x[e].float(), deq[e]) > 19.0  # each expert keeps its own range


@pytest.mark.parametrize("profile", ALL)
def test_padding_round_trips_the_logical_shape(profile):
    x = gaussian((5, 40), seed=23)
    q = quantize(x, "nvfp4", profile, pad=True)
    assert q.shape == (5, 40) and q.data.shape == (5, 24) and q.scale.shape == (5, 3)
    padded = torch.nn.functional.pad(x, (0, 8))
    assert same_bits(dequantize(q, torch.float32),
                     fake_quantize(padded, "nvfp4", profile)[:, :40])


@pytest.mark.parametrize("profile", ALL)
def test_library_global_forms_round_trip(profile):
    amax = torch.rand(1000) * 100 + 1e-3
    lib = PROFILES[profile].global_from_amax(amax)
    back = to_library_global(from_library_global(lib, profile), profile)
    rel = ((back - lib).abs() / lib).max().item()
    if PROFILES[profile].global_form == "decode":
        assert torch.equal(back, lib)
    else:
        assert rel <= 2.0**-23  # one ulp: why dequantize_nvfp4 accepts library_global
    d = from_library_global(lib, profile)
    assert torch.allclose(d, amax / 2688.0, rtol=1e-6)  # every form decodes the same way


def test_decode_direction_global_is_the_same_scale_for_every_profile():
    x = gaussian((4, 64), seed=24, scale=3.0)
    ds = [quantize(x, "nvfp4", p).global_scale for p in ALL]
    for d in ds:
        assert torch.allclose(d, x.abs().amax() / 2688.0, rtol=1e-6)


def test_unknown_profile_and_bad_shapes_are_rejected():
    x = gaussian((4, 32), seed=25)
    with pytest.raises(ValueError, match="no profile 'nope'"):
        quantize(x, "nvfp4:nope")
    with pytest.raises(ValueError, match="unknown NVFP4 profile 'nope'"):
        quantize_nvfp4_parts(x, "nope")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4_parts(gaussian((4, 24)), "torchao")
    with pytest.raises(ValueError, match="not a multiple"):
        quantize(gaussian((4, 24)), "nvfp4")
    with pytest.raises(TypeError, match="float64"):
        quantize_nvfp4_parts(x.double(), "torchao")
    with pytest.raises(ValueError, match="empty tensor"):
        quantize_nvfp4_parts(torch.zeros(0, 32), "torchao")


def test_global_amax_shapes():
    x = gaussian((2, 8, 32), seed=26)
    for ok in (torch.tensor(3.0), torch.tensor([3.0]), 3.0, torch.ones(2, 1, 1)):
        quantize_nvfp4_parts(x, "torchao", ok)
    one = quantize_nvfp4_parts(x[:1], "torchao", torch.ones(1, 1, 1))
    assert one.global_scale.shape == (1, 1, 1)  # a one-expert stack keeps its expert dim
    assert quantize_nvfp4_parts(x[0], "torchao", torch.ones(1)).global_scale.shape == ()
    with pytest.raises(ValueError, match=r"scalar or shape \[2, 1, 1\].*got shape \[2\]"):
        quantize_nvfp4_parts(x, "torchao", torch.ones(2))
    with pytest.raises(ValueError, match=r"got shape \[3, 1, 1\]"):
        quantize_nvfp4_parts(x, "te", torch.ones(3, 1, 1))


def test_tiles_only_for_te_and_whole_tiles():
    x = gaussian((32, 32), seed=27)
    with pytest.raises(ValueError, match="Transformer Engine"):
        quantize_nvfp4_parts(x, "torchao", tile_rows=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4_parts(gaussian((20, 32)), "te", tile_rows=16)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4_parts(gaussian((32,)), "te", tile_rows=16)
    with pytest.raises(ValueError, match="tile_rows must be 1 or 16"):
        quantize_nvfp4_parts(x, "te", tile_rows=8)
    stack = gaussian((2, 32, 32), seed=28)
    tiled = quantize_nvfp4_parts(stack, "te", tile_rows=16)
    assert tiled.scale.shape == (2, 32, 2)
    rows = tiled.scale[1, :16].view(torch.uint8)
    assert (rows == rows[0]).all()  # a tile's scale sits on each of its 16 rows
    one = quantize_nvfp4_parts(stack[1], "te", stack.abs().amax(), tile_rows=16)
    assert torch.equal(one.scale.view(torch.uint8), tiled.scale[1].view(torch.uint8))
    assert torch.equal(one.data, tiled.data[1])


def test_dequantize_rejects_mismatched_parts():
    q = quantize(gaussian((4, 32), seed=29), "nvfp4")
    with pytest.raises(TypeError, match="uint8"):
        dequantize_nvfp4(q.data.to(torch.int8), q.scale, q.global_scale, "torchao", torch.float32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_nvfp4(q.data, q.scale.float(), q.global_scale, "torchao", torch.float32)
    with pytest.raises(ValueError, match=r"scale shape \[4, 1\] does not match data shape"):
        dequantize_nvfp4(q.data, q.scale[:, :1], q.global_scale, "torchao", torch.float32)


@pytest.mark.parametrize("profile", ALL)
def test_to_library_global_of_a_quantized_tensor(profile):
    x = gaussian((4, 32), seed=31, scale=2.0)
    q = quantize(x, "nvfp4", profile)
    assert same_bits(to_library_global(q), to_library_global(q.global_scale, profile))
    with pytest.raises(TypeError, match="nvfp4 QuantizedTensor"):
        to_library_global(quantize(x, "mxfp4"))


def test_te_tiles_cost_a_little_quality_and_keep_a_floor():
    # One scale per 256 values instead of 16: ~1.3 dB below 1x16 on N(0,1), still above 18.5 dB.
    x = gaussian((128, 512), seed=20)
    tiled = quantize_nvfp4_parts(x, "te", tile_rows=16)
    deq = dequantize_nvfp4(tiled.data, tiled.scale, tiled.global_scale, "te", torch.float32)
    assert 18.5 < sqnr_db(x, deq) < sqnr_db(x, fake_quantize(x, "nvfp4", "te"))


@pytest.mark.parametrize("profile", ALL)
def test_library_global_equals_the_global_amax_route(profile):
    x = gaussian((2, 8, 32), seed=32, scale=5.0)
    amax_E11 = x.abs().amax(dim=(1, 2), keepdim=True)
    via_amax = quantize_nvfp4_parts(x, profile, amax_E11)
    via_lib = quantize_nvfp4_parts(x, profile, library_global=via_amax.library_global)
    assert torch.equal(via_amax.data, via_lib.data)
    assert same_bits(via_amax.scale, via_lib.scale)
    assert same_bits(via_amax.global_scale, via_lib.global_scale)
    with pytest.raises(ValueError, match="not both"):
        quantize_nvfp4_parts(x, profile, amax_E11, library_global=via_amax.library_global)
    with pytest.raises(ValueError, match=r"library_global must be a scalar or shape \[2, 1, 1\]"):
        quantize_nvfp4_parts(x, profile, library_global=torch.ones(2))
