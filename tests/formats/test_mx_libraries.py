"""Tier 2: generated tensors (bf16/fp32, 2-D/3-D, injected specials) against the real libraries.

Where a library is undefined on an input (a float->int cast of NaN/Inf in ModelOpt's MXFP4 and
in compressed-tensors, or compressed-tensors' 2^128 scale overflow), that library's test leaves
those inputs out, and the test says so.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mx_cases import (
    SPECIALS,
    compressed_tensors_decode,
    compressed_tensors_oracle,
    first_difference,
    modelopt_decode,
    modelopt_mx_fake_quant_reference,
    modelopt_oracle,
    same_values,
    special_tensor,
    torchao_decode,
    torchao_oracle,
    triton_kernels_decode_reference,
    triton_kernels_reference,
)

from workbench.formats import dequantize, fake_quantize, quantize
from workbench.formats.constants import FORMATS
from workbench.formats.elements import unpack_fp4

MX = ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"]
FINITE = tuple(s for s in SPECIALS if s not in ("nan", "inf", "-inf"))
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _shape(nd: int, nb: int) -> tuple[int, ...]:
    return (2, 3, 32 * nb) if nd == 3 else (5, 32 * nb)


def tensors(specials=SPECIALS, dtypes=(torch.bfloat16, torch.float32)):
    return st.builds(
        lambda seed, nd, nb, dtype, sp: special_tensor(seed, _shape(nd, nb), dtype, sp),
        st.integers(0, 2**31 - 1), st.sampled_from([2, 3]), st.integers(1, 3),
        st.sampled_from(dtypes), st.frozensets(st.sampled_from(specials), max_size=4),
    )


def _same_data(ours: torch.Tensor, ref_bytes: torch.Tensor, fmt: str) -> bool:
    """Packed FP4 bytes exactly; FP8 elements bit for bit with NaN == NaN."""
    if fmt == "mxfp4":
        return torch.equal(ours.view(torch.uint8), ref_bytes)
    return same_values(ours, ref_bytes.view(ours.dtype))


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(MX))
def test_torchao_all_modes_with_specials(x, fmt):
    for profile in ("floor", "ceil", "even", "torchao-rceil", "rceil"):
        data, scale = torchao_oracle(x, fmt, profile)
        q = quantize(x, fmt, profile)
        keep = torch.ones(scale.shape, dtype=torch.bool)
        if profile == "rceil" and x.dtype == torch.float32:
            # fp32 ulp edges: rceil is exact where torchao's float log2 is not (see scale tests)
            keep = quantize(x, fmt, "torchao-rceil").scale == q.scale
        assert torch.equal(q.scale[keep], scale[keep]), (profile, first_difference(q.scale, scale))
        k_el = keep.repeat_interleave(32 // (2 if fmt == "mxfp4" else 1), dim=-1)
        ours = q.data.view(torch.uint8)[k_el].view(q.data.dtype)
        assert _same_data(ours, data[k_el], fmt), (profile, first_difference(q.data, data, x))
        if profile == "torchao-rceil":
            continue
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            ref = torchao_decode(q.data, q.scale, fmt, dtype)
            assert same_values(dequantize(q, dtype), ref), (profile, dtype)


@SETTINGS
@given(x=tensors(specials=FINITE), fmt=st.sampled_from(["mxfp4", "mxfp8_e4m3"]))
def test_modelopt_export_finite(x, fmt):
    data, scale = modelopt_oracle(x, fmt)
    q = quantize(x, fmt, "modelopt-export")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert _same_data(q.data, data, fmt), first_difference(q.data, data, x)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert same_values(dequantize(q, dtype), modelopt_decode(q.data, q.scale, x, fmt, dtype))


@SETTINGS
@given(x=tensors())
def test_modelopt_mxfp8_specials(x):
    """MXFP8QTensor handles NaN (byte 0) and Inf (byte 254) amax without undefined casts."""
    data, scale = modelopt_oracle(x, "mxfp8_e4m3")
    q = quantize(x, "mxfp8_e4m3", "modelopt-export")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert same_values(q.data, data.view(q.data.dtype))


@SETTINGS
@given(x=tensors(specials=FINITE), fmt=st.sampled_from(["mxfp4", "mxfp8_e4m3"]))
def test_compressed_tensors_finite(x, fmt):
    x2 = x.reshape(-1, x.shape[-1])  # the compressor takes 2-D Linear weights
    # left out: amax rounding up to 2^128 (the library's scale overflows a float->int cast)
    ok = x2.float().abs().reshape(x2.shape[0], -1, 32).amax(-1) < 1.75 * 2.0**127
    x2 = x2[ok.all(-1)]
    if not x2.shape[0]:
        return
    data, scale = compressed_tensors_oracle(x2, fmt)
    q = quantize(x2, fmt, "compressed-tensors")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data.view(torch.uint8), data), first_difference(q.data, data, x2)
    assert same_values(dequantize(q, torch.bfloat16), compressed_tensors_decode(q.data, q.scale, fmt))


TRITON_VERSIONS = {"triton-kernels": "gpt-oss", "triton-kernels-main": "main"}


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(MX), profile=st.sampled_from(sorted(TRITON_VERSIONS)))
def test_triton_kernels_transcription(x, fmt, profile):
    version = TRITON_VERSIONS[profile]
    data, scale = triton_kernels_reference(x, fmt, version)
    q = quantize(x, fmt, profile)
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert _same_data(q.data, data, fmt), first_difference(q.data, data, x)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        ref = triton_kernels_decode_reference(q.data, q.scale, fmt, dtype, version)
        assert same_values(dequantize(q, dtype), ref), dtype


@SETTINGS
@given(x=tensors(), fmt=st.sampled_from(MX))
def test_fp16_inputs_equal_their_exact_fp32_copy(x, fmt):
    """No library here takes fp16 MX input (torchao asserts); fp16 -> fp32 is exact, so the
    reference defines fp16 as the same bytes as the fp32 copy, for every profile."""
    x16 = x.to(torch.float16)
    for profile in ("rceil", "floor", "even", "triton-kernels", "triton-kernels-main"):
        a, b = quantize(x16, fmt, profile), quantize(x16.float(), fmt, profile)
        assert torch.equal(a.scale, b.scale), profile
        assert _same_data(a.data, b.data.view(torch.uint8), fmt), profile


def test_torchao_nan_block_bytes_spelled_out():
    """The special bytes docs/formats.md lists for torchao, checked against torchao itself."""
    x = torch.zeros(4, 32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = 1e-39  # fp32 subnormal amax
    x[3, 0] = -0.0
    _, floor = torchao_oracle(x, "mxfp4", "floor")
    _, rceil = torchao_oracle(x, "mxfp4", "rceil")
    assert floor[:, 0].tolist() == quantize(x, "mxfp4", "floor").scale[:, 0].tolist()
    assert rceil[:, 0].tolist() == quantize(x, "mxfp4", "rceil").scale[:, 0].tolist()
    assert rceil[0, 0] == 0xFF and rceil[1, 0] == 0xFE and rceil[2, 0] == 0 and rceil[3, 0] == 0
    assert floor[0, 0] == 0xFF


@pytest.mark.parametrize("profile", ["rceil", "floor"])
def test_fp16_decode_of_an_inf_block_is_torchaos_nan(profile):
    """Reported as a bug: an fp16 row holding inf gets scale byte 254 (rceil) or 253 (floor),
    and its fp16 decode has NaN where the codes are 0. torchao's to_dtype does exactly that:
    it rounds the scale to fp16 (inf from 2^16 up, byte 143) before multiplying, and 0 * inf is NaN. We keep its bytes;
    only the fp32 decode gives 0 there."""
    x = torch.linspace(-2, 2, 64, dtype=torch.float16).reshape(2, 32)
    x[0, 3] = float("inf")
    q = quantize(x, "mxfp4", profile)
    assert q.scale[0, 0] >= 143 and q.scale[1, 0] < 143
    data, scale = torchao_oracle(x.float(), "mxfp4", profile)  # torchao takes no fp16 input
    assert torch.equal(q.scale, scale) and torch.equal(q.data, data)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert same_values(dequantize(q, dtype), torchao_decode(q.data, q.scale, "mxfp4", dtype))
    zero_codes = unpack_fp4(q.data[0]) & 7 == 0
    assert zero_codes.sum() == 31
    assert torch.isnan(dequantize(q, torch.float16)[0, zero_codes]).all()
    assert (dequantize(q, torch.float32)[0, zero_codes] == 0).all()  # a finite fp32 scale


def test_triton_kernels_truncated_sticky_window():
    """fp32 values just above 0.25 (after scaling): triton_kernels shifts their low mantissa
    bits out before rounding. Generated data almost never lands there, so spell it out."""
    x = torch.zeros(2, 32)
    x[:, 0] = 6.0  # scale 2^0
    ks = torch.arange(1, 8, dtype=torch.float64)
    x[0, 1:8] = (0.25 + ks * 2.0**-25).float()
    x[1, 1:8] = -(0.25 + ks * 2.0**-25).float()
    data, scale = triton_kernels_reference(x, "mxfp4", "main")
    q = quantize(x, "mxfp4", "triton-kernels-main")
    assert torch.equal(q.scale, scale)
    assert torch.equal(q.data, data), first_difference(q.data, data)
    # and the window really is there: RNE (rceil) rounds every one of them up to 0.5
    assert not torch.equal(quantize(x, "mxfp4", "rceil").data, data)


def test_triton_kernels_generations_differ_on_ties():
    """gpt-oss's triton_kernels rounds E2M1 ties away (0.25 -> 0.5, 2.5 -> 3, 5 -> 6); main
    rounds them to even. Both against their transcriptions, on every tie."""
    x = torch.zeros(2, 32)
    x[:, 0] = 6.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x[0, 1:8], x[1, 1:8] = ties, -ties
    old = quantize(x, "mxfp4", "triton-kernels")
    new = quantize(x, "mxfp4", "triton-kernels-main")
    assert torch.equal(old.data, triton_kernels_reference(x, "mxfp4", "gpt-oss")[0])
    assert torch.equal(new.data, triton_kernels_reference(x, "mxfp4", "main")[0])
    assert torch.equal(new.data, quantize(x, "mxfp4", "rceil").data)  # RNE, same scale here
    assert not torch.equal(old.data, new.data)


def test_modelopt_sign_of_values_that_underflow_bf16_but_not_fp32():
    """ModelOpt divides in fp32: a tiny positive element (2^-138 after scaling) stays > 0 there and
    keeps sign bit 0, while a bf16 product would flush it to +0.0, which ModelOpt encodes 0x8."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 2.0**100
    x[0, 1] = 2.0**-40
    x[0, 2] = -(2.0**-40)
    data, scale = modelopt_oracle(x, "mxfp4")
    q = quantize(x, "mxfp4", "modelopt-export")
    assert torch.equal(q.scale, scale) and torch.equal(q.data, data), first_difference(q.data, data)
    assert data[0, 0] >> 4 == 0x0 and data[0, 1] & 0xF == 0x8


@SETTINGS
@given(x=tensors(specials=FINITE), fmt=st.sampled_from(MX))
def test_rceil_fake_quant_equals_modelopt_cuda_fake_quant(x, fmt):
    """docs/formats.md: ModelOpt's MX fake quant is RCEIL. Against a transcription of its CUDA kernel:
    equal values (+0 == -0: the kernel leaves the sign of a zero input uninitialised), except in
    blocks whose amax is at most max * 2^-127, where ModelOpt keeps the 2^127 multiplier and the
    rceil profile (torchao/TE) zeroes the block."""
    ref = modelopt_mx_fake_quant_reference(x, fmt).to(x.dtype)
    ours = fake_quantize(x, fmt, "rceil")
    amax = x.float().abs().reshape(*x.shape[:-1], -1, 32).amax(-1, keepdim=True)
    tiny = (amax <= FORMATS[fmt].elem_max * 2.0**-127).expand(*amax.shape[:-1], 32).reshape(x.shape)
    assert torch.equal(ours[~tiny].float(), ref[~tiny].float())
