"""prepare/convert contract on every expert style (stacked seam, HF Linear lists, transformers
fused experts, gpt-oss fused experts, TE GroupedLinear naming)."""

from __future__ import annotations

import copy

import pytest
import torch
from qat_styles_zoo import D, E, build
from torch import nn

from workbench.formats import fake_quantize, parse_recipe, quantize
from workbench.qat import convert, prepare, unprepare
from workbench.scope import QuantScope

STYLES = ["stacked", "hf-linear", "hf-fused", "gpt-oss", "te"]


class Container(nn.Module):
    """Puts a MoE block where real models have it, so names look like real parameter names."""

    def __init__(self, inner):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([inner])
        self.lm_head = nn.Linear(D, 8, bias=False)

    def forward(self, x, offs):
        return self.model.layers[0](x, offs)


def expected_expert_weights(style: str) -> dict[str, int]:
    """Routed-expert weight names and the dim their blocks run along, written out by hand."""
    p = "model.layers.0.experts."
    if style == "stacked":
        return {p + n: -1 for n in ("w1", "w2", "w3")}
    if style == "hf-linear":
        return {f"{p}{e}.{n}.weight": -1 for e in range(E) for n in ("gate_proj", "up_proj", "down_proj")}
    if style == "hf-fused":
        return {p + "gate_up_proj": -1, p + "down_proj": -1}
    if style == "gpt-oss":
        return {p + "gate_up_proj": -2, p + "down_proj": -2}
    return {f"{p}linear_fc{i}.weight{k}": -1 for i in (1, 2) for k in range(E)}


def make(style, dtype=torch.bfloat16):
    return Container(build(style, dtype))


def inputs(dtype=torch.bfloat16, offs=(5, 5, 12, 16), seed=1):
    g = torch.Generator().manual_seed(seed)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    x = (torch.randn(offs[-1], D, generator=g) * 2).to(dtype)
    return x, offs_t


def fq_along(w, recipe, dim):
    """Independent reference: fake-quantize a master the way a deployed checkpoint holds it."""
    if dim == -2:
        return fq_along(w.transpose(-2, -1), recipe, -1).transpose(-2, -1)
    if recipe.fmt == "nvfp4" and w.dim() == 3:  # each expert is its own tensor on disk
        return torch.stack([fake_quantize(w[e], recipe) for e in range(w.shape[0])])
    return fake_quantize(w, recipe)


@pytest.mark.parametrize("style", STYLES)
def test_masters_and_state_dict_untouched(style):
    m = make(style)
    before = {n: p for n, p in m.named_parameters()}
    keys = list(m.state_dict().keys())
    report = prepare(m, "mxfp4+mxfp8", "routed-experts")
    assert {s.name for s in report.converted} == set(expected_expert_weights(style))
    after = dict(m.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert list(m.state_dict().keys()) == keys
    assert all(not isinstance(v, nn.Module) for v in m.state_dict().values())
    x, offs = inputs()
    m(x, offs).float().square().sum().backward()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt.step()
    with_grad = [p for p in before.values() if p.grad is not None]
    assert len(opt.state_dict()["state"]) == len(with_grad)  # exactly the masters, nothing else
    for st in opt.state.values():
        assert {k for k in st} == {"step", "exp_avg", "exp_avg_sq"}
    # lm_head is a Linear outside the routed experts: kept, with the scope's reason
    assert any(n == "lm_head.weight" and "no target" in why for n, why in report.skipped)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4:floor", "nvfp4", "mxfp8_e4m3"])
def test_weights_only_forward_equals_fake_quantized_copy(style, recipe):
    m = make(style)
    ref = copy.deepcopy(m)
    prepare(m, recipe, "routed-experts")
    r = parse_recipe(recipe)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, dim in expected_expert_weights(style).items():
            params[name].copy_(fq_along(params[name], r, dim))
    x, offs = inputs()
    with torch.no_grad():
        assert torch.equal(m(x, offs), ref(x, offs))
    unprepare(m)
    with torch.no_grad():
        assert not torch.equal(m(x, offs), ref(x, offs))  # back to BF16 masters


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("recipe", ["mxfp4", "nvfp4:torchao", "mxfp8_e4m3"])
def test_convert_is_bit_identical_to_quantize(style, recipe):
    m = make(style)
    prepare(m, recipe, "routed-experts")
    packed = convert(m)
    params = dict(m.named_parameters())
    expected = expected_expert_weights(style)
    assert set(packed) == set(expected)
    r = parse_recipe(recipe)
    for name, dim in expected.items():
        w = params[name].detach()
        w = w.transpose(-2, -1) if dim == -2 else w  # checkpoints hold [out, in]
        q = packed[name]
        assert q.shape == tuple(w.shape)
        slices = [w[e] for e in range(w.shape[0])] if (w.dim() == 3 and r.fmt == "nvfp4") else [w]
        for i, ws in enumerate(slices):
            ref = quantize(ws.contiguous(), r)
            got_data = q.data[i] if len(slices) > 1 else q.data
            got_scale = q.scale[i] if len(slices) > 1 else q.scale
            assert torch.equal(got_data.view(torch.uint8), ref.data.view(torch.uint8))
            assert torch.equal(got_scale.view(torch.uint8), ref.scale.view(torch.uint8))
            if r.fmt == "nvfp4":
                gs = q.global_scale[i].reshape(()) if len(slices) > 1 else q.global_scale
                assert torch.equal(gs.float(), ref.global_scale.float())


def test_prepare_refuses_to_convert_nothing():
    m = make("stacked")
    with pytest.raises(ValueError, match="converted nothing"):
        prepare(m, "mxfp4", QuantScope.from_patterns(["re:no\\.such\\.module"]))
    with pytest.raises(ValueError, match="converted nothing"):
        prepare(m, "mxfp4", QuantScope.from_patterns([]))  # an empty include matches nothing
    with pytest.raises(ValueError, match="bf16"):
        prepare(m, "bf16")


def test_prepare_refuses_unblockable_reduction_dim():
    from workbench.model.experts import GroupedExperts

    m = Container(nn.Module())
    m.model.layers[0].experts = GroupedExperts(2, 48, 32)  # a TP shard: 48 columns
    with pytest.raises(ValueError, match=r"experts\.w1.*48.*multiple"):
        prepare(m, "mxfp4", "routed-experts")


def test_weights_are_found_by_role_when_the_parameters_are_replaced():
    """The seam knows each weight by its role (the parameter name), never by the object: a
    parameter replaced after prepare (EP narrowing here; FSDP2 swaps in gathered tensors every
    step) is fake-quantized with its role's recipe, never silently run in BF16."""
    m = make("stacked")
    prepare(m, "mxfp4", "routed-experts")
    m.model.layers[0].experts.narrow_(0, 2)
    ref = copy.deepcopy(m)
    unprepare(ref)
    r = parse_recipe("mxfp4")
    with torch.no_grad():
        for n, p in ref.model.layers[0].experts.named_parameters():
            p.copy_(fq_along(p, r, -1))
    x, offs = inputs(offs=(3, 6))
    with torch.no_grad():
        assert torch.equal(m(x, offs), ref(x, offs))
        unprepare(m)
        assert not torch.equal(m(x, offs), ref(x, offs))  # the comparison can tell BF16 apart


def test_prepare_twice_is_an_error():
    m = make("stacked")
    prepare(m, "mxfp4")
    with pytest.raises(RuntimeError, match="already prepared"):
        prepare(m, "mxfp4")


def test_gpt_oss_activations_of_down_proj_are_reported_bf16():
    m = make("gpt-oss")
    report = prepare(m, "mxfp4+mxfp8", "routed-experts")
    assert any("keeps activations in BF16" in n for n in report.notes)
