"""The batched path on CUDA (pinned staging, async copies, expert stacks per launch) against the
CPU reference, on the held-in checkpoints of every layout and all three questions.

On CUDA the float sums are batched fp32 reductions (another summation order than the CPU
reference's BLAS dots), hence the 1e-5 relative tolerance on rel_err / sqnr_db / cosine; counts,
maxima and histograms must be equal.
"""

from __future__ import annotations

import pytest
from test_fast_paths import LAYOUTS, NO_GRID, RECIPES, assert_tables_equal, layout  # noqa: F401

from workbench import analysis
from workbench.analysis import candidate_errors, reference_errors, stored_vs_recipes

pytestmark = pytest.mark.gpu
assert LAYOUTS  # the fixture `layout` is parametrised over these


# the stack readers on CUDA: "auto" (the window reader there) and preadv per member
READERS = ("auto", "preadv")


def on_cuda(fn, ck, other, reader: str, **kw):
    """``fn`` with the plan "auto" makes on CUDA (the batched path), with ``reader``."""
    kinds = {"kinds": kw.pop("kinds")} if "kinds" in kw else {}
    p = analysis.plan(fn.__name__, ck, other, device="cuda", reader=reader, **kinds)
    assert p.path == "batched", p
    return fn(ck, other, plan=p, progress=False, **kinds, **kw)


def test_cuda_stored_vs_recipes(layout):  # noqa: F811
    name, ck, _ = layout
    ref = stored_vs_recipes(ck, RECIPES, progress=False, path="reference", device="cpu")
    for reader in READERS:
        got = on_cuda(stored_vs_recipes, ck, RECIPES, reader)
        assert_tables_equal(ref, got, (name, "cuda", reader), empty=name in NO_GRID)


def test_cuda_candidate_errors(layout):  # noqa: F811
    name, ck, _ = layout
    ref = candidate_errors(ck, RECIPES, progress=False, path="reference", device="cpu")
    for reader in READERS:
        got = on_cuda(candidate_errors, ck, RECIPES, reader)
        assert_tables_equal(ref, got, (name, "cuda", reader))


def test_cuda_reference_errors(layout):  # noqa: F811
    name, ck, dense = layout
    ref = reference_errors(ck, dense, kinds=("routed",), progress=False, path="reference",
                           device="cpu")
    for reader in READERS:
        got = on_cuda(reference_errors, ck, dense, reader, kinds=("routed",))
        assert_tables_equal(ref, got, (name, "cuda", reader))
