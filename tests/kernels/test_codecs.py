"""Triton codecs == the reference codecs of workbench.formats, bit for bit (NaN payloads aside).

On CPU these run under the Triton interpreter (few, big programs); on a GPU the same tests run
the compiled kernels and compare them with the reference run on the CPU (the spec). The `gpu`
tests add big random tensors and every supported recipe on 3-D per-expert stacks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need Triton (the gpu extra)")

from workbench import formats as F
from workbench import kernels as K

from .inputs import assert_same_bits, gaussian, specials

RECIPES = [(fmt, p) for fmt, profs in K.SUPPORTED.items() for p in profs]
# the brief's required set (ceil rides along, it is one integer rule more)
CORE = [r for r in RECIPES if r[1] != "ceil"]


def _compare(x: torch.Tensor, fmt: str, profile: str, device: str, **kw):
    ref_fq = F.fake_quantize(x, fmt, profile, **kw)
    ref_q = F.quantize(x, fmt, profile, **kw)
    xd = x.to(device)
    kw_d = {k: v.to(device) for k, v in kw.items()}
    got_fq = K.fake_quantize(xd, fmt, profile, **kw_d).cpu()
    got_q = K.quantize(xd, fmt, profile, **kw_d)
    tag = f"{fmt}:{profile} {x.dtype} {tuple(x.shape)}"
    assert_same_bits(got_fq, ref_fq, f"{tag} fake_quantize")
    # float8 data compares as bytes too: NaN bytes are written as torch's CPU cast writes them
    assert_same_bits(got_q.data.cpu().view(torch.uint8), ref_q.data.view(torch.uint8),
                     f"{tag} data")
    assert_same_bits(got_q.scale.cpu().view(torch.uint8), ref_q.scale.view(torch.uint8),
                     f"{tag} scale")
    if ref_q.global_scale is not None:
        assert_same_bits(got_q.global_scale.cpu(), ref_q.global_scale, f"{tag} global")
        assert_same_bits(got_q.library_global.cpu(), ref_q.library_global, f"{tag} library")
        # a kernel-quantized tensor decodes like the reference's own
        assert_same_bits(F.dequantize(got_q, x.dtype).cpu(), ref_fq, f"{tag} dequantize")
    assert got_q.shape == ref_q.shape and got_q.fmt == ref_q.fmt


@pytest.mark.parametrize("fmt,profile", RECIPES, ids=[f"{f}:{p}" for f, p in RECIPES])
def test_specials_bf16(fmt, profile, device):
    _compare(specials(8, 512), fmt, profile, device)


@pytest.mark.parametrize("fmt,profile", RECIPES, ids=[f"{f}:{p}" for f, p in RECIPES])
def test_finite_edges_bf16(fmt, profile, device):
    # no NaN/inf anywhere: fake quantization takes the kernels' short path on every tile
    x = torch.nan_to_num(specials(8, 512, seed=2), nan=1.5, posinf=3e38, neginf=-2e38)
    assert torch.isfinite(x).all()
    _compare(x, fmt, profile, device)
    _compare(gaussian((2, 8, 256), seed=4), fmt, profile, device)


@pytest.mark.parametrize("fmt,profile", [("mxfp4", "floor"), ("mxfp8_e4m3", "rceil"),
                                         ("mxfp8_e5m2", "even"), ("nvfp4", "te"),
                                         ("nvfp4", "torchao")])
def test_specials_fp32(fmt, profile, device):
    _compare(specials(4, 512, torch.float32, seed=3), fmt, profile, device)


@pytest.mark.parametrize("profile", ["torchao", "te"])
def test_nvfp4_per_expert_global(profile, device):
    x = gaussian((3, 16, 256), seed=5)
    amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
    _compare(x, "nvfp4", profile, device, global_amax=amax)


def _no_round_trip_amax() -> float:
    """An fp32 amax that (amax / 2688) * 2688 does not give back (about 15% do not)."""
    for k in range(1, 1000):
        a = torch.tensor(1.0 + k * 12345 * 2.0**-23, dtype=torch.float32)
        if not torch.equal((a / 2688.0) * 2688.0, a):
            return float(a)
    raise AssertionError("no such amax found")


@pytest.mark.parametrize("profile", ["torchao", "te"])
def test_nvfp4_fp32_decodes_with_the_stored_global(profile, device):
    # fp32 outputs show the decode's last bits, which bf16 outputs round away; the amax is one
    # whose decode-direction round trip loses an ulp, so decoding from anything but the
    # library's own global (TE: the amax) shows up here
    x = gaussian((2, 16, 256), dtype=torch.float32, seed=12)
    x = x / x.abs().amax() * 0.5
    x[0, 0, 0] = _no_round_trip_amax()
    _compare(x, "nvfp4", profile, device)


def _expert_stack(seed: int) -> torch.Tensor:
    """[4, 16, 256] experts: a NaN and an inf in expert 1, an all-zero block in expert 2, a
    tiny expert 3 (its scaled values near the bottom of the e4m3 scale range)."""
    x = gaussian((4, 16, 256), seed=seed)
    x[1, 3, 17], x[1, 9, 200] = float("nan"), float("inf")
    x[2, 5, 32:48] = 0.0
    x[3] *= 2.0**-110
    return x


@pytest.mark.parametrize("profile", ["torchao", "te"])
def test_nvfp4_short_and_exact_tiles(profile, device, monkeypatch):
    # 16-block tiles under the interpreter (256 on a GPU): tiles holding specials take the
    # exact path and the others the short path in one launch; both must equal the reference
    monkeypatch.setattr(K.api, "_INTERPRET_MAX_NB", 16)
    x = _expert_stack(seed=7)
    # a finite global amax (as a calibrated one would be), so the specials stay in their blocks
    amax = torch.nan_to_num(x, nan=0.0, posinf=0.0).abs().amax(dim=(-2, -1), keepdim=True)
    _compare(x, "nvfp4", profile, device, global_amax=amax.float())
    finite = torch.nan_to_num(x, nan=0.5, posinf=2.0)
    _compare(finite, "nvfp4", profile, device,
             global_amax=finite.abs().amax(dim=(-2, -1), keepdim=True).float())
    # experts of 30 blocks: program tiles straddle experts (per-block global scalars)
    odd = gaussian((3, 10, 48), seed=8)
    _compare(odd, "nvfp4", profile, device,
             global_amax=odd.abs().amax(dim=(-2, -1), keepdim=True).float())


@pytest.mark.parametrize("profile", ["torchao", "te"])
def test_fake_quantize_experts_equals_amax_then_quantize(profile, device, monkeypatch):
    # 16-block tiles under the interpreter: [4, 16, 256] has 16 tiles per expert; 30 and 40
    # blocks per expert end in a partial tile (tiles straddle experts); one expert alone
    monkeypatch.setattr(K.api, "_INTERPRET_MAX_NB", 16)
    cases = [_expert_stack(seed=9), gaussian((3, 10, 48), seed=10),
             gaussian((2, 5, 128), seed=12), gaussian((1, 8, 64), seed=13)]
    if device == "cuda":  # the GPU's tiles: 64 per expert, several amax chunks
        cases.append(gaussian((6, 256, 512), seed=14) * torch.arange(1, 7).view(6, 1, 1))
    for x in cases:
        amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
        want = F.fake_quantize(x, "nvfp4", profile, global_amax=amax)
        got = K.fake_quantize_experts(x.to(device), "nvfp4", profile)
        assert_same_bits(got.cpu(), want, f"nvfp4:{profile} {tuple(x.shape)}")
    # no global scale in MX: the same as fake_quantize
    y = gaussian((2, 8, 64), seed=11)
    assert_same_bits(K.fake_quantize_experts(y.to(device), "mxfp4").cpu(),
                     F.fake_quantize(y, "mxfp4"), "mxfp4")
    with pytest.raises(ValueError, match="stack"):
        K.fake_quantize_experts(y[0, 0].to(device), "nvfp4")


@pytest.mark.parametrize("fmt,profile", CORE, ids=[f"{f}:{p}" for f, p in CORE])
def test_out_dtype_is_one_rounding_of_the_same_values(fmt, profile, device):
    # the fp32 fake quantization of x (widened), rounded once to out_dtype: an fp32 master
    # fake-quantized straight into bf16 equals the fp32 result cast (the autocast GEMM's
    # operand); a bf16 input written as fp32 keeps NVFP4's unrounded values
    x32 = torch.cat([gaussian((2, 16, 256), dtype=torch.float32, seed=21),
                     specials(32, 256, torch.float32, seed=22).view(2, 16, 256)])
    x16 = gaussian((2, 16, 256), seed=23)
    for x, out in ((x32, torch.bfloat16), (x16, torch.float32)):
        want = F.fake_quantize(x.float(), fmt, profile).to(out)
        got = K.fake_quantize(x.to(device), fmt, profile, out_dtype=out).cpu()
        assert_same_bits(got, want, f"{fmt}:{profile} {x.dtype} -> {out}")
    if fmt == "nvfp4":  # the per-expert amax path
        fin = x32[:2]
        amax = fin.abs().amax(dim=(-2, -1), keepdim=True).float()
        want = F.fake_quantize(fin, fmt, profile, global_amax=amax).to(torch.bfloat16)
        got = K.fake_quantize_experts(fin.to(device), fmt, profile, out_dtype=torch.bfloat16)
        assert_same_bits(got.cpu(), want, f"{fmt}:{profile} experts -> bf16")
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        K.fake_quantize(x16.to(device), fmt, profile, out_dtype=torch.float64)


def test_global_amax_matches_torch(device):
    x = specials(6, 256, with_nan=False).reshape(3, 2, 256)
    x[1, 0, 3] = float("nan")
    got = K.global_amax(x.to(device), per_leading=True, ignore_nan=False).cpu()
    want = x.abs().amax(dim=(-2, -1), keepdim=True).float()
    assert_same_bits(got, want, "propagating")
    got = K.global_amax(x.to(device), per_leading=False, ignore_nan=True).cpu()
    want = torch.where(torch.isnan(x), 0, x.abs()).amax().float()
    assert_same_bits(got, want, "ignoring NaN")


def test_rejects_what_it_does_not_serve(device):
    x = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(NotImplementedError, match="modelopt-export"):
        K.fake_quantize(x, "mxfp4", "modelopt-export")
    with pytest.raises(ValueError, match="cannot be blocked"):
        K.fake_quantize(x[:, :48], "mxfp4")
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        K.quantize(x.to(torch.float64), "nvfp4")
    assert K.supports("mxfp4:rceil") and not K.supports("nvfp4:compressed-tensors")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,profile", CORE, ids=[f"{f}:{p}" for f, p in CORE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_random_3d(fmt, profile, dtype):
    for seed in range(3):
        x = gaussian((4, 96, 1024), dtype=dtype, seed=seed)
        _compare(x, fmt, profile, "cuda")
        _compare(specials(64, 1024, dtype, seed=seed), fmt, profile, "cuda")
    if fmt == "nvfp4":
        amax = x.abs().amax(dim=(-2, -1), keepdim=True).float()
        _compare(x, fmt, profile, "cuda", global_amax=amax)
