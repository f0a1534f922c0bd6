"""The batched and fused paths of all three questions against the reference, on the held-in
checkpoints of every layout (each written by its own library: tests/checkpoint/oracles.py) and
the analysis test checkpoints, with recipes of every format.

Counts (zero, clip and mismatch fractions, scale histograms), ``max_abs_err`` and ``amax`` must be
equal; rel_err, sqnr_db and cosine come from float sums taken in another order (fp32 reductions
per expert vs fp32 BLAS dots), so they may differ in the last digits (1e-5 relative allowed).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import LIBRARY_LAYOUTS as LAYOUTS
from analysis_ckpts import moe_weights, write_dense, write_mxfp4

from workbench.analysis import candidate_errors, paths, reference_errors, stored_vs_recipes
from workbench.checkpoint import open_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))

FROM_SUMS = ("rel_err", "sqnr_db", "cosine")
RECIPES = ["mxfp4:rceil", "mxfp4:floor", "nvfp4:torchao", "nvfp4:compressed-tensors",
           "nvfp4:te", "mxfp8_e4m3:rceil", "mxfp8_e4m3:floor"]



NO_GRID = {"fp8-block"}  # a codec workbench.formats does not model: question 3 has no rows


def assert_tables_equal(ref, got, what, empty=False):
    a, b = ref.experts, got.experts
    assert (len(a) == 0) == empty, what
    assert list(a.columns) == list(b.columns) and len(a) == len(b), what
    for col in a.columns:
        if col in FROM_SUMS:
            x, y = a[col].tolist(), b[col].tolist()
            for i, (u, v) in enumerate(zip(x, y)):
                if math.isinf(u) or math.isnan(u):
                    assert u == v or (math.isnan(u) and math.isnan(v)), (what, col, i, u, v)
                else:
                    assert v == pytest.approx(u, rel=1e-5, abs=1e-12), (what, col, i, u, v)
        else:
            assert a[col].fillna(-1).tolist() == b[col].fillna(-1).tolist(), (what, col)
    pd.testing.assert_frame_equal(ref.scales, got.scales, check_exact=True, obj=str(what))


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, tmp_path_factory):
    """(checkpoint, dense BF16 reference of its routed experts)."""
    module, write = LAYOUTS[request.param]
    pytest.importorskip(module, reason=f"{module} writes this checkpoint (pip install -e .[dev])")
    import oracles

    root = tmp_path_factory.mktemp(request.param)
    o = write(oracles, root / "ck")
    sd = {f"model.layers.{L}.mlp.experts.{e}.{p}_proj.weight": w.bfloat16()
          for (L, e, p), w in o.experts.items()}
    return request.param, open_checkpoint(o.path), open_checkpoint(write_dense(root / "ref", sd))


def _small_ckpts(tmp_path):
    sd = moe_weights(layers=2, experts=4, hidden=96, ffn=64)
    mx = open_checkpoint(write_mxfp4(tmp_path / "mx", sd, "mxfp4:ceil"))
    return mx, open_checkpoint(write_dense(tmp_path / "bf16", sd))


# the stack readers the batched path runs with on CPU: "auto" (the per-member path there) and
# the window reader (CUDA's default), forced
READERS = ("auto", "window")


def test_batched_stored_vs_recipes_every_layout(layout, monkeypatch):
    from workbench.analysis import fast

    name, ck, _ = layout
    ref = stored_vs_recipes(ck, RECIPES, progress=False, path="reference")
    for reader in READERS:
        monkeypatch.setattr(fast, "READER", reader)
        assert_tables_equal(ref, stored_vs_recipes(ck, RECIPES, progress=False, path="batched"),
                            (name, "batched", reader), empty=name in NO_GRID)


def test_batched_candidate_errors_every_layout(layout, monkeypatch):
    from workbench.analysis import fast

    name, ck, _ = layout
    ref = candidate_errors(ck, RECIPES, progress=False, path="reference")
    for reader in READERS:
        monkeypatch.setattr(fast, "READER", reader)
        assert_tables_equal(ref, candidate_errors(ck, RECIPES, progress=False, path="batched"),
                            (name, "batched", reader))


def test_batched_reference_errors_every_layout(layout, monkeypatch):
    from workbench.analysis import fast

    name, ck, dense = layout
    ref = reference_errors(ck, dense, kinds=("routed",), progress=False, path="reference")
    for reader in READERS:
        monkeypatch.setattr(fast, "READER", reader)
        got = reference_errors(ck, dense, kinds=("routed",), progress=False, path="batched")
        assert_tables_equal(ref, got, (name, "batched", reader))


FUSED_RECIPES = ["mxfp4:rceil", "nvfp4:torchao", "mxfp8_e4m3:rceil"]  # one per format


# Layouts whose fused tests also compile the graphs (Inductor C++): one NVFP4 and one MXFP8 stored
# grid, with recipes of every format. The other layouts run the same graph functions eagerly:
# what is particular to a layout is how its grids reach the pass (read, stacked, NVFP4 globals,
# row maps), which the eager run checks as well; that Inductor's code equals the eager graph is
# test_compiled.py's subject (every scale, sign and tie rule, on edge inputs). Compiling every
# layout's graphs cost about 45 cold compiles, a third of the suite's time on a fresh machine.
COMPILED_LAYOUTS = {"ct-nvfp4", "modelopt-mxfp8"}


def _count_compiled(monkeypatch, layout: str) -> dict[str, int]:
    """How many stacks the compiled passes served, per entry point (each still the real one);
    outside COMPILED_LAYOUTS the passes' graphs run uncompiled."""
    from workbench.analysis import compiled, fused_fp8, fused_nvfp4

    if layout not in COMPILED_LAYOUTS:
        monkeypatch.setattr(compiled, "_run", lambda key, build, args: build()(*args))
        for closed_form in (fused_fp8, fused_nvfp4):  # fused.py's closed forms for FP8 / NVFP4
            monkeypatch.setattr(closed_form, "_run", lambda key, build, args: build()(*args))

    # every (question, format) pair through the compiled graphs, also where "fused" would keep
    # the batched path because it measured faster (compiled.FASTER)
    monkeypatch.setattr(compiled, "EVERYWHERE", True)
    served = {"recipe_rows": 0, "reference_rows": 0}
    for name in served:
        real = getattr(compiled, name)

        def spy(*a, _real=real, _name=name, **k):
            out = _real(*a, **k)
            served[_name] += out is not None
            return out

        monkeypatch.setattr(compiled, name, spy)
    return served


def _stored_fmt(ck) -> str | None:
    fmts = {getattr(ck.recipe_of(r.name), "fmt", None) for r in ck.expert_records()}
    return fmts.pop() if len(fmts) == 1 else None


@pytest.mark.inductor_cpp
def test_fused_candidate_errors_every_layout(layout, monkeypatch):
    """path="fused", question 1 with a recipe of every format: the compiled passes (stored grid
    decoded in the graph, or the BF16 weights of a codec workbench.formats does not model) give
    the reference's table, and they did serve it."""
    name, ck, _ = layout
    served = _count_compiled(monkeypatch, name)
    ref = candidate_errors(ck, FUSED_RECIPES, progress=False, path="reference")
    assert_tables_equal(ref, candidate_errors(ck, FUSED_RECIPES, progress=False, path="fused"),
                        (name, "fused"))
    # MXFP4 grids under the MXFP4 recipe take fused.py's closed form; everything else compiled
    assert served["recipe_rows"] > 0, (name, served)


@pytest.mark.inductor_cpp
def test_fused_reference_errors_every_layout(layout, monkeypatch):
    name, ck, dense = layout
    served = _count_compiled(monkeypatch, name)
    ref = reference_errors(ck, dense, kinds=("routed",), progress=False, path="reference")
    got = reference_errors(ck, dense, kinds=("routed",), progress=False, path="fused")
    assert_tables_equal(ref, got, (name, "fused"))
    # every stored grid is decoded and measured in the compiled pass (fp8-block: no grid)
    assert (served["reference_rows"] > 0) == (name not in NO_GRID), (name, served)


@pytest.mark.inductor_cpp
def test_fused_path_every_layout(layout, monkeypatch):
    """path="fused": the closed forms where they apply (a grid under a recipe of its own
    format), the compiled pass elsewhere; the table is still the reference's."""
    from workbench.analysis import fused

    name, ck, _ = layout
    served = []
    real = fused.stored_vs_recipe
    monkeypatch.setattr(fused, "stored_vs_recipe",
                        lambda gs, r: served.append(str(r)) or real(gs, r))
    compiled = _count_compiled(monkeypatch, name)
    recipes = FUSED_RECIPES
    ref = stored_vs_recipes(ck, recipes, progress=False, path="reference")
    assert_tables_equal(ref, stored_vs_recipes(ck, recipes, progress=False, path="fused"),
                        (name, "fused"), empty=name in NO_GRID)
    # a closed form served the recipe of the stored grid's own format, the compiled pass every
    # other (grid, recipe) pair
    fmt = _stored_fmt(ck)
    assert set(served) == {r for r in recipes if r.split(":")[0] == fmt}, (name, served)
    assert (compiled["recipe_rows"] > 0) == (name not in NO_GRID), (name, compiled)


def test_small_checkpoints_all_questions_and_small_batches(tmp_path, monkeypatch):
    """Batches of one to three weights (the batch limit cuts same-shape groups), dense layers,
    shared experts, and a dense (BF16) checkpoint under candidate recipes."""
    from workbench.analysis import fast

    mx, bf16 = _small_ckpts(tmp_path)
    plan = fast.Plan.default
    try:
        # windows of 8 KB (a member is 3.2 KB): two each, cut mid-layer (the window reader)
        fast.Plan.default = classmethod(lambda cls, dev, w=None: cls(3 * 64 * 96, 2, 2, 8192))
        for q, args in (("stored", (mx, RECIPES)), ("candidate-packed", (mx, RECIPES)),
                        ("candidate-dense", (bf16, RECIPES)), ("reference", (mx, bf16))):
            fn = {"stored": stored_vs_recipes, "reference": reference_errors}.get(
                q, candidate_errors)
            ref = fn(*args, progress=False, path="reference")
            for reader in READERS:
                monkeypatch.setattr(fast, "READER", reader)
                assert_tables_equal(ref, fn(*args, progress=False, path="batched"), (q, reader))
    finally:
        fast.Plan.default = plan


def test_tables_show_errors_and_mismatches(tmp_path):
    """The comparisons above must see non-trivial numbers: lossy rows, scale and code
    mismatches, clipped elements (FP8 floor rules clip) and several exponents per weight."""
    mx, bf16 = _small_ckpts(tmp_path)
    t = stored_vs_recipes(mx, RECIPES, progress=False, path="batched").experts
    assert (t.rel_err > 0).any() and (t.code_mismatch_frac > 0).any()
    assert (t.scale_mismatch_frac > 0).any()
    c = candidate_errors(bf16, RECIPES, progress=False, path="batched")
    assert (c.experts.clip_frac > 0).any() and (c.experts.zero_frac > 0).any()
    assert c.scales.groupby(["layer", "expert", "proj", "recipe"]).size().max() > 1


def test_path_choice_is_explicit_logged_and_overridable(tmp_path, monkeypatch, caplog):
    mx, _ = _small_ckpts(tmp_path)
    monkeypatch.delenv(paths.ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="workbench.analysis.paths"):
        stored_vs_recipes(mx, ["mxfp4:floor"], progress=False, device="cpu")
    assert "stored grid vs recipes: batched path on cpu (default on CPU below" in caplog.text
    big = paths.choose_path("auto", torch.device("cpu"), paths.COMPILE_ELEMENTS, "q")
    assert big.path == "fused"
    assert paths.choose_path("auto", torch.device("cuda"), 1, "q").path == "batched"
    monkeypatch.setenv(paths.ENV, "reference")
    assert paths.choose_path("auto", torch.device("cpu"), 1, "q").path == "reference"
    assert paths.choose_path("batched", torch.device("cpu"), 1, "q").path == "batched"
    monkeypatch.setenv(paths.ENV, "fast")
    with pytest.raises(ValueError, match=paths.ENV):
        paths.choose_path("auto", torch.device("cpu"), 1, "q")
    with pytest.raises(ValueError, match="path must be one of"):
        stored_vs_recipes(mx, ["mxfp4"], progress=False, path="quick")


def test_reference_lacking_a_weight_is_named(tmp_path):
    """Question 2 with a reference that lacks one of the checkpoint's weights: a ValueError
    naming the reference and the weight, on every path."""
    sd = moe_weights(layers=2, experts=4, hidden=96, ffn=64)
    mx = open_checkpoint(write_mxfp4(tmp_path / "mx", sd, "mxfp4:ceil"))
    sd.pop("model.layers.1.mlp.experts.2.down_proj.weight")
    ref = open_checkpoint(write_dense(tmp_path / "bf16", sd))
    for path in ("reference", "batched"):
        with pytest.raises(ValueError, match=r"bf16 lacks 1 weights .*'L1\.routed\.E2\.down'"):
            reference_errors(mx, ref, progress=False, path=path)
