"""Tier 1: element and scale encodings, bit for bit against ml_dtypes and exact arithmetic."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from workbench.formats.constants import E2M1_MAGNITUDES
from workbench.formats.elements import (
    e2m1_decode,
    e2m1_encode,
    e8m0_to_fp32,
    pack_fp4,
    unpack_fp4,
)

ml_dtypes = pytest.importorskip("ml_dtypes")
np = pytest.importorskip("numpy")


def _ml_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    arr = v.float().numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return torch.from_numpy(arr.copy()) & 0xF


def _dense_sweep() -> torch.Tensor:
    """Every multiple of 1/64 in [-7, 7] (all ties and their neighbours), plus fp32 ulp steps
    around every E2M1 boundary and grid point."""
    grid = torch.arange(-7 * 64, 7 * 64 + 1, dtype=torch.float64) / 64
    pts = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, *E2M1_MAGNITUDES]
    edges = []
    for p in pts:
        t = torch.tensor(p, dtype=torch.float32)
        lo, hi = t.clone(), t.clone()
        for _ in range(4):
            lo = torch.nextafter(lo, torch.tensor(-1.0))
            hi = torch.nextafter(hi, torch.tensor(99.0))
            edges += [lo.item(), hi.item()]
    v = torch.cat([grid.float(), torch.tensor(edges, dtype=torch.float32)])
    return torch.cat([v, -v])


def test_e2m1_decode_every_code_matches_ml_dtypes():
    codes = torch.arange(16, dtype=torch.uint8)
    ref = torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    ours = e2m1_decode(codes)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # -0.0 for 0x8 included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_e2m1_encode_dense_sweep_matches_ml_dtypes(dtype):
    v = _dense_sweep()
    v = v[v.to(dtype).float() == v]  # values exact in this dtype (no double rounding in the test)
    ours = e2m1_encode(v.to(dtype))
    ref = _ml_e2m1_codes(v)
    # ml_dtypes keeps the sign of -0.0 results: compare magnitudes and signs separately
    assert torch.equal(ours & 0x7, ref & 0x7), v[(ours & 0x7) != (ref & 0x7)][:8]
    assert torch.equal(ours >> 3, torch.signbit(v).to(torch.uint8))


def test_e2m1_saturates_like_ml_dtypes():
    v = torch.tensor([6.0, 6.5, 7.0, 1e30, float("inf"), -7.0, -float("inf")])
    assert torch.equal(e2m1_encode(v), _ml_e2m1_codes(v) | (torch.signbit(v).to(torch.uint8) << 3))


def _nearest_code(x: Fraction, ties: str) -> int:
    """Independent oracle: nearest E2M1 magnitude by exact arithmetic, explicit tie rule."""
    mags = [Fraction(m) for m in E2M1_MAGNITUDES]
    d = [abs(x - m) for m in mags]
    best = min(d)
    cands = [i for i, di in enumerate(d) if di == best]
    if len(cands) == 1:
        return cands[0]
    return {"down": cands[0], "away": cands[-1], "even": next(c for c in cands if c % 2 == 0)}[ties]


@pytest.mark.parametrize("ties", ["even", "down", "away"])
def test_e2m1_tie_rules_against_exact_arithmetic(ties):
    v = _dense_sweep()
    v = v[(v.abs() <= 6)]
    ours = e2m1_encode(v, ties=ties) & 0x7
    ref = torch.tensor([_nearest_code(Fraction(abs(x)), ties) for x in v.tolist()], dtype=torch.uint8)
    assert torch.equal(ours, ref)


def test_e8m0_every_byte_matches_ml_dtypes():
    b = torch.arange(256, dtype=torch.uint8)
    ref = torch.from_numpy(b.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    ours = e8m0_to_fp32(b)
    assert torch.isnan(ours[255]) and torch.isnan(ref[255])
    assert torch.equal(ours[:255].view(torch.int32), ref[:255].view(torch.int32))
    # the edges spelled out: 0x00 is the fp32 subnormal 2^-127, 0x7F is 1, 0xFE is 2^127
    assert ours[0].view(torch.int32).item() == 0x00400000
    assert ours[1].item() == 2.0**-126 and ours[0x7F].item() == 1.0 and ours[0xFE].item() == 2.0**127
    inf = e8m0_to_fp32(b, nan_byte="inf")
    assert torch.isinf(inf[255]) and torch.equal(inf[:255], ours[:255])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_element_casts_match_ml_dtypes(fmt):
    """MXFP8 elements are ``clamp(v, +-max).to(float8)``; the cast itself must be RNE like ml_dtypes."""
    tdt, mdt, vmax = {
        "e4m3": (torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
        "e5m2": (torch.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0),
    }[fmt]
    # every fp8 value, every midpoint between neighbours, and fp32 ulps around both
    vals = torch.arange(256, dtype=torch.uint8).view(tdt).float()
    vals = vals[torch.isfinite(vals)].unique()
    mids = (vals[1:].double() + vals[:-1].double()) / 2
    v = torch.cat([vals, mids.float()])
    v = torch.cat([v, torch.nextafter(v, v + 1), torch.nextafter(v, v - 1)]).clamp(-vmax, vmax)
    ours = v.to(tdt).view(torch.uint8)
    ref = torch.from_numpy(v.numpy().astype(mdt).view(np.uint8).copy())
    assert torch.equal(ours, ref)


def test_pack_layout_matches_torchao_and_roundtrips():
    from torchao.prototype.mx_formats.kernels import pack_uint4

    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(packed, pack_uint4(codes))  # element 2i in the low nibble
    assert torch.equal(packed[..., 0] & 0xF, codes[..., 0])
    assert torch.equal(unpack_fp4(packed), codes)
    odd = pack_fp4(codes[..., 1:63])  # storage offset 1: the strided fallback
    assert torch.equal(unpack_fp4(odd), codes[..., 1:63])
    with pytest.raises(ValueError, match="odd number"):
        pack_fp4(codes[..., :3])
