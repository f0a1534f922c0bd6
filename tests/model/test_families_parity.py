"""Every family against transformers 5.24: a checkpoint transformers wrote (random init, every
feature switched on and made to matter, family_oracle.py) becomes the workbench model through
`from_pretrained`, whose fp32 logits, losses and gradients match transformers' (eager
attention); switching any one feature off moves the logits far past the tolerance.

Tolerance: both sides run in fp32 with the same operations in the same order except the expert
GEMMs (ours batched per expert group, transformers one matmul per expert, gpt-oss's gate and up
as one), attention (SDPA vs eager softmax; a sink as an extra key vs an extra column) and MLA's
key assembly, so results differ by fp32 summation order only: ~1e-7 relative per op, measured at
most 1.6e-6 on logits of mean magnitude ~0.5 after 2-3 layers. ATOL = RTOL = 2e-5 leaves a
margin of 10x; a feature switched off moves some logit by more than 100 x ATOL.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the oracle (pip install 'workbench[dev]')")

from family_oracle import CASES, SEQ, family_model, ids, write

from workbench.arch import AttentionConfig, ExpertConfig, RopeConfig, RouterConfig
from workbench.model import (
    MoEForCausalLM,
    from_pretrained,
    hf_to_ours,
    load_hf_state_dict,
    ours_to_hf,
    to_hf_state_dict,
)

ATOL = RTOL = 2e-5
FAR = 100 * ATOL


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """case -> (checkpoint folder written by transformers, the fp32 transformers model)."""
    out = {}
    for name, cfg in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, write(cfg, folder, seed=7))
    return out


def _logits(model, cfg) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids(cfg)) if not isinstance(model, MoEForCausalLM) else model(ids(cfg))
    return out.logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_matches_transformers_logits(case, written):
    cfg = CASES[case]
    folder, hf = written[case]
    ours = from_pretrained(folder)
    assert ours.config == cfg  # the config.json transformers wrote maps back to the preset
    ref, got = _logits(hf, cfg), _logits(ours, cfg)
    assert ref.abs().mean() > 0.1  # not a degenerate near-zero output
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_gradients_match_transformers(case):
    """In memory, through the fused key map: transformers' loss (its causal-LM cross entropy, no
    aux term) equals our ce_loss, and every parameter's gradient equals transformers'."""
    cfg = CASES[case]
    hf = family_model(cfg, seed=3)
    ours = MoEForCausalLM(cfg, seed=0)
    load_hf_state_dict(ours, hf.state_dict())
    x = ids(cfg)
    labels = x.clone()
    labels[0, 5:9] = -100
    ref = hf(input_ids=x, labels=labels)
    out = ours(x, labels)
    torch.testing.assert_close(out.ce_loss, ref.loss, rtol=1e-6, atol=1e-6)
    ref.loss.backward()
    out.ce_loss.backward()
    ref_grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()}, family=cfg.family)
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            assert name.endswith("e_score_correction_bias") and p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_key_map_round_trips_both_layouts(case, written):
    """ours -> transformers names gives transformers' own tensors bit for bit: fused as in
    memory, per expert as its save_pretrained wrote them (gpt-oss: fused on disk too)."""
    from safetensors.torch import load_file

    cfg = CASES[case]
    folder, hf = written[case]
    ours = from_pretrained(folder)
    fused = to_hf_state_dict(ours)
    want = hf.state_dict()
    assert set(fused) == set(want)
    for k, v in want.items():
        assert torch.equal(fused[k], v), k
    on_disk = load_file(folder / "model.safetensors")
    layout = "fused" if cfg.family == "gpt_oss" else "per_expert"
    mine = ours_to_hf({n: p.detach() for n, p in ours.named_parameters()}, layout=layout,
                      family=cfg.family)
    assert set(mine) == set(on_disk)
    for k, v in on_disk.items():
        assert torch.equal(mine[k], v), k


def _off(cfg, **changes):
    return dataclasses.replace(cfg, **changes)


def _zero_correction_bias(model):
    for n, p in model.named_parameters():
        if n.endswith("e_score_correction_bias"):
            p.data.zero_()


OSS = CASES["gpt_oss"]
DS = CASES["deepseek_v3"]
GLM = CASES["glm4_moe"]
QWEN = CASES["qwen3_moe_yarn_bias"]
# (case, feature) -> (config with the feature off, a change to the loaded model or None)
FEATURES_OFF = {
    ("qwen3_moe", "q/k norm"): (_off(CASES["qwen3_moe"], attention=AttentionConfig(qk_norm=False)), None),
    ("qwen3_moe", "norm_topk_prob"): (_off(CASES["qwen3_moe"], norm_topk_prob=False), None),
    ("qwen3_moe_yarn_bias", "YaRN"): (_off(QWEN, rope=RopeConfig()), None),
    ("qwen3_moe_yarn_bias", "attention bias"): (_off(QWEN, attention=AttentionConfig()), None),
    ("gpt_oss", "sinks"): (_off(OSS, attention=dataclasses.replace(OSS.attention, sinks=False)), None),
    ("gpt_oss", "sliding window"): (_off(OSS, attention=dataclasses.replace(
        OSS.attention, layer_types=("full_attention",) * OSS.num_layers)), None),
    ("gpt_oss", "YaRN"): (_off(OSS, rope=RopeConfig()), None),
    ("gpt_oss", "SwiGLU clamp"): (_off(OSS, experts=ExpertConfig("clamped_swiglu", 1.702, 1e6, True)), None),
    ("gpt_oss", "clamped SwiGLU"): (_off(OSS, experts=ExpertConfig("swiglu", bias=True)), None),
    ("gpt_oss", "expert biases"): (_off(OSS, experts=dataclasses.replace(OSS.experts, bias=False)), None),
    ("gpt_oss", "router bias"): (_off(OSS, router=RouterConfig(kind="topk_softmax")), None),
    ("gpt_oss", "attention biases"): (_off(OSS, attention=dataclasses.replace(
        OSS.attention, qkv_bias=False, o_bias=False)), None),
    ("deepseek_v3", "correction bias"): (DS, _zero_correction_bias),
    ("deepseek_v3", "group-limited routing"): (_off(DS, router=dataclasses.replace(
        DS.router, n_group=1, topk_group=1)), None),
    ("deepseek_v3", "routed_scaling_factor"): (_off(DS, router=dataclasses.replace(
        DS.router, routed_scaling_factor=1.0)), None),
    ("deepseek_v3", "norm_topk_prob"): (_off(DS, norm_topk_prob=False), None),
    ("deepseek_v3", "interleaved rotary"): (_off(DS, rope=dataclasses.replace(DS.rope, interleaved=False)), None),
    ("deepseek_v3", "YaRN mscale"): (_off(DS, rope=dataclasses.replace(DS.rope, mscale_all_dim=None)), None),
    ("deepseek_v3", "YaRN"): (_off(DS, rope=RopeConfig(interleaved=True)), None),
    ("deepseek_v3", "shared expert"): (_off(DS, shared_expert_ffn=0), None),
    ("deepseek_v3", "MLA biases"): (_off(DS, attention=dataclasses.replace(
        DS.attention, qkv_bias=False, o_bias=False)), None),
    ("glm4_moe", "q/k norm"): (_off(GLM, attention=dataclasses.replace(GLM.attention, qk_norm=False)), None),
    ("glm4_moe", "q/k/v bias"): (_off(GLM, attention=dataclasses.replace(GLM.attention, qkv_bias=False)), None),
    ("glm4_moe", "partial rotary"): (_off(GLM, rope=RopeConfig()), None),
    ("glm4_moe", "correction bias"): (GLM, _zero_correction_bias),
    ("glm4_moe", "routed_scaling_factor"): (_off(GLM, router=RouterConfig(kind="sigmoid")), None),
    ("glm4_moe", "shared expert"): (_off(GLM, shared_expert_ffn=0), None),
}


@pytest.mark.parametrize("case, feature", sorted(FEATURES_OFF), ids=lambda v: v.replace(" ", "_"))
def test_each_feature_matters(case, feature, written):
    """The workbench model with one feature switched off (its tensors, if any, left unused)
    no longer matches transformers: the parity above is not blind to that feature."""
    folder, hf = written[case]
    cfg, change = FEATURES_OFF[(case, feature)]
    ours = from_pretrained(folder, config=cfg, strict=False)
    if change is not None:
        change(ours)
    diff = (_logits(ours, cfg) - _logits(hf, cfg)).abs().max().item()
    assert diff > FAR, f"{case}: switching {feature} off moved the logits by only {diff:.2e}"


def test_the_features_bite():
    """The fixtures exercise what they claim: the clamp cuts gate and up activations, the
    correction bias changes which experts are picked, the window is shorter than the sequence."""
    cfg = OSS
    hf = family_model(cfg, seed=7)
    seen = []
    hook = hf.model.layers[1].mlp.experts.register_forward_hook(
        lambda m, a, o: seen.append(a[0]))
    with torch.no_grad():
        hf(input_ids=ids(cfg))
    hook.remove()
    x = seen[0]
    gate_up = x @ hf.model.layers[1].mlp.experts.gate_up_proj[0]
    assert (gate_up.abs() > cfg.experts.limit).float().mean() > 0.2
    assert cfg.attention.sliding_window < SEQ

    router = family_model(DS, seed=7).model.layers[1].mlp.gate
    x = torch.randn(64, DS.hidden_size, generator=torch.Generator().manual_seed(0))
    _, _, with_bias = router(x)
    router.e_score_correction_bias.zero_()
    _, _, without = router(x)
    changed = (with_bias.sort(-1).values != without.sort(-1).values).any(-1).float().mean()
    assert changed > 0.3
