"""QuantScope: compressed-tensors' own matcher, transformers' modules_to_not_convert rule, and
the QAT presets. The oracles run the real libraries on a real module tree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workbench.scope import Pattern, QuantScope

TARGET_SETS = [
    (["Linear"], ["lm_head"]),
    (["Linear"], ["re:.*mlp.gate$", "lm_head"]),
    (["re:.*experts"], []),  # anchored at the start only: a prefix match is enough
    (["re:mlp"], []),  # anchored at the start: never matches "model.layers..."
    (["model.layers.0.self_attn.q_proj"], []),
    (["re:.*q_proj$", "Embedding"], ["re:model.layers.1"]),
    (["re:.*experts.*_proj$"], ["re:.*experts.1\\."]),
    (["Linear", "Embedding"], ["Embedding"]),
    ([], []),
]


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


def tiny_moe() -> nn.Module:
    def layer():
        m = nn.Module()
        m.self_attn = nn.Module()
        for p in ("q_proj", "k_proj"):
            setattr(m.self_attn, p, nn.Linear(8, 8, bias=False))
        m.input_layernorm = RMSNorm(8)
        m.mlp = nn.Module()
        m.mlp.gate = nn.Linear(8, 2, bias=False)
        m.mlp.experts = nn.ModuleList()
        for _ in range(2):
            e = nn.Module()
            e.gate_proj, e.up_proj, e.down_proj = (nn.Linear(8, 4, bias=False),
                                                   nn.Linear(8, 4, bias=False),
                                                   nn.Linear(4, 8, bias=False))
            m.mlp.experts.append(e)
        m.mlp.shared_expert = nn.Module()
        m.mlp.shared_expert.gate_proj = nn.Linear(8, 4, bias=False)
        return m

    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(16, 8)
    root.model.layers = nn.ModuleList([layer(), layer()])
    root.model.norm = RMSNorm(8)
    root.lm_head = nn.Linear(8, 16, bias=False)
    return root


@pytest.mark.parametrize("targets,ignore", TARGET_SETS)
def test_matches_compressed_tensors_is_match(targets, ignore):
    from compressed_tensors.utils.match import is_match

    model = tiny_moe()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    scope = QuantScope.from_patterns(targets, ignore, "mxfp4", names=shapes)
    checked = 0
    for mname, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue  # 1-D norms are never quantized by the scope (documented)
        want = is_match(mname, module, targets, ignore)
        got = scope.is_quantized(f"{mname}.weight")
        assert got == want, (mname, targets, ignore, scope.reason(f"{mname}.weight"))
        checked += 1
    assert checked == 22  # 2 layers x 10 Linear + embedding + lm_head


def test_reasons_name_the_matching_entries():
    scope = QuantScope.from_patterns(["Linear"], ["re:.*mlp.gate$"], "nvfp4",
                                     names={"a.mlp.gate.weight": (2, 8),
                                            "a.mlp.experts.0.up_proj.weight": (4, 8)})
    r = scope.reason("a.mlp.gate.weight")
    assert not scope.is_quantized("a.mlp.gate.weight")
    assert "'Linear'" in r and "re:.*mlp.gate$" in r
    assert scope.is_quantized("a.mlp.experts.0.up_proj.weight")
    assert "'Linear' (class)" in scope.reason("a.mlp.experts.0.up_proj.weight")
    assert scope.recipe("a.mlp.experts.0.up_proj.weight") == "nvfp4"
    assert scope.recipe("a.mlp.gate.weight") is None
    rows = scope.report()
    assert [r["quantized"] for r in rows] == [False, True]
    assert "1 of 2 tensors quantized" in scope.summary()


def test_non_weights_and_empty_include():
    scope = QuantScope.from_patterns(["re:.*"], [], "mxfp4")
    assert not scope.is_quantized("x.q_proj.bias")
    assert not scope.is_quantized("x.experts.gate_up_proj_bias")
    assert scope.decide("x.norm.weight", shape=(8,)).quantized is False
    assert scope.is_quantized("x.q_proj.weight")
    empty = QuantScope.from_patterns([], [], "mxfp4")
    assert not empty.is_quantized("x.q_proj.weight")
    assert "empty include" in empty.reason("x.q_proj.weight")


@pytest.mark.parametrize("key,name", [
    ("model.layers.1", "model.layers.1.self_attn"), ("model.layers.1", "model.layers.11.self_attn"),
    ("model.layers.*.self_attn", "model.layers.3.self_attn"), ("mlp.gate", "x.mlp.gate_proj"),
    ("mlp.gate", "x.mlp.gate"), ("lm_head", "lm_head"), ("router", "model.layers.0.mlp.router"),
    ("embed_tokens", "model.embed_tokens"), ("model.layers.*.mlp.router", "model.layers.0.mlp.router"),
])
def test_hf_style_matches_transformers_should_convert_module(key, name):
    from transformers.quantizers.quantizers_utils import should_convert_module

    assert Pattern(key, "hf").matches(name, None) == (not should_convert_module(name, [key]))


def test_glob_style_is_modelopt_shell_glob():
    p = Pattern("model.layers.*.self_attn*", "glob")
    assert p.matches("model.layers.0.self_attn.q_proj", "Linear")
    assert not p.matches("model.layers.0.mlp.experts.0.up_proj", "Linear")


ROUTED = ["model.layers.0.mlp.experts.3.gate_proj.weight",
          "model.layers.0.block_sparse_moe.experts.1.w2.weight",
          "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.w13",
          "decoder.layers.0.mlp.experts.linear_fc1.weight3",
          "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
          "model.layers.0.mlp.experts.fc2.weight1"]
NOT_ROUTED = ["model.layers.0.mlp.shared_expert.gate_proj.weight",
              "model.layers.0.mlp.shared_experts.down_proj.weight",
              "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight",
              "model.layers.0.mlp.experts.gate_up_proj_bias"]


def test_routed_experts_preset():
    scope = QuantScope.preset("routed-experts", "mxfp4")
    for n in ROUTED:
        assert scope.is_quantized(n), (n, scope.reason(n))
        assert "experts" in scope.reason(n)
    for n in NOT_ROUTED:
        assert not scope.is_quantized(n), (n, scope.reason(n))


def test_all_linear_preset():
    scope = QuantScope.preset("all-linear", "nvfp4")
    shapes = {"model.layers.0.self_attn.q_proj.weight": (8, 8),
              "model.layers.0.mlp.shared_expert.gate_proj.weight": (4, 8),
              "model.layers.0.mlp.down_proj.weight": (8, 4)}
    for n, s in shapes.items():
        assert scope.decide(n, s).quantized, n
    for n in ROUTED:
        assert scope.is_quantized(n), n
    for n, s in {"lm_head.weight": (16, 8), "model.embed_tokens.weight": (16, 8),
                 "model.layers.0.mlp.gate.weight": (2, 8), "model.layers.0.mlp.router.weight": (2, 8),
                 "model.norm.weight": (8,), "model.layers.0.input_layernorm.weight": (8,)}.items():
        d = scope.decide(n, s)
        assert not d.quantized, (n, d.reason)
    with pytest.raises(ValueError, match="unknown scope preset"):
        QuantScope.preset("everything")


def test_bad_patterns_fail_at_construction():
    with pytest.raises(ValueError):
        Pattern("x", "fuzzy")
    import re

    with pytest.raises(re.error):
        Pattern("re:([", "ct")


class GroupedExperts(nn.Module):
    """A grouped-GEMM experts module: one 3-D `weight` [E, out, in], no Linear in sight."""

    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


@pytest.mark.parametrize("shape", [(4, 8, 16), (2, 4, 8, 16)])
def test_a_3d_weight_is_not_a_linear(shape):
    # a checkpoint stores no classes: the scope infers Linear from a 2-D weight only, as
    # compressed-tensors (matching the module's class) sees a grouped 3-D weight
    from compressed_tensors.utils.match import is_match

    root = nn.Module()
    root.experts = GroupedExperts(shape)
    root.proj = nn.Linear(16, 8, bias=False)
    names = {n: tuple(p.shape) for n, p in root.named_parameters()}
    scope = QuantScope.from_patterns(["Linear"], [], "mxfp4", names=names)
    assert is_match("experts", root.experts, ["Linear"], []) is False
    assert is_match("proj", root.proj, ["Linear"], []) is True
    assert not scope.is_quantized("experts.weight"), scope.reason("experts.weight")
    assert scope.is_quantized("proj.weight")
    # the same names with a shape given per query, and a TE-style weight{k}
    assert not scope.decide("experts.weight0", shape).quantized
    assert scope.decide("experts.weight0", (8, 16)).quantized
