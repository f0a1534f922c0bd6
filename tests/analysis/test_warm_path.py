""""auto" with a warm session (``plans.plan`` reading the caller's ``Session``): a small CPU job
stays batched with a fresh session, takes ``fused`` once a fused call of the same job has run
compiled graphs in that session, and stays batched after a compile failed in it. Nothing of
this lives in the process: another session, or none, starts cold."""

from __future__ import annotations

import pytest
import torch
from analysis_ckpts import moe_weights, write_mxfp4

from workbench import analysis
from workbench.analysis import Session, candidate_errors, compiled, plans, stored_vs_recipes
from workbench.analysis.session import eager
from workbench.checkpoint import open_checkpoint

FROM_SUMS = ["rel_err", "sqnr_db", "cosine"]


@pytest.fixture
def ck(tmp_path):
    sd = moe_weights(layers=2, experts=4, hidden=128, ffn=64)
    return open_checkpoint(write_mxfp4(tmp_path / "mx", sd, "mxfp4:even"))


def _auto(call, session: Session | None) -> tuple[analysis.AnalysisPlan, object]:
    """(the plan "auto" ran, the tables)"""
    t = call(session)
    return t.plan, t


def test_a_fresh_session_keeps_a_small_job_batched(ck):
    s = Session()
    p, _ = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu",
                                             session=s), s)
    assert p.summary().startswith("stored grid vs recipes: batched path on cpu (default on CPU "
                                  "below")
    assert "no compile" in p.why
    assert not s.warm_units  # a batched call records nothing


@pytest.mark.inductor_cpp  # compiles for real: skipped where Inductor cannot build (conftest)
@pytest.mark.filterwarnings("ignore:dynamo_pgo force disabled")
def test_the_same_small_job_after_a_fused_call_takes_fused(ck):
    """After a fused call (compiled for real) of question 3, the same job's "auto" call in the
    same session takes fused, with the same table, and so does a smaller job of the same units
    (routed experts only); the same checkpoint under another question, or another recipe, has
    not been compiled: batched. Another session knows none of it."""
    s = Session()
    first = stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu", path="fused",
                              session=s)
    assert not s.broken, s.broken
    p, got = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False,
                                               device="cpu", session=s), s)
    assert p.summary().startswith("stored grid vs recipes: fused path on cpu (default on CPU "
                                  "below"), p
    assert "warm session" in p.why
    assert got.experts.drop(columns=FROM_SUMS).equals(first.experts.drop(columns=FROM_SUMS))
    assert got.scales.equals(first.scales)
    p, _ = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil"], kinds=("routed",),
                                             progress=False, device="cpu", session=s), s)
    assert p.path == "fused", p  # fewer weights, the same units
    p, _ = _auto(lambda s: candidate_errors(ck, ["mxfp4:rceil"], progress=False, device="cpu",
                                            session=s), s)
    assert p.path == "batched", p
    p, _ = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil", "mxfp4:floor"], progress=False,
                                             device="cpu", session=s), s)
    assert p.path == "batched", p
    for other in (Session(), None):  # the warmth is the session's, not the process's
        p, _ = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False,
                                                 device="cpu", session=s), other)
        assert p.path == "batched" and "no compile" in p.why, p


def test_a_fused_call_that_ran_no_graph_warms_nothing(ck):
    """MXFP4 grids under an NVFP4 recipe: no closed form, and compiled.py's graph for that pair
    is measured slower (not in ``compiled.FASTER``), so the fused call runs it batched and
    compiles nothing: the next "auto" call is not known to be warm."""
    assert ("recipe", "mxfp4", "nvfp4") not in compiled.FASTER
    s = Session()
    t = stored_vs_recipes(ck, ["nvfp4:torchao"], progress=False, device="cpu", path="fused",
                          session=s)
    assert t.plan.passes("mxfp4", "nvfp4:torchao") == ("batched",)
    assert s.calls == 0 and not s.warm_units
    p, _ = _auto(lambda s: stored_vs_recipes(ck, ["nvfp4:torchao"], progress=False,
                                             device="cpu", session=s), s)
    assert p.path == "batched" and "no compile" in p.why, p


def _compiles_once():
    """A compiler that compiles nothing: its first graph runs eagerly, every later one fails
    when called, where Inductor's errors surface."""
    made = []

    def compiler(fn, options):
        made.append(fn)
        if len(made) == 1:
            return fn

        def call(*args):
            raise RuntimeError("InductorError: no C++ compiler (test)")
        return call

    return compiler


def test_a_failed_compile_keeps_warm_jobs_batched(ck):
    """A job made warm by a fused call, then a compile of another job fails (the family turns
    off for the session): "auto" takes batched again for both, the reason in the plan; the
    failed call's table is still the reference's (batched)."""
    s = Session(compiler=_compiles_once())
    stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu", path="fused", session=s)
    p, _ = _auto(lambda s: stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False, device="cpu",
                                             session=s), s)
    assert p.path == "fused", p
    ref = stored_vs_recipes(ck, ["mxfp4:transformers"], progress=False, device="cpu",
                            path="batched")
    got = stored_vs_recipes(ck, ["mxfp4:transformers"], progress=False, device="cpu",
                            path="fused", session=s)  # ties away: a graph not compiled yet
    assert "no C++ compiler" in s.broken["fused"]
    assert got.experts.drop(columns=FROM_SUMS).equals(ref.experts.drop(columns=FROM_SUMS))
    for recipe, why in (("mxfp4:rceil", "compiling failed earlier in this session"),
                        ("mxfp4:transformers", "no compile")):  # the second: never warm
        p, _ = _auto(lambda s, r=recipe: stored_vs_recipes(ck, [r], progress=False,
                                                           device="cpu", session=s), s)
        assert p.path == "batched" and why in p.why, (recipe, p)
    # a plan made now routes no stack to a closed form, and says why
    p = analysis.plan("stored_vs_recipes", ck, ["mxfp4:rceil"], path="fused", device="cpu",
                      session=s)
    assert p.passes("mxfp4", "mxfp4:rceil") == ("batched",)
    assert "compiling failed earlier in this session" in str(p)


def test_a_job_is_known_by_the_units_its_graphs_are_keyed_by():
    """(question, device, signature, stack of one or more, recipe): a stack of one expert is a
    graph of its own (dynamo specialises a dim of size 1), so the stack sizes count."""
    cpu = torch.device("cpu")
    a, b = ("mxfp4", "even", (64, 128)), ("mxfp4", "even", (128, 64))
    n = 64 * 128
    units = plans.job_units("q", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil"])
    assert units == {("q", "cpu", a, False, "mxfp4:rceil"), ("q", "cpu", b, True, "mxfp4:rceil")}
    assert units == plans.job_units("q", cpu, [b, a, a, a], [n] * 4, ["mxfp4:rceil"])
    assert plans.job_units("q", cpu, [a, b], [n] * 2, ["mxfp4:rceil"]) != units
    big = 1 << 20  # two of these fill a CPU stack: stacks of 2, 2, 1
    assert {u[3] for u in plans.job_units("q", cpu, [a] * 5, [big] * 5)} == {False, True}
    two = plans.job_units("q", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil", "mxfp4:floor"])
    assert units < two
    assert not units & plans.job_units("r", cpu, [a, a, b], [n] * 3, ["mxfp4:rceil"])
    s = Session(compiler=eager)
    assert not s.warm(units) and not s.warm(frozenset())
    assert not s.note_job(two, s.calls)  # no graph call since: nothing recorded
    s.calls += 1
    assert s.note_job(two, s.calls - 1)
    assert s.warm(units) and s.warm(two)
    s.broken["compiled"] = "RuntimeError: test"
    assert not s.note_job(frozenset({("q", "cpu", b, False, None)}), s.calls - 1)
