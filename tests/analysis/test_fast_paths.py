"""The batched and fused paths of all three questions against the reference, on the held-in
checkpoints of every layout (each written by its own library: tests/checkpoint/oracles.py) and
the analysis test checkpoints, with recipes of every format.

Counts (zero, clip and mismatch fractions, scale histograms), ``max_abs_err`` and ``amax`` must be
equal; rel_err, sqnr_db and cosine come from float sums taken in another order (fp32 reductions
per expert vs fp32 BLAS dots), so they may differ in the last digits (1e-5 relative allowed).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch
from analysis_ckpts import LIBRARY_LAYOUTS as LAYOUTS
from analysis_ckpts import moe_weights, write_dense, write_mxfp4

from workbench import analysis
from workbench.analysis import Session, candidate_errors, plans, reference_errors, stored_vs_recipes
from workbench.analysis.session import eager
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
# the window reader (CUDA's default), each asked for by the plan
READERS = ("auto", "window")


def batched(fn, ck, other, reader: str, **kw):
    """``fn`` (a table function) on the batched path with ``reader``, through an explicit plan."""
    kinds = {"kinds": kw.pop("kinds")} if "kinds" in kw else {}
    p = analysis.plan(fn.__name__, ck, other, path="batched", reader=reader, **kinds)
    assert p.path == "batched" and p.reads.reader == (reader if reader != "auto" else
                                                      p.reads.reader)
    return fn(ck, other, plan=p, progress=False, **kinds, **kw)


def test_batched_stored_vs_recipes_every_layout(layout):
    name, ck, _ = layout
    ref = stored_vs_recipes(ck, RECIPES, progress=False, path="reference")
    for reader in READERS:
        assert_tables_equal(ref, batched(stored_vs_recipes, ck, RECIPES, reader),
                            (name, "batched", reader), empty=name in NO_GRID)


def test_batched_candidate_errors_every_layout(layout):
    name, ck, _ = layout
    ref = candidate_errors(ck, RECIPES, progress=False, path="reference")
    for reader in READERS:
        assert_tables_equal(ref, batched(candidate_errors, ck, RECIPES, reader),
                            (name, "batched", reader))


def test_batched_reference_errors_every_layout(layout):
    name, ck, dense = layout
    ref = reference_errors(ck, dense, kinds=("routed",), progress=False, path="reference")
    for reader in READERS:
        got = batched(reference_errors, ck, dense, reader, kinds=("routed",))
        assert_tables_equal(ref, got, (name, "batched", reader))


FUSED_RECIPES = ["mxfp4:rceil", "nvfp4:torchao", "mxfp8_e4m3:rceil"]  # one per format


# Layouts whose fused tests also compile the graphs (Inductor C++): one NVFP4 and one MXFP8 stored
# grid, with recipes of every format. The other layouts run the same graph functions eagerly:
# what is particular to a layout is how its grids reach the pass (read, stacked, NVFP4 globals,
# row maps), which the eager run checks as well; that Inductor's code equals the eager graph is
# test_compiled.py's subject (every scale, sign and tie rule, on edge inputs). Compiling every
# layout's graphs cost about 45 cold compiles, a third of the suite's time on a fresh machine.
COMPILED_LAYOUTS = {"ct-nvfp4", "modelopt-mxfp8"}


def _session(layout: str) -> Session:
    """Outside COMPILED_LAYOUTS the passes' graphs run uncompiled."""
    return Session() if layout in COMPILED_LAYOUTS else Session(compiler=eager)


def _fused(fn, ck, other, session: Session, **kw):
    """``fn`` on the fused path with every (question, format) pair through the compiled graphs,
    also where "fused" would keep the batched path because it measured faster
    (``compiled.FASTER``)."""
    kinds = {"kinds": kw.pop("kinds")} if "kinds" in kw else {}
    p = analysis.plan(fn.__name__, ck, other, path="fused", device="cpu", compiled="all",
                      session=session, **kinds)
    return fn(ck, other, plan=p, session=session, progress=False, **kinds, **kw)


def _served(session: Session, family: str, kind: str | None = None) -> set:
    """The keys of the graphs of ``family`` whose calls returned in ``session`` (the compiled
    pass keys its graphs by question kind first, then the recipe)."""
    return {k for f, k in session.seconds if f == family and (kind is None or k[0] == kind)}


def _closed_form_format(key) -> str:
    """The stored (and recipe) format of a closed form's graph, from its key."""
    if isinstance(key, str):
        return "mxfp4"  # fused.py keys its graph by the MXFP4 tie rule
    return "nvfp4" if key[0].startswith("nvfp4") else key[1]


def _stored_fmt(ck) -> str | None:
    fmts = {getattr(ck.recipe_of(r.name), "fmt", None) for r in ck.expert_records()}
    return fmts.pop() if len(fmts) == 1 else None


@pytest.mark.inductor_cpp
def test_fused_candidate_errors_every_layout(layout):
    """path="fused", question 1 with a recipe of every format: the compiled passes (stored grid
    decoded in the graph, or the BF16 weights of a codec workbench.formats does not model) give
    the reference's table, and they did serve it."""
    name, ck, _ = layout
    s = _session(name)
    ref = candidate_errors(ck, FUSED_RECIPES, progress=False, path="reference")
    assert_tables_equal(ref, _fused(candidate_errors, ck, FUSED_RECIPES, s), (name, "fused"))
    # MXFP4 grids under the MXFP4 recipe take fused.py's closed form; everything else compiled
    assert _served(s, "compiled", "recipe"), (name, s)


@pytest.mark.inductor_cpp
def test_fused_reference_errors_every_layout(layout):
    name, ck, dense = layout
    s = _session(name)
    ref = reference_errors(ck, dense, kinds=("routed",), progress=False, path="reference")
    got = _fused(reference_errors, ck, dense, s, kinds=("routed",))
    assert_tables_equal(ref, got, (name, "fused"))
    # every stored grid is decoded and measured in the compiled pass (fp8-block: no grid)
    assert bool(_served(s, "compiled", "reference")) == (name not in NO_GRID), (name, s)


@pytest.mark.inductor_cpp
def test_fused_path_every_layout(layout):
    """path="fused": the closed forms where they apply (a grid under a recipe of its own
    format), the compiled pass elsewhere; the table is still the reference's."""
    name, ck, _ = layout
    s = _session(name)
    ref = stored_vs_recipes(ck, FUSED_RECIPES, progress=False, path="reference")
    got = _fused(stored_vs_recipes, ck, FUSED_RECIPES, s)
    assert_tables_equal(ref, got, (name, "fused"), empty=name in NO_GRID)
    # a closed form served the recipe of the stored grid's own format, the compiled pass every
    # other (grid, recipe) pair (and any stack the closed form handed on, e.g. a padded one)
    fmt = _stored_fmt(ck)
    assert {_closed_form_format(k) for k in _served(s, "fused")} == \
        ({fmt} if name not in NO_GRID else set()), (name, s)
    recipes = {k[1] for k in _served(s, "compiled", "recipe")}
    assert recipes >= ({r for r in FUSED_RECIPES if r.split(":")[0] != fmt}
                       if name not in NO_GRID else set()), (name, recipes)
    assert bool(recipes) == (name not in NO_GRID), (name, recipes)
    for route in got.plan.routes:  # the plan said so before anything ran
        if route.stored is not None:
            assert (plans.CLOSED in route.passes) == (route.recipe.split(":")[0] == fmt), route


def test_small_checkpoints_all_questions_and_small_batches(tmp_path):
    """Batches of one to three weights (the batch limit cuts same-shape groups), dense layers,
    shared experts, and a dense (BF16) checkpoint under candidate recipes; windows of 8 KB (a
    member is 3.2 KB): two each, cut mid-layer (the window reader). The plan's reads say so."""
    mx, bf16 = _small_ckpts(tmp_path)
    for q, args in (("stored", (mx, RECIPES)), ("candidate-packed", (mx, RECIPES)),
                    ("candidate-dense", (bf16, RECIPES)), ("reference", (mx, bf16))):
        fn = {"stored": stored_vs_recipes, "reference": reference_errors}.get(q, candidate_errors)
        ref = fn(*args, progress=False, path="reference")
        for reader in READERS:
            p = analysis.plan(fn.__name__, *args, path="batched", reader=reader)
            small = replace(p, reads=replace(p.reads, batch_elements=3 * 64 * 96,
                                             window_bytes=8192))
            assert_tables_equal(ref, fn(*args, plan=small, progress=False), (q, reader))


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


def test_path_choice_is_explicit_logged_and_passed(tmp_path, caplog):
    """A table call without a plan builds one from its arguments ("auto": batched below the
    compile threshold on CPU, fused at it, batched on CUDA), logs it, and returns it with the
    tables; a plan passed in is the one that runs."""
    mx, _ = _small_ckpts(tmp_path)
    with caplog.at_level(logging.INFO, logger="workbench.analysis.tables"):
        t = stored_vs_recipes(mx, ["mxfp4:floor"], progress=False, device="cpu")
    assert "stored grid vs recipes: batched path on cpu (default on CPU below" in caplog.text
    assert t.plan.path == "batched" and t.plan.reads.reader == "safetensors"
    assert str(t.plan) in caplog.text
    job = plans.job("stored_vs_recipes", mx, ["mxfp4:floor"])
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    big = replace(job, items=job.items * (plans.COMPILE_ELEMENTS // job.elements + 1),
                  keys=job.keys * (plans.COMPILE_ELEMENTS // job.elements + 1))
    assert big.elements >= plans.COMPILE_ELEMENTS
    got = plans.plan_job(big, mx, ["mxfp4:floor"], device=cpu)
    assert got.path == "fused" and "the compile pays for itself" in got.why
    got = plans.plan_job(job, mx, ["mxfp4:floor"], device=cuda)
    assert (got.path, got.reads.reader) == ("batched", "window")
    assert plans.plan_job(job, mx, ["mxfp4:floor"], device=cpu, path="reference").reads is None
    # the plan passed in runs: asked for the reference path, the call takes it
    p = analysis.plan("stored_vs_recipes", mx, ["mxfp4:floor"], path="reference")
    assert stored_vs_recipes(mx, ["mxfp4:floor"], plan=p, progress=False).plan is p
    with pytest.raises(ValueError, match="path must be one of"):
        stored_vs_recipes(mx, ["mxfp4"], progress=False, path="quick")
    with pytest.raises(ValueError, match="reader must be one of"):
        analysis.plan("stored_vs_recipes", mx, ["mxfp4"], reader="mmap")


def test_a_plan_belongs_to_its_call(tmp_path):
    """A plan runs only on the job it was made for: another question, other recipes, other
    weights, or path arguments beside it are refused with a message saying which."""
    mx, bf16 = _small_ckpts(tmp_path)
    p = analysis.plan("stored_vs_recipes", mx, ["mxfp4:floor"], path="batched")
    with pytest.raises(ValueError, match="the plan is for stored_vs_recipes, not candidate_errors"):
        candidate_errors(mx, ["mxfp4:floor"], plan=p, progress=False)
    with pytest.raises(ValueError, match="recipes"):
        stored_vs_recipes(mx, ["mxfp4:rceil"], plan=p, progress=False)
    with pytest.raises(ValueError, match="other weights"):
        stored_vs_recipes(mx, ["mxfp4:floor"], plan=p, kinds=("routed",), progress=False)
    with pytest.raises(ValueError, match="either plan= or path"):
        stored_vs_recipes(mx, ["mxfp4:floor"], plan=p, path="batched", progress=False)
    q = analysis.plan("candidate_errors", bf16, ["mxfp4:floor"], path="batched")
    with pytest.raises(ValueError, match="other weights"):
        candidate_errors(mx, ["mxfp4:floor"], plan=q, progress=False)


def test_a_plan_prints_what_runs_and_why(tmp_path):
    """str(plan): the path and its reason, the reads, and per (stored format, recipe) the
    passes in order with why the others are left out."""
    mx, bf16 = _small_ckpts(tmp_path)
    p = analysis.plan("stored_vs_recipes", mx, ["mxfp4:rceil", "nvfp4:torchao"], path="fused",
                      device="cpu")
    text = str(p)
    assert text.splitlines()[0] == "stored grid vs recipes: fused path on cpu (asked for)"
    assert "safetensors reader (auto on cpu" in text
    assert "mxfp4 grids -> mxfp4:rceil: closed form, then batched (not compiled: measured " \
        "faster batched (compiled.FASTER))" in text
    assert "mxfp4 grids -> nvfp4:torchao: batched (not compiled: measured faster batched" in text
    assert "18 weights, 221,184 elements (2 recipes)" in text
    dense = analysis.plan("stored_vs_recipes", bf16, ["mxfp4:rceil"], path="fused")
    assert "dense weights -> mxfp4:rceil: no rows (stored dense" in str(dense)
    every = analysis.plan("candidate_errors", bf16, ["nvfp4:torchao", "mxfp4:rceil"],
                          path="fused", device="cpu", compiled="all")
    assert every.passes(None, "mxfp4:rceil") == ("compiled", "batched")
    measured = analysis.plan("candidate_errors", bf16, ["nvfp4:torchao", "mxfp4:rceil"],
                             path="fused", device="cpu")
    assert measured.passes(None, "mxfp4:rceil") == ("batched",)
    assert measured.passes(None, "nvfp4:torchao") == ("compiled", "batched")
    gpu = analysis.plan("candidate_errors", bf16, ["nvfp4:torchao"], path="fused", device="cuda")
    assert gpu.passes(None, "nvfp4:torchao") == ("batched",)
    assert "cuda tensors" in str(gpu)


def _remote(ck):
    """``ck`` as a checkpoint whose shards are not all local says it is (``is_local`` false):
    the plan's view of a remote folder (tests/checkpoint/test_remote_read.py reads a real one)."""
    view = copy.copy(ck)
    view.__class__ = type("RemoteView", (type(ck),), {"is_local": property(lambda self: False)})
    return view


def test_shards_that_are_not_local_are_read_by_preadv(tmp_path):
    """A checkpoint whose shards are read by byte ranges gets the preadv reader for "auto" and
    "window", and the plan says why; either side of question 2 counts."""
    mx, bf16 = _small_ckpts(tmp_path)
    remote = _remote(mx)
    for reader in ("auto", "window"):
        p = analysis.plan("stored_vs_recipes", remote, ["mxfp4:floor"], device="cuda",
                          reader=reader)
        assert p.reads.reader == "preadv" and p.reader_why == plans.REMOTE_WHY, p
    p = analysis.plan("stored_vs_recipes", remote, ["mxfp4:floor"], reader="safetensors")
    assert p.reads.reader == "safetensors"  # reads ranges per tensor too: kept when asked for
    assert analysis.plan("reference_errors", bf16, remote, device="cuda").reads.reader == "preadv"
    assert analysis.plan("stored_vs_recipes", mx, ["mxfp4"], device="cuda").reads.reader == \
        "window"


@pytest.mark.parametrize("setting, device, reader", [
    ("auto", "cuda", "window"), ("auto", "cpu", "safetensors"),  # what measured better where
    ("safetensors", "cuda", "safetensors"), ("preadv", "cpu", "preadv"),  # a setting wins
    ("preadv", "cuda", "preadv"), ("window", "cpu", "window"),
])
def test_reader_choice_per_device(setting, device, reader):
    got, why = plans.read_plan(torch.device(device), setting)
    assert got.reader == reader
    assert why == ("asked for" if setting != "auto" else plans.READER_WHY[device])


@pytest.mark.parametrize("reader", ["preadv", "window"])
def test_truncated_shard_fails_the_table_naming_the_file(tmp_path, reader):
    """A shard cut after the checkpoint was opened: the error from a read thread reaches the
    caller as CorruptShardError naming the shard (no hang, no table of garbage)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
    import writers

    from workbench.checkpoint.errors import CorruptShardError

    ck = open_checkpoint(writers.write_ct(tmp_path / "ck", "mxfp4", shards=1))
    shard = ck.index.files[0]
    os.truncate(shard, min(e.begin for e in ck.index.entries.values()
                           if e.name.endswith("weight_packed")) + 1)
    with pytest.raises(CorruptShardError, match="truncated after the index was built") as ei:
        batched(stored_vs_recipes, ck, ["mxfp4:rceil"], reader)
    assert ei.value.path == str(shard)
