"""workbench.train.optim.AdamW is torch's AdamW: bit for bit against torch.optim.AdamW(foreach=False)
on CPU, state dicts interchangeable both ways; unsupported options are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from workbench.train.optim import AdamW


def _params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        nn.Parameter(torch.randn(3, 8, 16, generator=g)),  # expert stack, fp32
        nn.Parameter(torch.randn(3, 8, 16, generator=g).to(torch.bfloat16)),  # expert stack, bf16
        nn.Parameter(torch.randn(12, 16, generator=g) * 1e-3),  # a matrix
        nn.Parameter(torch.randn(16, generator=g)),  # a norm gain (no decay)
        nn.Parameter(torch.randn(16, generator=g).to(torch.bfloat16)),
        nn.Parameter(torch.randn(4, 4, generator=g)),  # never gets a gradient
    ]


def _make(cls, params, **kw):
    opt = cls([{"params": params[:3] + params[5:], "weight_decay": 0.1},
               {"params": params[3:5], "weight_decay": 0.0}],
              lr=3e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
    return opt, sched


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params[:5]:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype) * (10.0 ** (step % 3 - 1))


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim()
                           else y), "not bit-equal"


def _state(opt) -> list[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out += [st[k] for k in ("step", "exp_avg", "exp_avg_sq") if k in st]
    return out


def _run(opt, sched, params, steps):
    for s in steps:
        _grads(params, s)
        opt.step()
        sched.step()


def test_bit_equal_to_torch_adamw_and_state_dicts_interchange():
    ours_p, ref_p = _params(0), _params(0)
    ours, ours_s = _make(AdamW, ours_p)
    ref, ref_s = _make(torch.optim.AdamW, ref_p)
    _run(ours, ours_s, ours_p, range(5))
    _run(ref, ref_s, ref_p, range(5))
    _same(ours_p, ref_p)
    _same(_state(ours), _state(ref))
    assert not ours.state.get(ours_p[5]) and not ref.state.get(ref_p[5])  # no gradient, no state
    for st in ours.state.values():  # torch's layout: a CPU fp32 0-dim step
        assert st["step"].device.type == "cpu" and st["step"].dtype == torch.float32
        assert st["step"].dim() == 0
    sd_ours, sd_ref = copy.deepcopy(ours.state_dict()), copy.deepcopy(ref.state_dict())
    assert sd_ours["param_groups"] == sd_ref["param_groups"]
    sched_sd = copy.deepcopy(ref_s.state_dict())
    at5 = [p.detach().clone() for p in ref_p]
    _run(ref, ref_s, ref_p, range(5, 8))  # the reference run goes on
    # each continues from the other's state dict exactly as the reference went on
    for sd, cls in ((sd_ours, torch.optim.AdamW), (sd_ref, AdamW)):
        params = [nn.Parameter(p.clone()) for p in at5]
        opt, sched = _make(cls, params)
        opt.load_state_dict(copy.deepcopy(sd))
        sched.load_state_dict(sched_sd)
        _run(opt, sched, params, range(5, 8))
        _same(params, ref_p)
        _same(_state(opt), _state(ref))


def test_state_made_by_checkpointing_is_the_state_torch_makes():
    from workbench.train.checkpointing import ensure_optimizer_state

    ours_p, ref_p = _params(1), _params(1)
    ours, _ = _make(AdamW, ours_p)
    ref, _ = _make(torch.optim.AdamW, ref_p)
    ensure_optimizer_state(ours)  # as a resume does before DCP fills it
    ensure_optimizer_state(ref)
    for opt, params in ((ours, ours_p), (ref, ref_p)):
        _grads(params, 0)
        opt.step()
    _same(ours_p, ref_p)
    _same(_state(ours), _state(ref))


@pytest.mark.parametrize("option", [{"amsgrad": True}, {"maximize": True}, {"foreach": True},
                                    {"fused": True}, {"capturable": True},
                                    {"differentiable": True}, {"lr": torch.tensor(1e-3)},
                                    {"amax_path": "sometimes"}])
def test_unsupported_options_are_refused_by_name(option):
    (name,) = option
    with pytest.raises(ValueError, match=name):
        AdamW([nn.Parameter(torch.zeros(2))], **option)


def test_a_later_group_with_an_unsupported_option_is_refused():
    opt = AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "amsgrad": True})
    assert len(opt.param_groups) == 1


def test_build_optimizer_uses_it():
    from types import SimpleNamespace

    from workbench.train.build import build_optimizer

    m = nn.Linear(4, 4)
    cfg = SimpleNamespace(weight_decay=0.1, lr=1e-3, beta1=0.9, beta2=0.95, adam_eps=1e-8,
                          warmup=1, steps=4, min_lr_ratio=0.1)
    opt, _ = build_optimizer(m, cfg)
    assert type(opt) is AdamW and opt.amax_path == "auto"
    assert [g["foreach"] for g in opt.param_groups] == [False, False]
