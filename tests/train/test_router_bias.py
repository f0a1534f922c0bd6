"""DeepSeek-V3's auxiliary-loss-free balancing (`--router-bias-update`): the loads it counts are
the experts transformers' own router picks, and the bias moves by the rate against each
expert's load."""

from __future__ import annotations

import pytest
import torch
from families import family_oracle, trained_like

pytest.importorskip("transformers", reason="transformers' router is the oracle")

from workbench.train.router_bias import update_router_biases_


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_loads_are_the_experts_transformers_picks(case):
    """Nonzero correction biases and group-limited routing: the counts equal a bincount of
    transformers' top-k indices for the same hidden states."""
    cfg, hf, model = trained_like(case, None)
    ours = model.model.layers[1].mlp.gate
    theirs = hf.model.layers[1].mlp.gate
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    logits, _, _ = ours(x)
    _, _, idx = theirs(x)
    want = torch.bincount(idx.reshape(-1), minlength=cfg.num_experts)
    assert torch.equal(ours.loads(logits), want)
    assert want.max() > want.min()  # an uneven load, so the update below has work to do


def test_update_moves_each_bias_against_its_load():
    cfg, _, model = trained_like("deepseek_v3", None)
    gates = [b.gate for b in model.moe_blocks()]
    before = [g.e_score_correction_bias.detach().clone() for g in gates]
    x = family_oracle().ids(cfg)
    out = model(x)
    loads = update_router_biases_(model, out.router_logits, 0.01)
    assert loads.shape == (len(gates), cfg.num_experts)
    assert int(loads.sum()) == len(gates) * x.numel() * cfg.top_k
    for gate, b0, load in zip(gates, before, loads):
        step = gate.e_score_correction_bias.detach() - b0
        mean = load.double().mean()
        want = torch.where(load > mean, -0.01, torch.where(load < mean, 0.01, 0.0))
        torch.testing.assert_close(step, want.float(), rtol=0, atol=1e-7)
        assert gate.e_score_correction_bias.grad is None


def test_softmax_routers_have_no_bias_to_update():
    _, _, model = trained_like("gpt_oss", None)
    assert update_router_biases_(model, (), 0.01) is None
