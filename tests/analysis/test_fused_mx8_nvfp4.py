"""The closed-form passes for MXFP8 (``fused_fp8``) and NVFP4 (``fused_nvfp4``) grids re-quantized
in their own format, against the plain-torch reference (``metrics.error_metrics`` +
``grid_mismatch`` on ``quantize(dequantize(stored))``).

Counts, histograms, ``max_abs_err`` and ``amax`` must be equal; rel_err, sqnr_db and cosine come
from float sums in another order (1e-5 relative allowed). The pass functions run uncompiled
(``eager``: the same graph functions, no compile cost) for every profile pair; one test per
format compiles them. The grids are synthetic so that every element code, every scale byte of
the served range, ties, clipping and all-zero blocks occur; the library-written checkpoints of
every layout go through ``stored_vs_recipes`` at the end.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from analysis_ckpts import LIBRARY_LAYOUTS

from workbench import analysis
from workbench.analysis import Session, fused, fused_fp8, stored_vs_recipes
from workbench.analysis.fused_common import round_e2m1
from workbench.analysis.metrics import error_metrics, grid_mismatch, scale_exponents
from workbench.analysis.session import eager as eager_compiler
from workbench.checkpoint import open_checkpoint
from workbench.formats import QuantizedTensor, dequantize, parse_recipe, quantize
from workbench.formats.constants import E2M1_MAGNITUDES
from workbench.formats.elements import e2m1_magnitude_code, pack_fp4
from workbench.formats.mx_profiles import PROFILES as MX_PROFILES
from workbench.formats.nvfp4 import to_library_global
from workbench.formats.nvfp4_profiles import PROFILES as NV_PROFILES

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))

EXACT = ("max_abs_err", "amax", "clip_frac", "zero_frac", "scale_mismatch_frac",
         "code_mismatch_frac")
FROM_SUMS = ("rel_err", "sqnr_db", "cosine")
MX8 = ("mxfp8_e4m3", "mxfp8_e5m2")


def mx8_profiles(fmt):
    return sorted(p for p, prof in MX_PROFILES.items() if fmt in prof.formats)


def reference(stored, recipe):
    w = dequantize(stored, torch.bfloat16)
    q = quantize(w, recipe, pad=True)
    m = error_metrics(w, dequantize(q, torch.float32), q)
    m.update(grid_mismatch(stored, q))
    exps, counts = torch.unique(scale_exponents(q).flatten(), return_counts=True)
    return m, list(zip(exps.tolist(), counts.tolist())), q


def assert_same(res, stored, recipe, what):
    assert res is not None, what
    want, hist, _ = reference(stored, recipe)
    got = res.metrics
    assert set(got) == set(want), what
    for k in EXACT:
        assert got[k] == want[k], (what, k, got[k], want[k])
    for k in FROM_SUMS:
        if math.isinf(want[k]):
            assert got[k] == want[k], (what, k)
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-12), (what, k)
    assert res.histogram() == hist, what
    return want


@pytest.fixture
def eager():
    """A session whose graphs run uncompiled (the closed forms' graph functions, no compile)."""
    return Session(compiler=eager_compiler)


@pytest.fixture(scope="module")
def compiling():
    """One session for this module's compiled tests."""
    return Session()


# -- element arithmetic ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", MX8)
def test_fp8_magnitudes_are_torchs_decode_of_every_finite_code(fmt):
    el = fused_fp8.ELEMS[fmt.split("_")[1]]
    codes = torch.arange(el.finite_codes, dtype=torch.uint8)
    assert torch.equal(fused_fp8.mag_fp8(codes, el), codes.view(el.dtype).float())


@pytest.mark.parametrize("fmt", MX8)
def test_fp8_rounding_is_the_clamp_and_cast_on_every_code_times_every_shift(fmt):
    """Every finite magnitude times 2^k, k over every shift a block can see (and beyond):
    torch's own clamp + float8 cast, as ``mx.quantize_mx`` does it, is the reference."""
    el = fused_fp8.ELEMS[fmt.split("_")[1]]
    m = torch.arange(el.finite_codes, dtype=torch.uint8).view(el.dtype).float()
    k = torch.arange(-30, 31, dtype=torch.float32)
    v = (m[:, None] * torch.exp2(k)[None, :]).reshape(-1)
    want = v.clamp(max=el.max).to(el.dtype).float()
    got = fused_fp8.round_fp8(v, el)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (v[bad[:5]].tolist(), got[bad[:5]].tolist(), want[bad[:5]].tolist())
    # the domain holds ties of the subnormal grid, and values above the maximum
    step = 2.0**el.step_exp
    assert bool(((v < el.min_normal) & ((v * step) % 1 == 0.5)).any()) and bool((v > el.max).any())


def test_e2m1_rounding_on_fp32_values_around_every_boundary():
    """NVFP4's scaled values are any fp32 (not BF16 values as MXFP4's): every boundary, its
    fp32 neighbours, and a dense sweep, against the reference ``e2m1_magnitude_code``."""
    mags = torch.tensor(E2M1_MAGNITUDES)
    bounds = (mags[1:] + mags[:-1]) / 2
    near = torch.cat([bounds, torch.nextafter(bounds, torch.tensor(0.0)),
                      torch.nextafter(bounds, torch.tensor(9.0)), mags])
    sweep = torch.rand(1 << 20, generator=torch.Generator().manual_seed(0)) * 8
    v = torch.cat([near, sweep, torch.tensor([0.0, 7.0, 100.0])])
    want = mags[e2m1_magnitude_code(v, "even").long()]
    assert torch.equal(round_e2m1(v, "even"), want)


# -- MXFP8 -----------------------------------------------------------------------------------


def mx8_grid(fmt, profile, seed=0):
    """Every finite element code (both signs) and every safe scale byte; per block a random
    largest code, so that every scale rule sees varied amaxes; an all-zero block under byte 0
    and one under 127 (what libraries write for them)."""
    el = fused_fp8.ELEMS[fmt.split("_")[1]]
    g = torch.Generator().manual_seed(seed)
    lo, hi = fused_fp8.SAFE_BYTES
    rows = 2 * (hi - lo + 1)
    nb = 8  # blocks per row: K = 256
    top = torch.randint(1, el.finite_codes, (rows, nb, 1), generator=g)
    codes = (torch.rand(rows, nb, 32, generator=g) * (top + 1)).long().clamp_max(top)
    codes[:, :, 0] = top[:, :, 0]
    codes[0, 0] = torch.arange(32)  # the small codes (subnormals) in one block ...
    codes[1, 0] = torch.arange(el.finite_codes - 32, el.finite_codes)  # ... the large ones,
    codes[1, 0, :8] = torch.arange(8)  # with subnormals beside the maximum: rules that bump
    # the scale at the maximum (compressed-tensors) put these on the subnormal grid, with ties
    sign = (torch.rand(rows, nb, 32, generator=g) < 0.5).long() << 7
    data = (codes | sign).to(torch.uint8)
    scale = torch.arange(lo, hi + 1).repeat(2).reshape(rows, 1).expand(rows, nb).clone()
    data[2, 3], data[3, 5] = 0, 0x80  # all-zero blocks, +0 and -0 codes
    scale[2, 3], scale[3, 5] = 0, 127
    scale = scale.to(torch.uint8)
    return QuantizedTensor(fmt, profile, data.reshape(rows, nb * 32).view(el.dtype), scale,
                           None, (rows, nb * 32))


@pytest.mark.parametrize("fmt", MX8)
def test_mxfp8_every_profile_pair_uncompiled(eager, fmt):
    seen = {"clip": 0, "code": 0, "scale": 0, "zero": 0}
    for sp in mx8_profiles(fmt):
        gs = [mx8_grid(fmt, sp, 0), mx8_grid(fmt, sp, 1)]  # two grids in one call
        for g in gs:
            assert fused.grid_reason(g, parse_recipe(fmt)) is None
        for rp in mx8_profiles(fmt):
            r = parse_recipe(f"{fmt}:{rp}")
            assert fused.static_reason(r, torch.device("cpu")) is None
            for g, res in zip(gs, fused.stored_vs_recipe(eager, gs, r)):
                want = assert_same(res, g, r, (sp, rp))
                for k, col in (("clip", "clip_frac"), ("code", "code_mismatch_frac"),
                               ("scale", "scale_mismatch_frac"), ("zero", "zero_frac")):
                    seen[k] += want[col] > 0
    # the comparison saw clipped elements (E4M3 floor rules clip; E5M2's maximum has the
    # largest mantissa, so nothing clips there), code and scale mismatches, zero codes
    assert seen["code"] and seen["scale"] and seen["zero"], seen
    assert bool(seen["clip"]) == (fmt == "mxfp8_e4m3"), seen


def test_mxfp8_grids_hold_subnormal_ties():
    """The synthetic grid must reach the subnormal rounding and its ties: a recipe whose byte is
    above the stored one (compressed-tensors rounds amax 448 = 1.75 * 2^8 up to 2^9) scales
    the elements down onto the subnormal grid."""
    fmt = "mxfp8_e4m3"
    el = fused_fp8.ELEMS["e4m3"]
    g = mx8_grid(fmt, "rceil")
    _, _, q = reference(g, parse_recipe(f"{fmt}:compressed-tensors"))
    shift = (g.scale.int() - q.scale.int()).repeat_interleave(32, -1).float()
    v = g.data.float().abs() * torch.exp2(shift)
    ties = (v < el.min_normal) & ((v * 2.0**el.step_exp) % 1 == 0.5)
    assert int(ties.sum()) > 0


@pytest.mark.inductor_cpp
def test_mxfp8_compiled_equals_reference(compiling):
    fmt = "mxfp8_e4m3"
    gs = [mx8_grid(fmt, "modelopt-export", 0), mx8_grid(fmt, "modelopt-export", 2)]
    for rp in ("rceil", "floor"):
        r = parse_recipe(f"{fmt}:{rp}")
        got = fused.stored_vs_recipe(compiling, gs, r)
        assert got is not None, compiling.broken
        for g, res in zip(gs, got):
            assert_same(res, g, r, rp)


def test_mxfp8_fallbacks_are_explained(eager, caplog):
    fmt = "mxfp8_e4m3"
    r = parse_recipe(f"{fmt}:rceil")
    g = mx8_grid(fmt, "rceil")
    sc = g.scale.clone()
    sc[0, 0] = fused_fp8.SAFE_BYTES[0] - 1  # a live block below the range
    assert fused.grid_reason(replace(g, scale=sc), r).startswith("scale bytes outside")
    sc = g.scale.clone()
    sc[2, 3] = 255  # NaN scale on an all-zero block: NaN decodes
    assert fused.grid_reason(replace(g, scale=sc), r).startswith("scale bytes outside")
    assert fused.grid_reason(g, parse_recipe("mxfp8_e5m2:rceil")).startswith("mxfp8_e4m3 grid")
    padded = replace(g, shape=(g.shape[0], g.shape[1] - 3))
    assert fused.grid_reason(padded, r) == "padded last dimension"
    data = g.data.view(torch.uint8).clone()
    data[4, 7] = 0x7F  # a NaN element: found inside the pass, that grid is handed back
    nan = replace(g, data=data.view(torch.float8_e4m3fn))
    with caplog.at_level(logging.INFO, logger="workbench.analysis.fused_common"):
        res = fused.stored_vs_recipe(eager, [g, nan], r)
    assert res[1] is None and "NaN or inf element codes" in caplog.text
    assert_same(res[0], g, r, "the grid beside it")


# -- NVFP4 -----------------------------------------------------------------------------------


def nv_grid(profile, seed=0, global_decode=2.0**-7):
    """Every element code (both signs) under every positive finite E4M3 scale byte (0x00 ..
    0x7E), a random largest code per block, all-zero blocks; the global in the library's form."""
    g = torch.Generator().manual_seed(seed)
    rows, nb = 2 * 127, 8
    top = torch.randint(1, 8, (rows, nb, 1), generator=g)
    codes = (torch.rand(rows, nb, 16, generator=g) * (top + 1)).long().clamp_max(top)
    codes[:, :, 0] = top[:, :, 0]
    codes[0, 0] = torch.arange(16) & 7
    codes |= (torch.rand(rows, nb, 16, generator=g) < 0.5).long() << 3
    codes[5, 2] = 0
    codes[6, 1] = 8  # -0 codes only
    scale = torch.arange(127).repeat(2).reshape(rows, 1).expand(rows, nb).clone()
    scale = scale[torch.randperm(rows, generator=g)]
    gd = torch.tensor(global_decode)
    return QuantizedTensor("nvfp4", profile, pack_fp4(codes.reshape(rows, nb * 16)),
                           scale.to(torch.uint8).view(torch.float8_e4m3fn), gd,
                           (rows, nb * 16), to_library_global(gd, profile))


def test_nvfp4_every_profile_pair_uncompiled(eager):
    seen = {"clip": 0, "code": 0, "scale": 0, "zero": 0}
    for sp in NV_PROFILES:
        # a synthetic grid, and a grid the stored profile wrote from real-looking weights
        w = (torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
        gs = [nv_grid(sp, 0), quantize(w, f"nvfp4:{sp}")]
        for rp in NV_PROFILES:
            r = parse_recipe(f"nvfp4:{rp}")
            assert fused.static_reason(r, torch.device("cpu")) is None
            for g, res in zip(gs, fused.stored_vs_recipe(eager, gs, r)):
                assert fused.grid_reason(g, r) is None
                want = assert_same(res, g, r, (sp, rp, g.shape))
                for k, col in (("clip", "clip_frac"), ("code", "code_mismatch_frac"),
                               ("scale", "scale_mismatch_frac"), ("zero", "zero_frac")):
                    seen[k] += want[col] > 0
    assert all(seen.values()), seen


def tie_grid():
    """A grid whose re-quantized values hit E2M1 midpoints exactly: torchao, global 1; one
    block at 6 * 448 fixes the recipe's global at 1 too; blocks of scale 1.5 whose largest
    code is 4 get the recipe scale 1.0, so code 0.5 scales to 0.75, a tie (rounded to 1.0)."""
    codes = torch.zeros(4, 32, dtype=torch.long)
    codes[0, :16] = 7
    codes[1:, :] = torch.tensor([6, 1, 2, 3] * 8)
    scale = torch.full((4, 2), 0x3C, dtype=torch.uint8)  # 1.5
    scale[0, 0] = 0x7E  # 448
    one = torch.tensor(1.0)
    g = QuantizedTensor("nvfp4", "torchao", pack_fp4(codes), scale.view(torch.float8_e4m3fn),
                        one, (4, 32), one)
    r = parse_recipe("nvfp4:torchao")
    _, _, q = reference(g, r)
    w = dequantize(g, torch.float32)
    v = w / (q.scale.float() * q.global_scale).repeat_interleave(16, -1)
    assert int(((v.abs() * 2) % 1 == 0.5).sum()) > 0  # 0.75: between 0.5 and 1.0
    return g, r


def test_nvfp4_ties_uncompiled(eager):
    g, r = tie_grid()
    want = assert_same(fused.stored_vs_recipe(eager, [g], r)[0], g, r, "ties")
    assert want["code_mismatch_frac"] > 0  # the tie went to the even code, away from 0.5


@pytest.mark.inductor_cpp
def test_nvfp4_compiled_equals_reference(compiling):
    gs = [nv_grid("compressed-tensors", 0), nv_grid("compressed-tensors", 1, 2.0**-3)]
    r = parse_recipe("nvfp4:torchao")
    got = fused.stored_vs_recipe(compiling, gs, r)
    assert got is not None, compiling.broken
    for g, res in zip(gs, got):
        assert_same(res, g, r, g.global_scale)


def test_nvfp4_fallbacks_are_explained(eager, caplog):
    r = parse_recipe("nvfp4:torchao")
    g = nv_grid("torchao")
    sb = g.scale.view(torch.uint8).clone()
    sb[0, 0] = 0x81  # a negative scale
    assert fused.grid_reason(replace(g, scale=sb.view(torch.float8_e4m3fn)), r).startswith(
        "negative or NaN")
    sb[0, 0] = 0x7F  # NaN
    assert fused.grid_reason(replace(g, scale=sb.view(torch.float8_e4m3fn)), r).startswith(
        "negative or NaN")
    inf = torch.tensor(float("inf"))
    assert fused.grid_reason(replace(g, global_scale=inf, library_global=inf), r).startswith(
        "global scale")
    assert fused.grid_reason(replace(g, shape=(g.shape[0], g.shape[1] - 5)), r) == \
        "padded last dimension"
    assert fused.grid_reason(g, parse_recipe("mxfp4:rceil")).startswith("nvfp4 grid")
    # known only after the first pass: decoded values too small, or an all-zero weight
    tiny = nv_grid("torchao", global_decode=2.0**-45)
    zero = replace(g, data=torch.zeros_like(g.data))
    with caplog.at_level(logging.INFO, logger="workbench.analysis.fused_common"):
        res = fused.stored_vs_recipe(eager, [tiny, g, zero], r)
    assert res[0] is None and res[2] is None
    assert "decoded weights outside 2^-50..2^50 (or all zero)" in caplog.text
    assert_same(res[1], g, r, "the grid between them")


# -- library-written checkpoints ---------------------------------------------------------------

# the held-in layouts that store MXFP8 or NVFP4 grids (analysis_ckpts.LIBRARY_LAYOUTS)
GRID_LAYOUTS = {"ct-nvfp4": "nvfp4", "modelopt-nvfp4": "nvfp4", "modelopt-mxfp8": "mxfp8_e4m3"}


@pytest.mark.parametrize("name", sorted(GRID_LAYOUTS))
def test_library_checkpoints_every_profile(eager, tmp_path, caplog, name):
    """``stored_vs_recipes(path="fused")`` on each library's own checkpoint, with every profile
    of the stored format: the plan routes every recipe to the closed form, no stack fell back
    (a fallback says why), and the table is the reference's."""
    from test_fast_paths import assert_tables_equal

    module, write = LIBRARY_LAYOUTS[name]
    pytest.importorskip(module, reason=f"{module} writes this checkpoint (pip install -e .[dev])")
    import oracles

    ck = open_checkpoint(write(oracles, tmp_path / "ck").path)
    fmt = GRID_LAYOUTS[name]
    assert {ck.recipe_of(r.name).fmt for r in ck.expert_records()} == {fmt}
    recipes = [f"{fmt}:{p}" for p in (mx8_profiles(fmt) if fmt != "nvfp4" else NV_PROFILES)]
    p = analysis.plan("stored_vs_recipes", ck, recipes, path="fused", device="cpu", session=eager)
    assert all(p.passes(fmt, r)[0] == "closed form" for r in recipes), str(p)
    ref = stored_vs_recipes(ck, recipes, progress=False, path="reference")
    with caplog.at_level(logging.INFO, logger="workbench.analysis"):
        got = stored_vs_recipes(ck, recipes, progress=False, plan=p, session=eager)
    assert_tables_equal(ref, got, (name, "fused"))
    assert eager.calls > 0 and not eager.broken
    fell = [r.getMessage() for r in caplog.records if r.name.startswith("workbench.analysis")
            and ("batched path (" in r.getMessage() or r.levelno >= logging.WARNING)]
    assert not fell, fell
