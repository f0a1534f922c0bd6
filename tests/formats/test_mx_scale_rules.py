"""Scale rules over every positive finite bf16 amax (32639 values, one batched call each).

Each row builds [N, 32] blocks whose amax is exactly one bf16 value; the library and the
reference quantize the same blocks, and scale bytes and data bytes must agree everywhere.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from mx_cases import (
    amax_blocks,
    compressed_tensors_oracle,
    first_difference,
    modelopt_oracle,
    positive_finite_bf16,
    torchao_oracle,
    triton_kernels_reference,
)

from workbench.formats import quantize
from workbench.formats.constants import FORMATS

MX = ["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2"]


@pytest.fixture(scope="module")
def bf16_blocks() -> torch.Tensor:
    return amax_blocks(positive_finite_bf16(), torch.bfloat16)


def _exact_rceil_byte(amax: float, elem_max: float) -> int:
    """2^ceil(log2(amax / max)) by exact rational arithmetic, clamped to E8M0 [0, 254]."""
    r = Fraction(amax) / Fraction(elem_max)
    k = math.frexp(amax / elem_max)[1] - 1 if amax / elem_max > 0 else -200
    k = max(min(k, 200), -200)
    while Fraction(2) ** k < r:
        k += 1
    while k > -200 and Fraction(2) ** (k - 1) >= r:
        k -= 1
    return max(0, min(254, k + 127))


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("profile", ["floor", "ceil", "even", "rceil", "torchao-rceil"])
def test_every_bf16_amax_matches_torchao(bf16_blocks, fmt, profile):
    data, scale = torchao_oracle(bf16_blocks, fmt, profile)
    q = quantize(bf16_blocks, fmt, profile)
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data.view(torch.uint8), data), first_difference(q.data, data)


@pytest.mark.parametrize("fmt", MX)
def test_rceil_is_the_exact_ceiling_for_every_bf16_amax(fmt):
    amax = positive_finite_bf16()
    emax = FORMATS[fmt].elem_max
    ref = torch.tensor([_exact_rceil_byte(a, emax) for a in amax.tolist()], dtype=torch.uint8)
    q = quantize(amax_blocks(amax, torch.bfloat16), fmt, "rceil")
    assert torch.equal(q.scale[:, 0], ref), first_difference(q.scale[:, 0], ref)


def _ulp_edge_amaxes(elem_max: float) -> torch.Tensor:
    """fp32 amaxes 1..40 ulps above elem_max * 2^k for every k: where float log2 loses the bump."""
    ks = torch.arange(-140, 125)
    base = torch.ldexp(torch.full(ks.shape, elem_max, dtype=torch.float64), ks).float()
    base = base[(base > 0) & torch.isfinite(base)]
    out, cur = [], base
    for _ in range(40):
        cur = torch.nextafter(cur, torch.tensor(float("inf")))
        out.append(cur)
    return torch.cat(out)


@pytest.mark.parametrize("fmt", MX)
def test_fp32_ulp_edges_rceil_exact_vs_torchao_float(fmt):
    """torchao's CPU RCEIL computes ceil(log2(amax / max)) in fp32 and picks the lower exponent
    just above max * 2^k; ``torchao-rceil`` reproduces that, ``rceil`` keeps the exact rule."""
    amax = _ulp_edge_amaxes(FORMATS[fmt].elem_max)
    x = amax_blocks(amax, torch.float32)
    data, scale = torchao_oracle(x, fmt, "torchao-rceil")
    q_t = quantize(x, fmt, "torchao-rceil")
    assert torch.equal(q_t.scale, scale), first_difference(q_t.scale, scale)
    assert torch.equal(q_t.data.view(torch.uint8), data), first_difference(q_t.data, data)
    q_e = quantize(x, fmt, "rceil")
    exact = torch.tensor([_exact_rceil_byte(a, FORMATS[fmt].elem_max) for a in amax.tolist()],
                         dtype=torch.uint8)
    assert torch.equal(q_e.scale[:, 0], exact)
    # the finding itself: the two rules do disagree on these inputs (and only upward)
    differ = q_e.scale[:, 0] != scale[:, 0]
    assert differ.any()
    assert torch.all(q_e.scale[:, 0][differ] == scale[:, 0][differ] + 1)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_bf16_amax_matches_modelopt_export(bf16_blocks, fmt, dtype):
    x = bf16_blocks.to(dtype)
    data, scale = modelopt_oracle(x, fmt)
    q = quantize(x, fmt, "modelopt-export")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data.view(torch.uint8), data), first_difference(q.data, data)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3"])
def test_every_bf16_amax_matches_compressed_tensors(bf16_blocks, fmt):
    # compressed-tensors is undefined once the rounded amax reaches 2^128 (float->int overflow)
    x = bf16_blocks[bf16_blocks.float().abs().amax(-1) < 1.75 * 2.0**127]
    data, scale = compressed_tensors_oracle(x, fmt)
    q = quantize(x, fmt, "compressed-tensors")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data.view(torch.uint8), data), first_difference(q.data, data)


@pytest.mark.parametrize("fmt", MX)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("profile", "version"),
                         [("triton-kernels", "gpt-oss"), ("triton-kernels-main", "main")])
def test_every_bf16_amax_matches_triton_kernels_transcription(bf16_blocks, fmt, dtype, profile,
                                                               version):
    x = bf16_blocks.to(dtype)
    data, scale = triton_kernels_reference(x, fmt, version)
    q = quantize(x, fmt, profile)
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data.view(torch.uint8), data), first_difference(q.data, data)


def test_worked_bytes_from_the_spec():
    """docs/formats.md's worked FP4 examples (OCP spec arithmetic, not read from the code)."""
    def byte(amax, profile):
        x = torch.zeros(1, 32)
        x[0, 3] = amax
        return quantize(x, "mxfp4", profile).scale.item()

    assert (byte(7.0, "floor"), byte(7.0, "rceil")) == (127, 128)
    assert (byte(6.1, "floor"), byte(6.1, "even"), byte(6.1, "rceil")) == (127, 127, 128)
    assert (byte(5.0, "ceil"), byte(5.0, "floor"), byte(5.0, "rceil"), byte(5.0, "even")) == (128, 127, 127, 127)
    assert byte(0.0, "rceil") == 0 and byte(0.0, "floor") == 0
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0  # compressed-tensors uses the FP4 threshold for MXFP8: 448 = 1.75 * 2^8 bumps
    assert quantize(x, "mxfp8_e4m3", "compressed-tensors").scale.item() == 128
    assert quantize(x, "mxfp8_e4m3", "rceil").scale.item() == 127


@pytest.mark.parametrize("fmt", MX)
def test_rceil_equals_transformer_engine_formula(fmt):
    """TE (and the cvt.rp.satfinite.ue8m0x2.f32 path of cuBLAS / torchao compiled) computes
    ``amax * fl(1/max)`` in fp32 and rounds that up to a power of two. Transcribed here in numpy
    (TE cannot be installed on this machine): it equals ``rceil`` on every bf16 amax and on fp32
    amaxes +-40 ulps around every max * 2^k. Left out: descales below 2^-126 (fp32 subnormals),
    where the byte depends on how cvt.rp treats a subnormal input (not checked on hardware)."""
    np = pytest.importorskip("numpy")
    emax = FORMATS[fmt].elem_max
    ks = torch.arange(-120, 125)
    base = torch.ldexp(torch.full(ks.shape, emax, dtype=torch.float64), ks).float()
    edges, up, down = [base], base, base
    for _ in range(40):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        edges += [up, down]
    amax = torch.cat([positive_finite_bf16(), *edges])
    amax = amax[torch.isfinite(amax) & (amax > emax * 2.0**-126)]
    a = amax.numpy()
    with np.errstate(over="ignore"):
        descale = (a * (np.float32(1.0) / np.float32(emax))).astype(np.float32)
    te = ((descale.view(np.uint32).astype(np.uint64) + 0x7FFFFF) & 0x7F800000) >> 23
    te = torch.from_numpy(np.minimum(te, 254).astype(np.uint8))  # satfinite
    q = quantize(amax_blocks(amax, torch.float32), fmt, "rceil")
    assert torch.equal(q.scale[:, 0], te), first_difference(q.scale[:, 0], te)
