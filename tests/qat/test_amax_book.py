"""NVFP4 expert weights: the per-expert amax (`workbench.qat.expert_amax`) and the trainer's amax
book (`workbench.qat.QATState`). The seam takes an amax from the book only for the values it was
written for (same parameter object, version and storage); any other write, a replaced or swapped
parameter, a recompute or a second micro-batch each get what the definition gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workbench.formats import fake_quantize, parse_recipe
from workbench.model.experts import GroupedExperts
from workbench.qat import QATState, expert_amax, prepare, ste, unprepare
from workbench.scope import QuantScope

RECIPES = ["nvfp4:torchao", "nvfp4:te"]
NV = parse_recipe("nvfp4:torchao")
SCOPE = QuantScope.from_patterns(["re:experts$"])
E, D, F = 5, 64, 32


def _stack(E=E, O=8, I=64, seed=0, dtype=torch.float32) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    # experts of very different magnitudes: a shared or stale amax changes their block scales
    scale = torch.logspace(-2, 2, E)[:, None, None]
    return nn.Parameter((torch.randn(E, O, I, generator=g) * scale).to(dtype))


def _per_expert_reference(w: torch.Tensor, recipe) -> torch.Tensor:
    # the reference on each expert alone: its global amax is that expert's own tensor amax
    return torch.stack([fake_quantize(w[e].detach(), recipe) for e in range(w.shape[0])])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_expert_amax_is_each_experts_own(recipe, dtype):
    r = parse_recipe(recipe)
    w = _stack(dtype=dtype)
    ref = _per_expert_reference(w, r)
    got = expert_amax(w)
    for fq in (ste.fake_quant_ste(w, r, per_leading=True),
               ste.fake_quant_ste(w, r, per_leading=True, global_amax=got)):
        assert torch.equal(fq, ref)
    w.data[2, 3, 4] = float("nan")  # NaN propagates into its expert's amax (torch's amax)
    want = torch.stack([w[e].detach().abs().max().float() for e in range(E)]).view(E, 1, 1)
    got = expert_amax(w)
    assert got.dtype == torch.float32 and got.shape == (E, 1, 1)
    assert got[2].isnan().all() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_global_amax_is_refused_where_no_per_expert_amax_applies():
    w = _stack()
    with pytest.raises(ValueError, match="per-expert amax of an NVFP4 3-D stack"):
        ste.fake_quant_ste(w, parse_recipe("mxfp4"), per_leading=True, global_amax=expert_amax(w))
    with pytest.raises(ValueError, match=r"float32 of shape \[5, 1, 1\]"):
        ste.fake_quant_ste(w, NV, per_leading=True, global_amax=torch.zeros(4, 1, 1))


# -- the amax book through a prepared layer -------------------------------------------------


def _layer(seed=0):
    torch.manual_seed(seed)
    m = nn.Module()
    m.experts = GroupedExperts(E, D, F)
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.randn(p.shape) * torch.logspace(-2, 2, E)[:, None, None])
    return m


OFFS = torch.tensor([3, 7, 7, 12, 16], dtype=torch.int32)
X = torch.randn(16, D, generator=torch.Generator().manual_seed(9))


def _reference(m):
    """The layer with every weight quantized per expert by the reference, no seam involved."""
    e = m.experts
    wq = {n: _per_expert_reference(getattr(e, n), NV) for n in ("w1", "w3", "w2")}
    ends, starts = OFFS.tolist(), [0] + OFFS.tolist()[:-1]

    def mm(a, w):
        return torch.cat([a[s:t] @ w[i].t() for i, (s, t) in enumerate(zip(starts, ends))])

    with torch.no_grad():
        return mm(nn.functional.silu(mm(X, wq["w1"])) * mm(X, wq["w3"]), wq["w2"])


def _wrong(w):
    # not the amax: 3x it leaves other block scales (a power of two would keep the grid)
    return expert_amax(w) * 3


@pytest.fixture
def book():
    m = _layer()
    state = QATState()
    prepare(m, "nvfp4", SCOPE, state=state)
    assert state.wanted == {"experts.w1", "experts.w3", "experts.w2"}

    def seed_wrong():
        for n in ("w1", "w3", "w2"):
            state.put(f"experts.{n}", getattr(m.experts, n), _wrong(getattr(m.experts, n)))

    return m, state, seed_wrong


def _forward(m):
    with torch.no_grad():
        return m.experts(X, OFFS)


def test_a_valid_entry_is_used_and_without_one_the_forward_computes(book):
    m, state, seed_wrong = book
    ref = _reference(m)
    assert torch.equal(_forward(m), ref)  # the book is empty (the first step): computed
    seed_wrong()
    assert not torch.equal(_forward(m), ref)  # the entries were used (a wrong amax shows it)
    state.clear()
    assert torch.equal(_forward(m), ref)


@pytest.mark.parametrize("write", ["in-place", "load_state_dict", "data-rebind", "replaced",
                                   "data-in-place+clear"])
def test_no_entry_outlives_a_write_of_its_weights(book, write):
    m, state, seed_wrong = book
    seed_wrong()
    e = m.experts
    with torch.no_grad():
        if write == "in-place":
            e.w1.mul_(0.5)
            e.w3.add_(1.0)
            e.w2.copy_(e.w2 * 2)
        elif write == "load_state_dict":
            m.load_state_dict(_layer(seed=1).state_dict())
        elif write == "data-rebind":  # keeps the version counter; the storage changes
            for n in ("w1", "w3", "w2"):
                getattr(e, n).data = getattr(e, n).data * 0.25
        elif write == "replaced":
            e.w1, e.w3, e.w2 = (nn.Parameter(getattr(e, n).detach() * 4) for n in ("w1", "w3", "w2"))
        else:  # invisible to the version counter: the documented rule is clear()
            for n in ("w1", "w3", "w2"):
                getattr(e, n).data.mul_(0.5)
            state.clear()
    assert torch.equal(_forward(m), _reference(m))


def test_entries_serve_recompute_and_micro_batches_without_an_amax_pass(book, monkeypatch):
    """Until the next write, every forward of the step (activation-checkpointing recompute,
    further micro-batches) takes the book's amax: no amax pass. The exact amax gives the
    reference's bits."""
    m, state, _ = book
    e = m.experts
    for n in ("w1", "w3", "w2"):
        state.put(f"experts.{n}", getattr(e, n), expert_amax(getattr(e, n)))
    passes = []
    real = ste.expert_amax
    monkeypatch.setattr(ste, "expert_amax", lambda w, fast=None: passes.append(1) or real(w, fast))
    outs = []
    for _ in range(2):  # two micro-batches, each checkpointed: forward, then its recompute
        y = checkpoint(e, X, OFFS, use_reentrant=False)
        y.square().sum().backward()
        outs.append(y.detach())
    assert passes == []
    assert all(torch.equal(o, _reference(m)) for o in outs)
    with torch.no_grad():
        e.w2.mul_(2.0)
    e(X, OFFS)
    assert passes == [1]  # w2 was written: computed; w1, w3 still from the book


def test_a_swapped_in_tensor_never_gets_the_entry_of_its_name(book):
    """FSDP2 hands the seam all-gathered tensors, not the parameter the optimizer wrote: an
    entry is for its own object only (here: the same values, detached, called through the seam)."""
    m, _, seed_wrong = book
    seed_wrong()
    e = m.experts
    with torch.no_grad():
        g, u = e.gemms.gate_up(X, e.w1.detach().clone(), e.w3.detach().clone(), OFFS)
        y = e.gemms.down(g, u, e.w2.detach().clone(), OFFS, act=e.act)
    assert torch.equal(y, _reference(m))
    # nor does another tensor on the same storage at the same version (a view with other
    # values: every expert reads expert 0's numbers)
    with torch.no_grad():
        w1_view = e.w1.detach().as_strided(e.w1.shape, (0, *e.w1.stride()[1:]))
        assert w1_view.data_ptr() == e.w1.data_ptr() and w1_view._version == e.w1._version
        g, u = e.gemms.gate_up(X, w1_view, e.w3, OFFS)
    wq = _per_expert_reference(w1_view, NV)
    ends, starts = OFFS.tolist(), [0] + OFFS.tolist()[:-1]
    want = torch.cat([X[s:t] @ wq[i].t() for i, (s, t) in enumerate(zip(starts, ends))])
    assert torch.equal(g, want)


def test_put_refuses_what_it_cannot_vouch_for(book):
    m, state, _ = book
    w = m.experts.w1
    with pytest.raises(ValueError, match=r"float32 of shape \[5, 1, 1\]"):
        state.put("experts.w1", w, torch.zeros(5, 1))
    with pytest.raises(ValueError, match="float32"):
        state.put("experts.w1", w, torch.zeros(5, 1, 1, dtype=torch.float64))
    with pytest.raises(KeyError, match="not an NVFP4 expert stack"):
        state.put("experts.w9", w, expert_amax(w))
    with pytest.raises(TypeError, match="plain nn.Parameter"):
        state.put("experts.w1", w.detach(), expert_amax(w))


def test_only_nvfp4_stacks_in_scope_are_wanted_and_unprepare_forgets_them():
    m = _layer()
    state = QATState()
    prepare(m, "mxfp4+mxfp8", SCOPE, state=state)  # MX: no global amax
    assert state.wanted == frozenset()
    unprepare(m)
    prepare(m, "nvfp4", QuantScope.from_patterns(["re:experts$"]), state=state)
    assert state.wanted == {"experts.w1", "experts.w3", "experts.w2"}
    state.put("experts.w1", m.experts.w1, expert_amax(m.experts.w1))
    unprepare(m)
    assert state.wanted == frozenset() and repr(state).endswith("0 amax held)")


def test_optimizer_sink_maps_the_optimizers_parameters_to_names(book):
    m, state, _ = book
    sink = state.optimizer_sink(m)
    e = m.experts
    assert all(sink.wants(getattr(e, n)) for n in ("w1", "w3", "w2"))
    assert not sink.wants(e.w1.detach()) and not sink.wants(nn.Parameter(e.w1.detach()))
    sink.put(e.w2, _wrong(e.w2))
    assert state.amax("experts.w2", e.w2) is not None
    with pytest.raises(KeyError, match="not one of the model's"):
        sink.put(nn.Parameter(e.w2.detach().clone()), expert_amax(e.w2))
