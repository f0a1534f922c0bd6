"""Regression: transformers 5.24 loads compressed-tensors NVFP4 MoE experts ~3e4x too large.

transformers fuses the per-expert checkpoint tensors into its 3-D `Qwen3MoeExperts` parameters
and, on the way, drops `weight_global_scale`; dense Linear layers keep their compressed-tensors
modules and decode correctly. The workbench must decode the same files exactly. If a future
transformers fixes this, the first test fails and says so: update docs/formats.md then.
"""

from __future__ import annotations

import pytest
import torch
from oracle_checks import assert_bits_equal
from safetensors import safe_open

transformers = pytest.importorskip("transformers", reason="the bug under test is in transformers")
pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the checkpoint")


@pytest.fixture(scope="module")
def hf_loaded(ct_nvfp4):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ct_nvfp4.path, dtype=torch.bfloat16)
    model(torch.zeros(1, 2, dtype=torch.long))  # first forward decompresses the dense layers
    return model


def _global_scale(path, name):
    with safe_open(path / "model.safetensors", "pt") as f:
        return f.get_tensor(f"{name}.weight_global_scale").item()


def test_transformers_loads_nvfp4_experts_scaled_by_global_scale(ct_nvfp4, hf_loaded):
    assert transformers.__version__ == "5.24.0", "re-check the bug on this version"
    experts = hf_loaded.model.layers[0].mlp.experts
    inter = experts.intermediate_dim
    for e in range(ct_nvfp4.num_experts):
        want = ct_nvfp4.experts[(0, e, "gate")].float()
        got = experts.gate_up_proj.data[e, :inter].float()
        gscale = _global_scale(ct_nvfp4.path, f"model.layers.0.mlp.experts.{e}.gate_proj")
        assert gscale > 10  # 2688 / amax: real weights (amax ~0.1) give ~3e4
        nz = want != 0
        ratio = (got[nz] / want[nz]).median().item()
        # transformers' value is the oracle times weight_global_scale (the division is missing)
        assert ratio == pytest.approx(gscale, rel=2e-2), (ratio, gscale)
        assert not torch.equal(got, want)


def test_transformers_dense_nvfp4_layers_are_right(ct_nvfp4, hf_loaded):
    q = hf_loaded.model.layers[0].self_attn.q_proj.weight.data
    assert_bits_equal(q, ct_nvfp4.meta["decoded"]["model.layers.0.self_attn.q_proj.weight"],
                      "transformers q_proj")


def test_workbench_decodes_the_same_nvfp4_experts_exactly(ct_nvfp4):
    from workbench.checkpoint import open_checkpoint

    ck = open_checkpoint(ct_nvfp4.path)
    for e in range(ct_nvfp4.num_experts):
        for proj in ("gate", "up", "down"):
            assert_bits_equal(ck.expert_weight(0, e, proj).materialize(),
                              ct_nvfp4.experts[(0, e, proj)], f"E{e} {proj}")


def test_control_transformers_loads_mxfp4_experts_exactly(ct_mxfp4):
    """Same loader, same fusing, MXFP4 (no global scale): transformers is bit-exact here, so the
    NVFP4 difference above is the dropped `weight_global_scale`, not the comparison."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ct_mxfp4.path, dtype=torch.bfloat16)
    experts = model.model.layers[1].mlp.experts
    inter = experts.intermediate_dim
    for e in range(ct_mxfp4.num_experts):
        assert_bits_equal(experts.gate_up_proj.data[e, :inter], ct_mxfp4.experts[(1, e, "gate")],
                          f"transformers E{e} gate")
        assert_bits_equal(experts.gate_up_proj.data[e, inter:], ct_mxfp4.experts[(1, e, "up")],
                          f"transformers E{e} up")
        assert_bits_equal(experts.down_proj.data[e], ct_mxfp4.experts[(1, e, "down")],
                          f"transformers E{e} down")
