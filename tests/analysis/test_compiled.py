"""The compiled CPU passes (``compiled.py``) against the plain-torch reference, per profile.

Each expert of a stack is checked against the reference's own 2-D computation
(``quantize(w, recipe, pad=True)`` + ``error_metrics`` + ``grid_mismatch`` + the
``scale_exponents`` histogram): counts, maxima and histograms equal; the float-sum metrics to
1e-5 (the pass sums fp32 per row, then float64; the reference takes fp32 BLAS dots). The data
has the edge cases of ``oracles.heavy_tailed`` (zero and -0.0 blocks, tiny negatives, exact
E2M1 ties, amax in (6, 8) * 2^k, outliers), a last dim that needs padding, and, for every
format, stored grids written by another profile (so re-quantizing changes scales and codes).

Every profile runs through the pass uncompiled (same graph code, no compile cost: this guards
the metric, mismatch and histogram logic); the compiled tests cover one profile per scale rule,
sign rule and tie rule, where Inductor's code must give the eager codec's bytes.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from workbench import analysis
from workbench.analysis import Session, batched, compiled
from workbench.analysis.metrics import error_metrics, grid_mismatch, scale_exponents
from workbench.analysis.session import eager
from workbench.checkpoint.stacks import stack_grids
from workbench.formats import dequantize, parse_recipe, quantize
from workbench.formats.mx_profiles import PROFILES as MX_PROFILES
from workbench.formats.nvfp4_profiles import PROFILES as NV_PROFILES

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
from oracles import heavy_tailed

EXACT = ("max_abs_err", "amax", "clip_frac", "zero_frac", "scale_mismatch_frac",
         "code_mismatch_frac")
FROM_SUMS = ("rel_err", "sqnr_db", "cosine")
EVERY = ([f"mxfp4:{p}" for p, v in MX_PROFILES.items() if "mxfp4" in v.formats]
         + [f"mxfp8_e4m3:{p}" for p, v in MX_PROFILES.items() if "mxfp8_e4m3" in v.formats]
         + [f"nvfp4:{p}" for p in NV_PROFILES])
# one per scale rule / sign rule / tie rule / NVFP4 library (compiled: seconds each)
COMPILED = ["mxfp4:floor", "mxfp4:even", "mxfp4:modelopt-export", "mxfp4:triton-kernels",
            "mxfp4:compressed-tensors", "mxfp8_e4m3:rceil", "mxfp8_e4m3:floor",
            "mxfp8_e4m3:torchao-rceil",
            pytest.param("mxfp8_e4m3:compressed-tensors", marks=pytest.mark.xfail(
                strict=True, reason="compiled clip counts differ from eager on decoded grids: "
                "compiled.recipe_reason keeps this recipe batched")),
            "nvfp4:torchao", "nvfp4:te",
            "nvfp4:modelopt-export", "nvfp4:compressed-tensors"]
STORED = ["mxfp4:triton-kernels", "mxfp8_e4m3:modelopt-export", "nvfp4:compressed-tensors",
          "nvfp4:te"]  # the stored grids' writers (the readers are the same profiles)


def stack(shape=(48, 96), n=3, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # experts differ in scale (so NVFP4 globals differ per expert)
    return torch.stack([(heavy_tailed(shape, g).float() * 2.0**e).bfloat16() for e in range(n)])


def reference_row(w, recipe, stored=None):
    q = quantize(w, recipe, pad=True)
    m = error_metrics(w, dequantize(q, torch.float32), q)
    if stored is not None and recipe.fmt == stored.fmt and q.scale.shape == stored.scale.shape:
        m.update(grid_mismatch(stored, q))
    exps, counts = torch.unique(scale_exponents(q).flatten(), return_counts=True)
    return m, list(zip(exps.tolist(), counts.tolist()))


def assert_same(got: dict, want: dict, what):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for k in EXACT:
        if k in want:
            assert got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])), \
                (what, k, got[k], want[k])
    for k in FROM_SUMS:
        if math.isinf(want[k]) or math.isnan(want[k]):
            assert got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])), (what, k)
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-12), (what, k)


def stored_stack(writer: str, w: torch.Tensor):
    """Per-expert stored grids of ``w`` by ``writer`` (NVFP4: a global per expert) and their
    stack, as the stack readers build it."""
    grids = [quantize(x, writer, pad=True) for x in w]
    return grids, stack_grids(grids)


def check_recipe(session: Session, recipe_name: str, shape=(48, 96)):
    r = parse_recipe(recipe_name)
    w = stack(shape)
    rows = compiled.recipe_rows(session, w, None, r)
    assert rows is not None, session.broken
    for e, row in enumerate(rows):
        want, hist = reference_row(w[e], r)
        assert_same(row.metrics, want, (recipe_name, "dense", e))
        assert row.hist == hist, (recipe_name, e)
    for writer in STORED:
        grids, st = stored_stack(writer, w)
        rows = compiled.recipe_rows(session, None, st, r)
        for e, (g, row) in enumerate(zip(grids, rows)):
            want, hist = reference_row(dequantize(g, torch.bfloat16), r, g)
            assert_same(row.metrics, want, (recipe_name, writer, e))
            assert row.hist == hist, (recipe_name, writer, e)


def check_reference(session: Session, writer: str, shape=(48, 96)):
    ref = stack(shape, seed=1)
    grids, st = stored_stack(writer, ref)
    got = compiled.reference_rows(session, ref, st)
    assert got is not None, session.broken
    for e, (g, m) in enumerate(zip(grids, got)):
        assert_same(m, error_metrics(ref[e], dequantize(g, torch.bfloat16), g), (writer, e))


@pytest.fixture
def uncompiled():
    """A session whose graph functions run eagerly (same code, no compile cost)."""
    return Session(compiler=eager)


@pytest.fixture(scope="module")
def compiling():
    """One session for this module's compiled tests: a graph compiled once serves them all."""
    return Session()


@pytest.mark.parametrize("recipe", EVERY)
def test_every_profile_uncompiled(uncompiled, recipe):
    check_recipe(uncompiled, recipe)


@pytest.mark.parametrize("writer", STORED + ["mxfp4:compressed-tensors", "nvfp4:torchao"])
def test_reference_rows_uncompiled(uncompiled, writer):
    check_reference(uncompiled, writer)


@pytest.mark.inductor_cpp
@pytest.mark.parametrize("recipe", COMPILED)
def test_compiled_recipe_rows(compiling, recipe):
    check_recipe(compiling, recipe, shape=(32, 80))  # 80: MX pads to 96


@pytest.mark.inductor_cpp
@pytest.mark.parametrize("writer", STORED)
def test_compiled_reference_rows(compiling, writer):
    check_reference(compiling, writer, shape=(32, 80))


def test_the_comparisons_see_clipping_mismatches_and_several_exponents(uncompiled):
    """The checks above must compare non-trivial numbers: clipped elements (FLOOR clips), zero
    codes, scale and code mismatches against another writer's grid, several exponents."""
    w = stack()
    rows = compiled.recipe_rows(uncompiled, w, None, parse_recipe("mxfp4:floor"))
    assert any(r.metrics["clip_frac"] > 0 for r in rows)
    assert all(r.metrics["zero_frac"] > 0 and len(r.hist) > 1 for r in rows)
    _, st = stored_stack("nvfp4:te", w)
    rows = compiled.recipe_rows(uncompiled, None, st, parse_recipe("nvfp4:torchao"))
    assert any(0 < r.metrics["code_mismatch_frac"] for r in rows)
    assert any(0 < r.metrics["scale_mismatch_frac"] for r in rows)


def test_non_finite_and_cuda_stacks_take_the_batched_path(tmp_path):
    w = stack()
    assert compiled.finite_reason(w, None) is None
    bad = w.clone()
    bad[1, 0, 0] = float("nan")
    assert compiled.finite_reason(bad, None) == "non-finite weights"
    _, st = stored_stack("mxfp4:rceil", w)
    st.scale[0, 0, 0] = 0xFF
    assert compiled.finite_reason(None, st) == "E8M0 NaN scale bytes"
    from analysis_ckpts import moe_weights, write_dense

    from workbench.checkpoint import open_checkpoint

    ck = open_checkpoint(write_dense(tmp_path / "bf16", moe_weights(layers=1, experts=2)))
    p = analysis.plan("candidate_errors", ck, ["nvfp4:torchao"], path="fused", device="cuda",
                      compiled="all")
    assert p.passes(None, "nvfp4:torchao") == ("batched",) and "cuda tensors" in str(p)


def test_fractions_are_exact_count_ratios_on_every_path(uncompiled):
    """clip_frac and scale_mismatch_frac are integer counts over n in float64 (numpy counts them
    here), not an fp32 mean, whose last bit depends on the device: the reference, the batched
    and the compiled pass give the same float."""
    import numpy as np

    from workbench.formats.elements import unpack_fp4

    w = stack(shape=(48, 96), n=2)
    r = parse_recipe("mxfp4:floor")  # FLOOR clips
    q = quantize(w[0], r)
    deq = dequantize(q, torch.float32)
    codes = unpack_fp4(q.data).numpy()
    clipped = ((codes & 7) == 7) & (np.abs(w[0].float().numpy()) > np.abs(deq.numpy()))
    want = int(clipped.sum()) / clipped.size
    assert 0 < want and float(np.float32(want)) != want  # an fp32 mean: another float
    assert error_metrics(w[0], deq, q)["clip_frac"] == want
    assert batched.stack_metrics(w, dequantize(quantize(w, r), torch.float32),
                                 quantize(w, r))[0]["clip_frac"] == want
    assert compiled.recipe_rows(uncompiled, w, None, r)[0].metrics["clip_frac"] == want
    other = quantize(w[0], "mxfp4:rceil")
    diff = (q.scale.numpy() != other.scale.numpy())
    want = int(diff.sum()) / diff.size
    assert 0 < want and float(np.float32(want)) != want
    assert grid_mismatch(other, q)["scale_mismatch_frac"] == want


def _served(session: Session) -> set[str]:
    """The recipes whose compiled-pass graphs ran in ``session`` (keyed by kind, then recipe)."""
    return {k[1] for f, k in session.seconds if f == "compiled" and k[0] == "recipe"}


def test_fused_path_takes_the_compiled_pass_only_where_it_measured_faster(tmp_path):
    """Without compiled="all", path="fused" runs the compiled graphs only for the pairs in
    FASTER: a BF16 checkpoint under an NVFP4 recipe is compiled, under an MXFP4 recipe batched."""
    from analysis_ckpts import moe_weights, write_dense

    from workbench.analysis import candidate_errors
    from workbench.checkpoint import open_checkpoint

    assert ("recipe", None, "nvfp4") in compiled.FASTER
    assert ("recipe", None, "mxfp4") not in compiled.FASTER
    ck = open_checkpoint(write_dense(tmp_path / "bf16", moe_weights(layers=1, experts=2)))
    s = Session(compiler=eager)
    t = candidate_errors(ck, ["mxfp4:rceil", "nvfp4:torchao"], progress=False, path="fused",
                         device="cpu", session=s)
    assert _served(s) == {"nvfp4:torchao"}, s.seconds
    assert t.plan.passes(None, "mxfp4:rceil") == ("batched",)


def test_reference_errors_skip_the_finite_check_where_batched_is_taken(tmp_path, caplog):
    """An MXFP4 grid against its BF16 reference is not in FASTER: path="fused" takes it batched
    without the full isfinite pass over the reference (finite_reason) that only the compiled pass
    needs: a reference with a NaN says nothing of non-finite weights; with the compiled pass
    asked for everywhere, it does, and that stack goes batched."""
    import pandas as pd
    from analysis_ckpts import moe_weights, write_dense, write_mxfp4

    from workbench.analysis import reference_errors
    from workbench.checkpoint import open_checkpoint

    assert ("reference", "mxfp4", None) not in compiled.FASTER
    sd = moe_weights(layers=1, experts=2, shared=False, dense_layer=False)
    ck = open_checkpoint(write_mxfp4(tmp_path / "q", sd))
    sd["model.layers.0.mlp.experts.1.up_proj.weight"][0, 0] = float("nan")
    ref = open_checkpoint(write_dense(tmp_path / "ref", sd))
    with caplog.at_level(logging.INFO, logger="workbench.analysis.compiled"):
        df = reference_errors(ck, ref, progress=False, path="fused", device="cpu",
                              session=Session(compiler=eager)).experts
    assert len(df) == 2 * 3 and "non-finite" not in caplog.text, caplog.text
    want = reference_errors(ck, ref, progress=False, path="reference").experts
    pd.testing.assert_frame_equal(df, want, check_exact=False, rtol=1e-5)  # sums: order only
    p = analysis.plan("reference_errors", ck, ref, path="fused", device="cpu", compiled="all")
    with caplog.at_level(logging.INFO, logger="workbench.analysis.compiled"):
        every = reference_errors(ck, ref, progress=False, plan=p,
                                 session=Session(compiler=eager)).experts
    assert "stored vs reference: batched path (non-finite weights)" in caplog.text
    pd.testing.assert_frame_equal(every, want, check_exact=False, rtol=1e-5)


def test_recipes_the_compiled_pass_does_not_serve(tmp_path):
    """compiled.recipe_reason names compressed-tensors' MXFP8 rule, and path="fused" (every graph
    allowed) then computes that recipe batched, still equal to the reference."""
    from analysis_ckpts import moe_weights, write_mxfp4

    from workbench.analysis import stored_vs_recipes
    from workbench.checkpoint import open_checkpoint

    assert compiled.recipe_reason(parse_recipe("mxfp8_e4m3:compressed-tensors")) is not None
    assert compiled.recipe_reason(parse_recipe("mxfp8_e4m3:rceil")) is None
    sd = moe_weights(layers=1, experts=2, dense_layer=False, shared=False)
    ck = open_checkpoint(write_mxfp4(tmp_path / "mx", sd))
    recipes = ["mxfp8_e4m3:compressed-tensors", "nvfp4:torchao"]
    s = Session(compiler=eager)
    p = analysis.plan("stored_vs_recipes", ck, recipes, path="fused", device="cpu",
                      compiled="all", session=s)
    assert p.passes("mxfp4", "mxfp8_e4m3:compressed-tensors") == ("batched",)
    assert "compressed-tensors MXFP8 sign rule" in str(p)
    got = stored_vs_recipes(ck, recipes, progress=False, plan=p, session=s)
    want = stored_vs_recipes(ck, recipes, progress=False, path="reference")
    assert _served(s) == {"nvfp4:torchao"}, s.seconds
    for col in ("clip_frac", "zero_frac", "max_abs_err", "amax"):
        assert got.experts[col].tolist() == want.experts[col].tolist(), col
