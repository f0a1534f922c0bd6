"""NVFP4 expert weights: the per-expert amax computed once per weight version and reused
(`workbench.qat.ste.expert_amax`) gives the reference's bits per expert, and any update of the
weights (in-place optimizer step, load_state_dict, a new storage) is seen."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workbench.formats import fake_quantize, parse_recipe
from workbench.qat import ste
from workbench.qat.grouped import grouped_mm

RECIPES = ["nvfp4:torchao", "nvfp4:te"]


def _stack(E=5, O=8, I=64, seed=0, dtype=torch.float32) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    # experts of very different magnitudes: a shared or stale amax changes their block scales
    scale = torch.logspace(-2, 2, E)[:, None, None]
    return nn.Parameter((torch.randn(E, O, I, generator=g) * scale).to(dtype))


def _per_expert_reference(w: torch.Tensor, recipe) -> torch.Tensor:
    # the reference on each expert alone: its global amax is that expert's own tensor amax
    return torch.stack([fake_quantize(w[e].detach(), recipe) for e in range(w.shape[0])])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_amax_is_bit_exact_per_expert(recipe, dtype):
    r = parse_recipe(recipe)
    w = _stack(dtype=dtype)
    ref = _per_expert_reference(w, r)
    first = ste.fake_quant_ste(w, r, per_leading=True)
    again = ste.fake_quant_ste(w, r, per_leading=True)  # served from the cache
    assert torch.equal(first, ref) and torch.equal(again, ref)
    assert ste.expert_amax(w) is ste.expert_amax(w)  # one amax per version, shared


@pytest.mark.parametrize("recipe", RECIPES)
def test_optimizer_step_invalidates_the_cached_amax(recipe):
    r = parse_recipe(recipe)
    w = _stack(seed=1)
    x = torch.randn(40, w.shape[2])
    offs = torch.tensor([8, 16, 24, 32, 40], dtype=torch.int32)
    opt = torch.optim.AdamW([w], lr=0.5, foreach=False)
    for _ in range(3):
        y = grouped_mm(x, w, offs, weight=r)
        ref_w = _per_expert_reference(w, r)
        ref = torch.cat([x[a:b] @ ref_w[e].T for e, (a, b) in
                         enumerate(zip([0, 8, 16, 24, 32], [8, 16, 24, 32, 40]))])
        assert torch.equal(y, ref)
        before = ste.expert_amax(w).clone()
        y.square().sum().backward()
        opt.step()
        opt.zero_grad()
        # the step moved the amax (so a stale one would give other block scales)
        assert not torch.equal(ste.expert_amax(w), before)


def test_every_kind_of_weight_write_is_seen():
    r = parse_recipe("nvfp4:torchao")
    w = _stack(seed=2)
    ste.fake_quant_ste(w, r, per_leading=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w.mul_(torch.rand(w.shape[0], 1, 1, generator=g) + 0.5)  # in place
    assert torch.equal(ste.fake_quant_ste(w, r, per_leading=True), _per_expert_reference(w, r))
    m = nn.Module()
    m.w = w
    m.load_state_dict({"w": _stack(seed=4).detach()})  # copy_ under no_grad
    assert torch.equal(ste.fake_quant_ste(w, r, per_leading=True), _per_expert_reference(w, r))
    w.data = _stack(seed=5).detach().clone()  # new storage, the version counter is not bumped
    assert torch.equal(ste.fake_quant_ste(w, r, per_leading=True), _per_expert_reference(w, r))
    with torch.no_grad():
        w.data.mul_(3.0)  # bypasses the version counter: documented, cleared by hand
    ste.clear_amax_cache()
    assert torch.equal(ste.fake_quant_ste(w, r, per_leading=True), _per_expert_reference(w, r))


def test_non_parameters_are_not_cached():
    r = parse_recipe("nvfp4:te")
    t = _stack(seed=6).detach().clone()
    assert ste.expert_amax(t) is not ste.expert_amax(t)
    assert torch.equal(ste.fake_quant_ste(t, r, per_leading=True), _per_expert_reference(t, r))


def test_entries_go_with_their_parameter():
    w = _stack(seed=7)
    ste.expert_amax(w)
    key = id(w)
    assert key in ste._AMAX
    del w
    assert key not in ste._AMAX


def test_a_seeded_amax_is_served_for_that_version_only():
    r = parse_recipe("nvfp4:torchao")
    w = _stack(seed=6)
    assert not ste.amax_wanted(w)
    exact = ste.fake_quant_ste(w, r, per_leading=True)
    assert ste.amax_wanted(w)  # the writer of the next version may produce it
    with torch.no_grad():
        w.mul_(0.5)
    # a seed that is not the exact amax shows whether the next fake quantization used it
    wrong = w.detach().abs().amax(dim=(-2, -1), keepdim=True).float() * 3  # not a power of two: those leave the grid as it is
    ste.seed_amax(w, wrong)
    assert ste.expert_amax(w) is wrong
    served = ste.fake_quant_ste(w, r, per_leading=True)
    assert torch.equal(served, fake_quantize(w.detach(), r, global_amax=wrong))
    assert not torch.equal(served, _per_expert_reference(w, r))
    with torch.no_grad():
        w.mul_(2.0)  # the next version: the seed is stale and not served
    assert torch.equal(ste.fake_quant_ste(w, r, per_leading=True), _per_expert_reference(w, r))
    assert torch.equal(exact, _per_expert_reference(w, r))


@pytest.mark.parametrize("bad", [torch.zeros(5, 1), torch.zeros(5, 1, 1, dtype=torch.float64),
                                 torch.zeros(4, 1, 1)])
def test_seed_amax_rejects_a_misshapen_amax(bad):
    w = _stack(seed=7)
    with pytest.raises(ValueError, match="float32 of shape \\[5, 1, 1\\]"):
        ste.seed_amax(w, bad)
    with pytest.raises(TypeError, match="nn.Parameter"):
        ste.seed_amax(w.detach(), torch.zeros(5, 1, 1))


@pytest.mark.parametrize("recipe", ["nvfp4:torchao", "mxfp4", "mxfp8_e4m3"])
def test_out_dtype_narrows_once_and_gives_the_gradient_back_in_fp32(recipe):
    r = parse_recipe(recipe)
    w = _stack(seed=8)
    got = ste.fake_quant_ste(w, r, per_leading=True, out_dtype=torch.bfloat16)
    want = ste.fake_quant_reference(w, r, per_leading=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    g = torch.randn(got.shape, dtype=torch.bfloat16)
    got.backward(g)
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, g.float())
    with pytest.raises(ValueError, match="narrows fp32"):
        ste.fake_quant_ste(w.detach().bfloat16(), r, out_dtype=torch.float32)
