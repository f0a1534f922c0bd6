"""The trainer's optimizer is wired from its flags: --weight-decay on matrices, embeddings and
expert stacks only (never on norm gains), --beta1/--beta2/--adam-eps/--lr as given, the
schedule's first LR the warmup's first step, and one step equal to torch's AdamW built by hand
from those groups. Every value below is distinct from its default, so a flag dropped or
swapped shows."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from workbench.model import MoEForCausalLM, tiny
from workbench.train.build import build_optimizer
from workbench.train.config import TrainConfig


def _model():
    return MoEForCausalLM(tiny(shared_expert_ffn=32, shared_expert_gate=True), seed=0)


def _cfg(tmp_path):
    return TrainConfig(out=str(tmp_path), weight_decay=0.25, lr=2e-3, beta1=0.8, beta2=0.9,
                       adam_eps=1e-6, warmup=4, steps=10, min_lr_ratio=0.5)


def test_groups_and_hyperparameters_come_from_the_flags(tmp_path):
    model = _model()
    opt, sched = build_optimizer(model, _cfg(tmp_path))
    names = {id(p): n for n, p in model.named_parameters()}
    by_wd = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert set(by_wd) == {0.25, 0.0}
    # norm gains (input/post-attention, q/k, final) never decay; everything else does
    assert by_wd[0.0] == {n for n in names.values() if n.endswith("norm.weight")}
    assert "model.layers.0.mlp.experts.w1" in by_wd[0.25]
    assert "model.embed_tokens.weight" in by_wd[0.25] and "lm_head.weight" in by_wd[0.25]
    assert by_wd[0.25] | by_wd[0.0] == set(names.values())
    for g in opt.param_groups:
        assert g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6
        assert g["lr"] == 2e-3 * 1 / 4  # warmup step 1 of 4
    assert sched.get_last_lr() == [5e-4, 5e-4]


def test_one_step_is_torch_adamw_with_hand_built_groups(tmp_path):
    model, ref = _model(), _model()
    opt, _ = build_optimizer(model, _cfg(tmp_path))
    decay = [p for n, p in ref.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in ref.named_parameters() if n.endswith("norm.weight")]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.25},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=5e-4, betas=(0.8, 0.9), eps=1e-6, foreach=False)
    g = torch.Generator().manual_seed(1)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    opt.step()
    ref_opt.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_schedule_warms_up_then_decays_to_the_floor(tmp_path):
    opt, sched = build_optimizer(_model(), _cfg(tmp_path))
    lrs = [opt.param_groups[0]["lr"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping the schedule without optimizer steps
        for _ in range(11):
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    # peak 2e-3 reached in 4 linear warmup steps, then half a cosine over the other 6 steps
    # down to 0.5 x peak (cos of 0, 30, 60, ... 180 degrees), then flat
    r3 = math.sqrt(3) / 2
    want = [5e-4, 1e-3, 1.5e-3, 2e-3, 2e-3, 2e-3 * (0.5 + 0.25 * (1 + r3)), 1.75e-3, 1.5e-3,
            1.25e-3, 2e-3 * (0.5 + 0.25 * (1 - r3)), 1e-3, 1e-3]
    assert lrs == pytest.approx(want, rel=1e-12)
