"""The fused AdamW update of NVFP4 expert stacks, run on CPU tensors under the Triton interpreter
(``amax_path="always"``): it seeds the exact per-expert amax of the values it wrote (a NaN expert
and an all-zero expert included), moves the version counter, the next fake quantization takes the
seed instead of an amax pass and gives the reference's bits, and the update is torch's AdamW to
one ulp of the result and of the update (torch's CPU addcdiv rounds in another order; bitwise
is test_optim_gpu.py's job).
Bitwise arithmetic of the kernel itself is checked against an fp32/fp64 emulation of both
CONTRACT variants."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the fused path needs Triton (the gpu extra)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU tensors reach the kernel only under TRITON_INTERPRET=1 (on a GPU host "
                "test_optim_gpu.py covers the fused path)", allow_module_level=True)

from workbench import kernels
from workbench.formats import fake_quantize, parse_recipe
from workbench.qat import ste
from workbench.train.optim import AdamW

R = parse_recipe("nvfp4:torchao")
E, O, I = 4, 16, 64
NAN_EXPERT, ZERO_EXPERT = 2, 1


def _stack(dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, O, I, generator=g) * torch.logspace(-3, 3, E)[:, None, None]
    w[ZERO_EXPERT] = 0
    return w.to(dtype)


def _grad(dtype, step) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + step)
    gr = torch.randn(E, O, I, generator=g) * 10.0 ** (step % 3 - 1)
    gr[ZERO_EXPERT] = 0
    gr[NAN_EXPERT, 3, 5] = float("nan")  # that element's moments and weight turn NaN and stay
    gr[0, 1, 2] = float("inf") if step == 2 else gr[0, 1, 2]
    return gr.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _ulp(x: torch.Tensor, mant: int) -> torch.Tensor:
    """The spacing of floats with ``mant`` stored mantissa bits at |x| (float64, normal range)."""
    _, e = torch.frexp(x.double().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (e - 1 - mant).clamp(min=-149))


def _close_to_torch(w: torch.Tensor, ref: torch.Tensor, term: torch.Tensor) -> None:
    """``w`` and torch's CPU result ``ref`` of ``p + term`` differ by at most one ulp of the
    result plus two fp32 ulps of ``term``: torch's CPU addcdiv computes ``(alpha * b) / c``,
    torch's CUDA addcdiv and ours ``alpha * (b / c)``, so the fp32 term can differ by its own
    roundings before the sum is rounded (many result ulps where the sum cancels)."""
    nan = w.isnan()
    assert torch.equal(nan, ref.isnan()), "NaN positions differ"
    mant = 7 if w.dtype == torch.bfloat16 else 23
    w, ref, term = w[~nan].double(), ref[~nan].double(), term[~nan].double()
    tol = _ulp(ref, mant) + 2 * _ulp(term, 23)
    diff = (w - ref).abs()
    assert bool((diff <= tol).all()), f"{int((diff > 0).sum())} differ, {int((diff > tol).sum())} too far"
    # and mostly not at all: a wrong formula would move most elements
    assert int((diff > 0).sum()) < 0.5 * diff.numel()


def _term(opt: AdamW, p: nn.Parameter) -> torch.Tensor:
    """The step's ``-step_size * exp_avg / denom`` in float64, from the state after the step."""
    group, st = opt.param_groups[0], opt.state[p]
    beta1, beta2 = group["betas"]
    step = st["step"].item()
    denom = (st["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
    return -group["lr"] / (1 - beta1**step) * st["exp_avg"].double() / denom.double()


def _ref_amax(w: torch.Tensor) -> torch.Tensor:
    return w.detach().abs().amax(dim=(-2, -1), keepdim=True).float()


def _same_amax(got: torch.Tensor, want: torch.Tensor, payload: bool) -> None:
    """Bitwise, and NaN where the reference is NaN. The NaN's payload is compared for fp32; for
    bf16 it cannot be on the CPU: torch's CPU bf16 amax returns c10's canonical NaN (0x7FC0)
    whatever NaN is stored, while the kernel's integer max returns the stored bits. On a GPU
    every NaN result is canonical, so test_optim_gpu.py compares the payload too."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    if payload:
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


@pytest.fixture
def amax_calls(monkeypatch):
    calls = []
    real = ste._compute_amax

    def counting(w, fast):
        calls.append(tuple(w.shape))
        return real(w, fast)

    monkeypatch.setattr(ste, "_compute_amax", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_fused_update_seeds_the_exact_amax(dtype, wd, amax_calls):
    w = nn.Parameter(_stack(dtype))
    ref_w = nn.Parameter(_stack(dtype))
    ours = AdamW([w], lr=0.05, weight_decay=wd, foreach=False, amax_path="always")
    ref = torch.optim.AdamW([ref_w], lr=0.05, weight_decay=wd, foreach=False)
    ste.fake_quant_ste(w, R, per_leading=True)  # the forward asks for w's amax
    assert amax_calls == [(E, O, I)]
    for step in range(4):
        w.grad, ref_w.grad = _grad(dtype, step), _grad(dtype, step)
        with torch.no_grad():
            ref_w.copy_(w)  # one step's rounding at a time: differences do not compound
        before = w._version
        ours.step()
        ref.step()
        assert w._version > before + (wd != 0)  # the kernel's write counted
        _close_to_torch(w.detach(), ref_w.detach(), _term(ours, w))
        for k in ("exp_avg", "exp_avg_sq"):  # the moments are torch's ops on both paths
            assert torch.equal(_bits(ours.state[w][k]), _bits(ref.state[ref_w][k]))
        seeded = ste.expert_amax(w)  # served from the seed: no amax pass
        assert amax_calls == [(E, O, I)]
        _same_amax(seeded, _ref_amax(w), payload=dtype == torch.float32)
        assert seeded[NAN_EXPERT].isnan().all() and seeded[ZERO_EXPERT].eq(0).all()
        fq = ste.fake_quant_ste(w, R, per_leading=True)
        assert amax_calls == [(E, O, I)]
        want = torch.stack([fake_quantize(w[e].detach(), R) for e in range(E)])
        assert torch.equal(fq.isnan(), want.isnan())
        assert torch.equal(fq.nan_to_num(0.0), want.nan_to_num(0.0))


def _spy_kernel(monkeypatch):
    calls = []
    real = kernels.addcdiv_amax_

    def spy(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setattr(kernels, "addcdiv_amax_", spy)
    return calls


def test_no_amax_where_nobody_wants_it(monkeypatch, amax_calls):
    """CPU params on the default path, unwanted or 2-D params on the forced one: torch's ops,
    no kernel and no amax pass."""
    calls = _spy_kernel(monkeypatch)
    wanted, unwanted, flat = (nn.Parameter(_stack(torch.float32, s)) for s in range(3))
    flat = nn.Parameter(flat.detach().reshape(E * O, I))
    ste.fake_quant_ste(wanted, R, per_leading=True)
    amax_calls.clear()
    for amax_path, params, kernel_calls in (("auto", [wanted, unwanted], 0),
                                            ("never", [wanted], 0),
                                            ("always", [unwanted, flat], 0),
                                            ("always", [wanted, unwanted, flat], 1)):
        opt = AdamW(params, lr=1e-2, foreach=False, amax_path=amax_path)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert len(calls) == kernel_calls and amax_calls == [], amax_path
    assert not ste.amax_wanted(unwanted) and not ste.amax_wanted(flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contract", [True, False])
def test_kernel_arithmetic(dtype, contract):
    """``a + alpha * (b / c)`` in fp32 with an IEEE division, then one rounding: an fma
    (CONTRACT) or a rounded product then a rounded sum."""
    g = torch.Generator().manual_seed(9)
    shape = (3, 8, 48)
    a = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-30, 30, shape, generator=g))
    b = torch.randn(shape, generator=g)
    c = torch.rand(shape, generator=g) * 1e-3 + 1e-8
    a, b, c = a.to(dtype), b.to(dtype), c.to(dtype)
    alpha = -0.0123456789
    p = a.clone()
    amax = kernels.addcdiv_amax_(p, b, c, alpha, contract=contract)
    al = torch.tensor(alpha, dtype=torch.float32)
    q = b.float() / c.float()
    if contract:  # exact product in fp64, one rounding of the sum (to fp64, then fp32: the
        # double rounding differs from an fma's only on ties of the fp64 sum, absent here)
        y = (al.double() * q.double() + a.double()).float()
    else:
        y = al * q + a.float()
    want = y.to(dtype)
    assert torch.equal(_bits(p), _bits(want))
    _same_amax(amax, _ref_amax(want), payload=dtype == torch.float32)
