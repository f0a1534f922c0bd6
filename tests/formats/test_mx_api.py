"""The MX codec surface: shapes, padding, errors, and tier 3 (round-trip quality floors)."""

from __future__ import annotations

import math

import pytest
import torch
from mx_cases import torchao_oracle

from workbench.formats import dequantize, fake_quantize, quantize
from workbench.formats.constants import FORMATS

MX = ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"]
ALL_MX_PROFILES = sorted({p for f in MX for p in FORMATS[f].profiles})


def _profiles(fmt: str) -> list[str]:
    return list(FORMATS[fmt].profiles)


@pytest.mark.parametrize("fmt", MX)
def test_shapes_and_dtypes_of_a_3d_stack(fmt):
    x = torch.randn(3, 4, 96, dtype=torch.bfloat16)
    for profile in _profiles(fmt):
        q = quantize(x, fmt, profile)
        assert q.scale.shape == (3, 4, 3) and q.scale.dtype == torch.uint8
        if fmt == "mxfp4":
            assert q.data.shape == (3, 4, 48) and q.data.dtype == torch.uint8
        else:
            assert q.data.shape == (3, 4, 96) and q.data.dtype == FORMATS[fmt].elem_dtype
        y = fake_quantize(x, fmt, profile)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(y, dequantize(q, torch.bfloat16))
        # a 3-D stack is rows of blocks: the same bytes as the flattened 2-D matrix
        q2 = quantize(x.reshape(12, 96), fmt, profile)
        assert torch.equal(q.scale.reshape(12, 3), q2.scale)
        assert torch.equal(q.data.reshape(12, -1).view(torch.uint8), q2.data.view(torch.uint8))


@pytest.mark.parametrize("fmt", MX)
def test_pad_equals_explicit_zero_padding_and_crops_back(fmt):
    x = torch.randn(5, 70)
    with pytest.raises(ValueError, match="pad=True"):
        quantize(x, fmt)
    q = quantize(x, fmt, pad=True)
    ref = quantize(torch.nn.functional.pad(x, (0, 26)), fmt)
    assert q.shape == (5, 70) and q.scale.shape == (5, 3)
    assert torch.equal(q.scale, ref.scale)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    out = dequantize(q, torch.float32)
    assert out.shape == (5, 70)
    assert torch.equal(out, dequantize(ref, torch.float32)[:, :70])


def test_bad_inputs_get_clear_errors():
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        quantize(torch.ones(2, 32, dtype=torch.int32), "mxfp4")
    with pytest.raises(ValueError, match="no profile"):
        quantize(torch.ones(2, 32), "mxfp4", "nonsense")
    with pytest.raises(ValueError, match="no profile 'modelopt-export'"):
        quantize(torch.ones(2, 32), "mxfp8_e5m2", "modelopt-export")
    q = quantize(torch.ones(2, 64), "mxfp4")
    from workbench.formats.mx import dequantize_mx

    with pytest.raises(TypeError, match="uint8 E8M0"):
        dequantize_mx(q.data, q.scale.float(), FORMATS["mxfp4"], "rceil", torch.float32)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_mx(q.data, q.scale[:, :1], FORMATS["mxfp4"], "rceil", torch.float32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_mx(q.data, q.scale, FORMATS["mxfp8_e4m3"], "rceil", torch.float32)


@pytest.mark.parametrize(
    ("fmt", "profile"),
    [(f, p) for f in MX for p in ("rceil", "floor", "even", "modelopt-export", "triton-kernels")
     if p in FORMATS[f].profiles],
)
def test_fake_quantize_is_idempotent(fmt, profile):
    """A second pass over already-quantized values must change nothing (every profile's scale
    rule maps a block it produced back to the same scale, and grid values are exact)."""
    x = torch.randn(16, 256) * torch.logspace(-4, 4, 256)
    y = fake_quantize(x, fmt, profile)
    assert torch.equal(fake_quantize(y, fmt, profile), y)


def _sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    return 10 * math.log10(x.double().pow(2).sum().item() / (x.double() - y.double()).pow(2).sum().item())


def _uniform_quantizer_floor_db(fmt: str) -> float:
    """First-principles lower bound for Gaussian blocks: every element's error is at most half a
    grid step at its own magnitude, i.e. at most 2^-(m+1) of |x| in the normal range (m mantissa
    bits), plus the subnormal floor. SQNR >= 20 log10(2^(m+1)) minus 3 dB for the subnormal/
    clipping tail is a loose but honest floor that a wrong-but-consistent codec would miss."""
    m = FORMATS[fmt].elem_mantissa_bits
    return 20 * math.log10(2 ** (m + 1)) - 3.0


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("profile", ["floor", "ceil", "even", "rceil"])
def test_sqnr_on_gaussian_at_least_torchao(fmt, profile):
    from mx_cases import torchao_decode

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 1024, generator=g).bfloat16()
    ours = _sqnr_db(x, fake_quantize(x, fmt, profile))
    data, scale = torchao_oracle(x, fmt, profile)
    if fmt != "mxfp4":
        data = data.view(FORMATS[fmt].elem_dtype)
    theirs = _sqnr_db(x, torchao_decode(data, scale, fmt, torch.bfloat16))
    assert ours >= theirs - 0.01, (ours, theirs)
    assert ours >= _uniform_quantizer_floor_db(fmt), ours


@pytest.mark.slow
@pytest.mark.inductor_cpp
@pytest.mark.parametrize(("fmt", "profile"), [("mxfp4", "rceil"), ("mxfp8_e4m3", "triton-kernels")])
def test_fullgraph_compile_gives_the_eager_bytes(fmt, profile):
    """The reference compiles without graph breaks (QAT may compile it) and, specials included,
    produces the same bytes as eager."""
    from mx_cases import SPECIALS, same_values, special_tensor

    x = special_tensor(3, (4, 128), torch.bfloat16, frozenset(SPECIALS))
    q_c = torch.compile(lambda t: quantize(t, fmt, profile), fullgraph=True, dynamic=False)(x)
    q_e = quantize(x, fmt, profile)
    assert torch.equal(q_c.scale, q_e.scale)
    assert torch.equal(q_c.data.view(torch.uint8), q_e.data.view(torch.uint8)) or (
        fmt != "mxfp4" and same_values(q_c.data, q_e.data))
    y_c = torch.compile(lambda t: fake_quantize(t, fmt, profile), fullgraph=True, dynamic=False)(x)
    assert same_values(y_c, fake_quantize(x, fmt, profile))
