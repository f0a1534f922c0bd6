"""The fused CPU path of ``stored_vs_recipes`` against the plain-torch reference.

Counts (zero, clip and mismatch fractions, histograms), ``max_abs_err`` and ``amax`` must be
equal. The three metrics built from float sums (rel_err, sqnr_db, cosine) may differ in the last
digits: the reference sums fp32 products with BLAS dots in one order, the fused path in chunks of
4096 in another (then in float64), so only summation order separates them.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from analysis_ckpts import moe_weights, write_mxfp4

from workbench import analysis
from workbench.analysis import Session, fused, stored_vs_recipes
from workbench.analysis.fused_common import mag_e2m1, round_e2m1
from workbench.analysis.metrics import error_metrics, grid_mismatch, scale_exponents
from workbench.analysis.session import eager
from workbench.checkpoint import open_checkpoint
from workbench.formats import dequantize, parse_recipe, quantize
from workbench.formats.constants import E2M1_MAGNITUDES
from workbench.formats.elements import e2m1_decode, e2m1_encode, e2m1_magnitude_code
from workbench.formats.mx_profiles import PROFILES

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from oracles import heavy_tailed  # edge cases: a zero block, -0.0, ties, outliers

EXACT = ("max_abs_err", "amax", "clip_frac", "zero_frac", "scale_mismatch_frac",
         "code_mismatch_frac")
FROM_SUMS = ("rel_err", "sqnr_db", "cosine")
MX4 = sorted(p for p, prof in PROFILES.items() if "mxfp4" in prof.formats)


def reference(stored, recipe):
    w = dequantize(stored, torch.bfloat16)
    q = quantize(w, recipe, pad=True)
    m = error_metrics(w, dequantize(q, torch.float32), q)
    m.update(grid_mismatch(stored, q))
    exps, counts = torch.unique(scale_exponents(q).flatten(), return_counts=True)
    return m, dict(zip(exps.tolist(), counts.tolist()))


def fused_hist(res):
    return {1000 if b == 255 else b - 127: int(res.byte_counts[b])
            for b in res.byte_counts.nonzero().flatten().tolist()}


def assert_same(got: dict, want: dict, what):
    for k in EXACT:
        assert got[k] == want[k], (what, k, got[k], want[k])
    for k in FROM_SUMS:
        if math.isinf(want[k]):
            assert got[k] == want[k], (what, k)
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-12), (what, k)


def grids(stored_profile="compressed-tensors"):
    """Stored MXFP4 grids written by several scale rules (so re-quantizing changes scales and
    codes), with the edge cases of ``heavy_tailed``."""
    g = torch.Generator().manual_seed(7)
    out = []
    for enc, shape in (("even", (64, 256)), ("ceil", (32, 128)), ("floor", (96, 64)),
                       ("triton-kernels", (16, 512))):
        w = heavy_tailed(shape, g).bfloat16()
        out.append(replace(quantize(w, f"mxfp4:{enc}"), profile=stored_profile))
    return out


@pytest.mark.parametrize("ties", fused.TIES)
def test_round_e2m1_equals_the_reference_rounding_on_every_bf16_value(ties):
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16)  # +0 .. largest finite
    x = bits.view(torch.bfloat16)
    want = torch.tensor(E2M1_MAGNITUDES)[e2m1_magnitude_code(x, ties).long()]
    got = round_e2m1(x.float(), ties)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (x[bad[:5]].tolist(), got[bad[:5]].tolist(), want[bad[:5]].tolist())


def test_magnitudes_without_a_table():
    assert mag_e2m1(torch.arange(8, dtype=torch.float32)).tolist() == list(E2M1_MAGNITUDES)


@pytest.fixture
def uncompiled():
    """A session whose graphs run uncompiled (same code, no compile cost): covers every
    profile."""
    return Session(compiler=eager)


@pytest.fixture(scope="module")
def compiling():
    """One session for this module's compiled tests: each tie rule compiles once."""
    return Session()


@pytest.mark.parametrize("stored_profile", ["compressed-tensors", "transformers"])
def test_every_mxfp4_profile_uncompiled(uncompiled, stored_profile):
    gs = grids(stored_profile)
    for name in MX4:
        r = parse_recipe(f"mxfp4:{name}")
        assert fused.static_reason(r, torch.device("cpu")) is None, name
        got = fused.stored_vs_recipe(uncompiled, gs, r)
        for g, res in zip(gs, got):
            want, hist = reference(g, r)
            assert_same(res.metrics, want, (name, g.shape))
            assert fused_hist(res) == hist, name


@pytest.mark.inductor_cpp
def test_compiled_equals_reference(compiling):
    gs = grids()
    # one call for several grids of different sizes, padded to whole chunks internally
    for name in ("rceil", "ceil", "floor", "even", "compressed-tensors"):
        r = parse_recipe(f"mxfp4:{name}")
        got = fused.stored_vs_recipe(compiling, gs, r)
        assert got is not None, compiling.broken
        for g, res in zip(gs, got):
            want, hist = reference(g, r)
            assert_same(res.metrics, want, (name, g.shape))
            assert fused_hist(res) == hist, name
    # the comparison must see errors and mismatches, not only lossless re-quantization
    ceil = fused.stored_vs_recipe(compiling, gs, parse_recipe("mxfp4:ceil"))
    assert max(x.metrics["rel_err"] for x in ceil) > 0
    assert max(x.metrics["code_mismatch_frac"] for x in ceil) > 0


@pytest.mark.slow
@pytest.mark.inductor_cpp
@pytest.mark.parametrize("name", ["triton-kernels", "modelopt-export"])
def test_compiled_other_tie_rules(compiling, name):
    gs, r = grids(), parse_recipe(f"mxfp4:{name}")
    for g, res in zip(gs, fused.stored_vs_recipe(compiling, gs, r)):
        want, hist = reference(g, r)
        assert_same(res.metrics, want, (name, g.shape))
        assert fused_hist(res) == hist


def test_clip_count_when_a_rule_picks_too_small_a_scale():
    """No MX rule clips a decoded MXFP4 grid, so drive the fused function with a table that
    picks one binade too small and count clipped elements independently (E2M1 encode/decode of
    the reference elements module)."""
    g = grids()[0]
    byte, s, _, _ = fused.block_tables("compressed-tensors", "rceil")
    smaller = byte.clamp(min=2) - 1
    lut = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127).float()
    tables = (smaller, s, s * (1 / lut)[smaller.long()], lut[smaller.long()])
    n = g.scale.numel()
    data = torch.cat([g.data.reshape(n, 16), torch.zeros(-n % fused.CHUNK, 16, dtype=torch.uint8)])
    sb = torch.cat([g.scale.reshape(n), torch.full((-n % fused.CHUNK,), 127, dtype=torch.uint8)])
    *_, part = fused._fused("even")(data.view(-1, fused.CHUNK, 16), sb.view(-1, fused.CHUNK),
                                    *tables)
    clipped = int(torch.stack(part)[[8, 16]].sum())
    w = dequantize(g, torch.float32).reshape(n, 32)
    cmax = torch.stack([g.data & 7, (g.data >> 4) & 7], -1).reshape(n, 32).amax(-1).long()
    b = smaller[cmax * 256 + g.scale.reshape(n).long()].long()  # the byte the table picks
    v = w * torch.ldexp(torch.ones(n), 127 - b).unsqueeze(-1)
    codes = e2m1_encode(v)
    deq = e2m1_decode(codes) * torch.ldexp(torch.ones(n), b - 127).unsqueeze(-1)
    want = int((((codes & 7) == 7) & (w.abs() > deq.abs())).sum())
    assert want > 0 and clipped == want


def _ckpt(tmp_path):
    sd = moe_weights(layers=2, experts=4, hidden=128, ffn=64)
    tiny = "model.layers.1.mlp.experts.2.up_proj.weight"  # scale bytes below SAFE_BYTES
    return open_checkpoint(write_mxfp4(tmp_path / "ck", sd, "mxfp4:ceil", {tiny: 2.0**-70}))


@pytest.mark.inductor_cpp
def test_stored_vs_recipes_fused_equals_reference(tmp_path, caplog, compiling):
    ck = _ckpt(tmp_path)
    recipes = ["mxfp4:rceil", "mxfp4:ceil", "nvfp4:torchao"]
    ref = stored_vs_recipes(ck, recipes, progress=False, path="reference")
    p = analysis.plan("stored_vs_recipes", ck, recipes, path="fused", device="cpu",
                      session=compiling)
    assert p.passes("mxfp4", "mxfp4:rceil")[0] == "closed form"
    assert p.passes("mxfp4", "nvfp4:torchao") == ("batched",)
    with caplog.at_level(logging.INFO, logger="workbench.analysis.fused_common"):
        got = stored_vs_recipes(ck, recipes, progress=False, plan=p, session=compiling)
    assert "batched path (scale bytes" in caplog.text  # the weight scaled by 2^-70
    a, b = ref.experts, got.experts
    assert list(a.columns) == list(b.columns) and len(a) == len(b) == 3 * len(ck.expert_records())
    for col in a.columns:
        if col in FROM_SUMS:
            assert b[col].tolist() == pytest.approx(a[col].tolist(), rel=1e-5), col
        else:
            assert a[col].fillna(-1).tolist() == b[col].fillna(-1).tolist(), col
    assert ref.scales.equals(got.scales)


@pytest.mark.inductor_cpp
def test_grids_with_all_zero_blocks_stay_fused(compiling):
    """Libraries write byte 0 (2^-127) for an all-zero block; such blocks decode to exact zeros
    under any finite scale, so only blocks with a non-zero code must have a safe byte."""
    g = grids()[0]
    assert fused.grid_reason(g) is None  # heavy_tailed has an all-zero block
    sc = g.scale.clone()
    zero = ((g.data.reshape(-1, 16) & 0x77).amax(-1) == 0).nonzero().flatten()
    assert zero.numel() > 0
    sc.view(-1)[zero] = 0
    assert fused.grid_reason(replace(g, scale=sc)) is None
    res = fused.stored_vs_recipe(compiling, [replace(g, scale=sc)], parse_recipe("mxfp4:rceil"))[0]
    want, hist = reference(replace(g, scale=sc), parse_recipe("mxfp4:rceil"))
    assert_same(res.metrics, want, "zero blocks at byte 0")
    assert fused_hist(res) == hist
    live = ((g.data.reshape(-1, 16) & 0x77).amax(-1) != 0).nonzero().flatten()[:1]
    sc.view(-1)[live] = 0  # one block with a code under byte 0: not exact here any more
    assert fused.grid_reason(replace(g, scale=sc)).startswith("scale bytes outside")


@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_a_failed_compile_falls_back_to_the_reference(tmp_path, caplog):
    """A real compile failure (Inductor pointed at a C++ compiler that does not exist): the
    table is still the reference's, the failure is the session's, and a plan made from that
    session routes no stack to a closed form."""
    import torch._inductor.config as inductor_config

    ck = _ckpt(tmp_path)
    ref = stored_vs_recipes(ck, ["mxfp4:ceil"], progress=False, path="reference").experts
    s = Session()
    torch._dynamo.reset()  # compiled code of earlier tests would be reused without compiling
    try:
        with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",), "force_disable_caches": True}), \
                caplog.at_level(logging.INFO, logger="workbench.analysis.fused"):
            got = stored_vs_recipes(ck, ["mxfp4:ceil"], progress=False, path="fused",
                                    session=s).experts
    finally:
        torch._dynamo.reset()
    assert "fused analysis unavailable, using the batched path" in caplog.text
    assert "fused" in s.broken
    p = analysis.plan("stored_vs_recipes", ck, ["mxfp4:ceil"], path="fused", session=s)
    assert p.passes("mxfp4", "mxfp4:ceil") == ("batched",)
    assert got.drop(columns=list(FROM_SUMS)).equals(ref.drop(columns=list(FROM_SUMS)))
