"""The HF key map on its own: both layouts, expert-parallel shards, and errors that name tensors."""

from __future__ import annotations

import re

import pytest
import torch

from workbench.model import (
    MoEForCausalLM,
    hf_to_ours,
    load_hf_state_dict,
    ours_to_hf,
    tiny,
    to_hf_state_dict,
)
from workbench.model.hf import StateDictError


def _as_rank(model: MoEForCausalLM, rank: int, world: int) -> MoEForCausalLM:
    """What shard_experts_ does to the parameters, without a process group."""
    for block in model.moe_blocks():
        local = block.experts.num_global_experts // world
        block.experts.narrow_(rank * local, local)
    return model


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_round_trip_both_layouts(layout):
    model = MoEForCausalLM(tiny(), seed=3)
    hf = to_hf_state_dict(model, layout=layout)
    expert_keys = [k for k in hf if ".mlp.experts." in k]
    if layout == "fused":
        assert sorted(expert_keys) == sorted(f"model.layers.{i}.mlp.experts.{p}"
                                             for i in range(2) for p in ("gate_up_proj", "down_proj"))
    else:
        assert len(expert_keys) == 2 * 8 * 3
        assert all(re.fullmatch(r"model\.layers\.\d\.mlp\.experts\.\d\.(gate|up|down)_proj\.weight",
                                k) for k in expert_keys)
    back = hf_to_ours(hf)
    ours = model.state_dict()
    assert sorted(back) == sorted(ours)
    for k, v in ours.items():
        assert torch.equal(back[k], v), k
    fresh = MoEForCausalLM(tiny(), seed=4)
    load_hf_state_dict(fresh, hf)
    for (k, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k


def test_gate_rows_come_first_in_gate_up_proj():
    model = MoEForCausalLM(tiny(), seed=0)
    experts = model.model.layers[1].mlp.experts
    fused = to_hf_state_dict(model)["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[:, :32], experts.w1) and torch.equal(fused[:, 32:], experts.w3)


@pytest.mark.parametrize("rank", [0, 3])
def test_expert_parallel_rank_reads_and_writes_only_its_experts(rank):
    full = MoEForCausalLM(tiny(), seed=1)
    for layout in ("fused", "per_expert"):
        shard = _as_rank(MoEForCausalLM(tiny(), seed=9), rank, world=4)
        load_hf_state_dict(shard, to_hf_state_dict(full, layout=layout))
        w2 = shard.model.layers[0].mlp.experts.w2
        assert torch.equal(w2, full.model.layers[0].mlp.experts.w2[2 * rank:2 * rank + 2])
    # A rank-local reader hands over only this rank's per-expert tensors: enough, strict or not.
    own = {k: v for k, v in to_hf_state_dict(full, layout="per_expert").items()
           if not re.search(r"experts\.(\d+)\.", k) or
           int(re.search(r"experts\.(\d+)\.", k)[1]) // 2 == rank}
    shard = _as_rank(MoEForCausalLM(tiny(), seed=9), rank, world=4)
    load_hf_state_dict(shard, own)
    out = to_hf_state_dict(shard, layout="per_expert")
    assert sorted(out) == sorted(own)
    with pytest.raises(ValueError, match="per_expert"):
        to_hf_state_dict(shard, layout="fused")


def test_errors_name_the_tensor():
    model = MoEForCausalLM(tiny(), seed=0)
    good = to_hf_state_dict(model, layout="per_expert")
    missing = dict(good)
    del missing["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(StateDictError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_hf_state_dict(model, missing)
    no_expert = dict(good)
    del no_expert["model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(StateDictError, match=r"experts\.5\.up_proj"):
        load_hf_state_dict(model, no_expert)
    bad_shape = dict(good)
    bad_shape["model.norm.weight"] = torch.ones(63)
    with pytest.raises(StateDictError, match=r"model\.norm\.weight.*\(63,\).*\(64,\)"):
        load_hf_state_dict(model, bad_shape)
    extra = dict(good)
    extra["model.layers.0.mlp.shared_expert_gate.weight"] = torch.ones(1, 64)
    with pytest.raises(StateDictError, match="unexpected.*shared_expert_gate"):
        load_hf_state_dict(model, extra)
    load_hf_state_dict(model, extra, strict=False)
    extra_expert = dict(good)
    extra_expert["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.ones(32, 64)
    with pytest.raises(StateDictError, match=r"experts\.8\.up_proj"):
        load_hf_state_dict(model, extra_expert)


def test_tied_embeddings_checked_on_load():
    model = MoEForCausalLM(tiny(tie_embeddings=True), seed=0)
    sd = to_hf_state_dict(model)
    assert "lm_head.weight" not in sd
    load_hf_state_dict(model, {**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    with pytest.raises(StateDictError, match="tie_embeddings"):
        load_hf_state_dict(model, {**sd, "lm_head.weight": torch.zeros(256, 64)})


def test_partial_per_expert_dict_is_not_silently_restacked():
    sd = ours_to_hf(MoEForCausalLM(tiny(), seed=0).state_dict(), layout="per_expert")
    del sd["model.layers.0.mlp.experts.2.gate_proj.weight"]
    with pytest.raises(StateDictError, match=r"experts \[2\] are missing"):
        hf_to_ours(sd)
