""""auto" in a warm process (``paths.choose_path`` with ``graphs``' record of warm jobs): a small
CPU job stays batched in a fresh process, takes ``fused`` once a fused call of the same job
has run compiled graphs here, and stays batched after a compile failed in the process.

Which path ran is read from the ``workbench.analysis.paths`` log (``paths._LOGGED`` reset per
test, since each text is logged once per process)."""

from __future__ import annotations

import logging

import pytest
import torch
from analysis_ckpts import moe_weights, write_mxfp4

from workbench.analysis import candidate_errors, compiled, fused, graphs, paths, stored_vs_recipes
from workbench.checkpoint import open_checkpoint

FROM_SUMS = ["rel_err", "sqnr_db", "cosine"]


@pytest.fixture
def fresh(monkeypatch):
    """This test's process as a fresh one: no warm jobs, nothing broken, every log text new."""
    monkeypatch.setattr(graphs, "_WARM", set())
    monkeypatch.setattr(paths, "_LOGGED", set())
    monkeypatch.setattr(fused, "_BROKEN", [])
    monkeypatch.setattr(compiled, "_BROKEN", [])
    monkeypatch.delenv(paths.ENV, raising=False)


@pytest.fixture
def ck(tmp_path):
    sd = moe_weights(layers=2, experts=4, hidden=128, ffn=64)
    return open_checkpoint(write_mxfp4(tmp_path / "mx", sd, "mxfp4:even"))


def _auto(caplog, call) -> tuple[str, object]:
    """(the path "auto" took, per the log; the table)"""
    caplog.clear()
    paths._LOGGED.clear()  # (the fixture made it this test's own set)
    with caplog.at_level(logging.INFO, logger="workbench.analysis.paths"):
        t = call()
    said = [r.getMessage() for r in caplog.records if r.name == "workbench.analysis.paths"]
    assert len(said) == 1, said
    return said[0], t


def test_a_fresh_process_keeps_a_small_job_batched(fresh, ck, caplog):
    said, _ = _auto(caplog, lambda: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False,
                                                      device="cpu"))
    assert said.startswith("stored grid vs recipes: batched path on cpu (default on CPU below")
    assert "no compile" in said
    assert not graphs._WARM  # a batched call records nothing


@pytest.mark.inductor_cpp  # compiles for real: skipped where Inductor cannot build (conftest)
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_the_same_small_job_after_a_fused_call_takes_fused(fresh, ck, caplog):
    """After a fused call (compiled for real) of question 3, the same job's "auto" call takes
    fused, with the same table, and so does a smaller job of the same units (routed experts
    only); the same checkpoint under another question, or another recipe, has not been compiled:
    batched."""
    first = stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu", path="fused")
    assert fused._BROKEN == [], fused._BROKEN
    said, got = _auto(caplog, lambda: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False,
                                                        device="cpu"))
    assert said.startswith("stored grid vs recipes: fused path on cpu (default on CPU below"), said
    assert "warm process" in said
    assert got.experts.drop(columns=FROM_SUMS).equals(first.experts.drop(columns=FROM_SUMS))
    assert got.scales.equals(first.scales)
    said, _ = _auto(caplog, lambda: stored_vs_recipes(ck, ["mxfp4:rceil"], kinds=("routed",),
                                                      progress=False, device="cpu"))
    assert said.startswith("stored grid vs recipes: fused path on cpu"), said  # fewer, same units
    said, _ = _auto(caplog, lambda: candidate_errors(ck, ["mxfp4:rceil"], progress=False,
                                                     device="cpu"))
    assert said.startswith("candidate recipes: batched path on cpu"), said
    said, _ = _auto(caplog, lambda: stored_vs_recipes(ck, ["mxfp4:rceil", "mxfp4:floor"],
                                                      progress=False, device="cpu"))
    assert said.startswith("stored grid vs recipes: batched path on cpu"), said


def test_a_fused_call_that_ran_no_graph_warms_nothing(fresh, ck, caplog):
    """MXFP4 grids under an NVFP4 recipe: no closed form, and compiled.py's graph for that pair
    is measured slower (not in ``compiled.FASTER``), so the fused call runs it batched and
    compiles nothing: the next "auto" call is not known to be warm."""
    assert not compiled.preferred("recipe", "mxfp4", "nvfp4")
    stored_vs_recipes(ck, ["nvfp4:torchao"], progress=False, device="cpu", path="fused")
    said, _ = _auto(caplog, lambda: stored_vs_recipes(ck, ["nvfp4:torchao"], progress=False,
                                                      device="cpu"))
    assert said.startswith("stored grid vs recipes: batched path on cpu"), said
    assert "no compile" in said


def test_a_failed_compile_keeps_warm_jobs_batched(fresh, ck, caplog, monkeypatch):
    """A job made warm by a fused call, then a compile of another job fails (the family turns
    off for the process): "auto" takes batched again for both, the reason logged. The first
    job's graph is the closed form run uncompiled (registered as compiled, as test_fused.py's
    ``eager`` fixture does); the second job's compile fails inside ``torch.compile``'s result,
    where Inductor's errors surface."""
    monkeypatch.setattr(fused, "_COMPILED", {"even": fused._fused("even")})
    monkeypatch.setattr(fused, "COMPILE_SECONDS", {"even": 0.0})
    stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu", path="fused")
    said, _ = _auto(caplog, lambda: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False,
                                                      device="cpu"))
    assert said.startswith("stored grid vs recipes: fused path on cpu"), said

    def no_compiler(fn, **kw):
        def call(*args):
            raise RuntimeError("InductorError: no C++ compiler (test)")
        return call

    monkeypatch.setattr(torch, "compile", no_compiler)
    ref = stored_vs_recipes(ck, ["mxfp4:transformers"], progress=False, device="cpu",
                            path="batched")
    got = stored_vs_recipes(ck, ["mxfp4:transformers"], progress=False, device="cpu",
                            path="fused")  # ties away: a graph not compiled yet
    assert fused._BROKEN and "no C++ compiler" in fused._BROKEN[0]
    assert got.experts.drop(columns=FROM_SUMS).equals(ref.experts.drop(columns=FROM_SUMS))
    for recipe, why in (("mxfp4:rceil", "compiling failed earlier in this process"),
                        ("mxfp4:transformers", "no compile")):  # the second: never warm
        said, _ = _auto(caplog, lambda r=recipe: stored_vs_recipes(ck, [r], progress=False,
                                                          device="cpu"))
        assert said.startswith("stored grid vs recipes: batched path on cpu"), (recipe, said)
        assert why in said, (recipe, said)


def test_a_job_is_known_by_the_units_its_graphs_are_keyed_by():
    """(question, device, signature, stack of one or more, recipe): a stack of one expert is a
    graph of its own (dynamo specialises a dim of size 1), so the stack sizes count."""
    cpu = torch.device("cpu")
    a, b = ("mxfp4", "even", (64, 128)), ("mxfp4", "even", (128, 64))
    n = 64 * 128
    units = paths.job_units("q", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil"])
    assert units == {("q", "cpu", a, False, "mxfp4:rceil"), ("q", "cpu", b, True, "mxfp4:rceil")}
    assert units == paths.job_units("q", cpu, [b, a, a, a], [n] * 4, ["mxfp4:rceil"])
    assert paths.job_units("q", cpu, [a, b], [n] * 2, ["mxfp4:rceil"]) != units
    big = 1 << 20  # two of these fill a CPU stack: stacks of 2, 2, 1
    assert {u[3] for u in paths.job_units("q", cpu, [a] * 5, [big] * 5)} == {False, True}
    two = paths.job_units("q", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil", "mxfp4:floor"])
    assert units < two
    assert not units & paths.job_units("r", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil"])
    graphs._WARM.clear()
    try:
        assert not graphs.warm(units) and not graphs.warm(frozenset())
        assert graphs.note_fused_job(two, graphs.GRAPH_CALLS[0] - 1, None)
        assert graphs.warm(units) and graphs.warm(two)
    finally:
        graphs._WARM.clear()
