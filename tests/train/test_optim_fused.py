"""The fused AdamW update of NVFP4 expert stacks, run on CPU tensors under the Triton interpreter
(``amax_path="always"``): it hands its amax sink (the trainer's ``QATState``) the exact per-expert
amax of the values it wrote (a NaN expert and an all-zero expert included, bit for bit the
definition ``workbench.qat.expert_amax``), moves the version counter, the next fake quantization
takes that amax instead of an amax pass and gives the reference's bits, and the update is torch's
AdamW to one ulp of the result and of the update (torch's CPU addcdiv rounds in another order;
bitwise is test_optim_gpu.py's job). Through a prepared layer and the trainer's checkpoint path:
a checkpoint loaded after the optimizer wrote an amax makes the forward compute it again.
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
from workbench.qat import QATState, expert_amax, ste
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


def _close_to_torch(w: torch.Tensor, ref: torch.Tensor, term: torch.Tensor,
                    term_ulps: int = 2) -> None:
    """``w`` and torch's CPU result ``ref`` of ``p + term`` differ by at most one ulp of the
    result plus two fp32 ulps of ``term``: torch's CPU addcdiv computes ``(alpha * b) / c``,
    torch's CUDA addcdiv and ours ``alpha * (b / c)``, so the fp32 term can differ by its own
    roundings before the sum is rounded (many result ulps where the sum cancels)."""
    nan = w.isnan()
    assert torch.equal(nan, ref.isnan()), "NaN positions differ"
    mant = 7 if w.dtype == torch.bfloat16 else 23
    w, ref, term = w[~nan].double(), ref[~nan].double(), term[~nan].double()
    tol = _ulp(ref, mant) + term_ulps * _ulp(term, 23)
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
    """Every amax pass a fake quantization runs (none when it is handed the amax)."""
    calls = []
    real = ste.expert_amax

    def counting(w, fast=None):
        calls.append(tuple(w.shape))
        return real(w, fast)

    monkeypatch.setattr(ste, "expert_amax", counting)
    return calls


def _book(wanted: dict[str, nn.Parameter], others: dict[str, nn.Parameter] = {}):  # noqa: B006
    """A QATState wanting the amax of `wanted` (by name), and its optimizer sink."""
    m = nn.Module()
    for n, p in {**wanted, **others}.items():
        m.register_parameter(n, p)
    state = QATState()
    for n in wanted:
        state.want(n)
    return state, state.optimizer_sink(m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.1, 0.0])
def test_fused_update_seeds_the_exact_amax(dtype, wd, amax_calls):
    w = nn.Parameter(_stack(dtype))
    ref_w = nn.Parameter(_stack(dtype))
    state, sink = _book({"w": w})
    ours = AdamW([w], lr=0.05, weight_decay=wd, foreach=False, amax_path="always",
                 amax_sink=sink)
    ref = torch.optim.AdamW([ref_w], lr=0.05, weight_decay=wd, foreach=False)
    ste.fake_quant_ste(w, R, per_leading=True)  # the first forward computes w's amax
    assert amax_calls == [(E, O, I)]
    for step in range(4):
        w.grad, ref_w.grad = _grad(dtype, step), _grad(dtype, step)
        with torch.no_grad():
            ref_w.copy_(w)  # one step's rounding at a time: differences do not compound
        before = w._version
        ours.step()
        ref.step()
        # the kernel's write counted: bf16 runs torch's mul_ first, fp32 the whole step in one
        assert w._version > before + (wd != 0 and dtype == torch.bfloat16)
        # fp32: two ulps more of the term, from the denominator: torch's CPU fp32 sqrt is off
        # by an ulp in about one value in six (2.13), the kernel's is IEEE; torch's CPU divides
        # by bc2 where its CUDA ops (and the kernel) multiply by the reciprocal
        _close_to_torch(w.detach(), ref_w.detach(), _term(ours, w),
                        term_ulps=2 if dtype == torch.bfloat16 else 4)
        for k in ("exp_avg", "exp_avg_sq"):
            if dtype == torch.bfloat16:  # torch's ops on this path
                assert torch.equal(_bits(ours.state[w][k]), _bits(ref.state[ref_w][k]))
            else:  # the kernel's (bitwise against CUDA's in test_optim_gpu.py); torch's CPU
                # lerp and addcmul round in another order: two ulps apart at most
                a, b = ours.state[w][k].double(), ref.state[ref_w][k].double()
                fin = b.isfinite()
                assert torch.equal(a[~fin].nan_to_num(0.0), b[~fin].nan_to_num(0.0)), k
                assert torch.equal(a[~fin].isnan(), b[~fin].isnan()), k
                assert bool(((a - b).abs()[fin] <= 2 * _ulp(b, 23)[fin]).all()), k
        ref_w.grad = None
        with torch.no_grad():  # the moments go on from ours, so each step is one rounding
            for k in ("exp_avg", "exp_avg_sq"):
                ref.state[ref_w][k].copy_(ours.state[w][k])
        seeded = state.amax("w", w)  # the optimizer's, for the values it wrote
        assert seeded is not None
        _same_amax(seeded, _ref_amax(w), payload=dtype == torch.float32)
        n_passes = len(amax_calls)
        _same_amax(seeded, expert_amax(w), payload=dtype == torch.float32)  # the definition
        del amax_calls[n_passes:]
        assert seeded[NAN_EXPERT].isnan().all() and seeded[ZERO_EXPERT].eq(0).all()
        fq = ste.fake_quant_ste(w, R, per_leading=True, global_amax=seeded)
        assert amax_calls == [(E, O, I)]  # no amax pass
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
    state, sink = _book({"wanted": wanted}, {"unwanted": unwanted, "flat": flat})
    for amax_path, params, kernel_calls, with_sink in (("auto", [wanted, unwanted], 0, True),
                                                       ("never", [wanted], 0, True),
                                                       ("always", [wanted], 0, False),
                                                       ("always", [unwanted, flat], 0, True),
                                                       ("always", [wanted, unwanted, flat], 1,
                                                        True)):
        # the last-op kernel's rules (the whole-step kernel's: the test below)
        opt = AdamW(params, lr=1e-2, foreach=False, amax_path=amax_path, whole_step=False,
                    amax_sink=sink if with_sink else None)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert len(calls) == kernel_calls and amax_calls == [], amax_path
    assert not sink.wants(unwanted) and not sink.wants(flat)
    assert state.amax("wanted", wanted) is not None


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


def _whole_reference(p, g, m, v, *, lr, beta1, beta2, eps, wd, step, lerp_fma, addcmul_fma,
                     div_recip, contract):
    """``adamw_kernel``'s arithmetic written in torch ops, each rounding explicit: fp32 ops for
    the plain ones, an fma as the exact fp64 product and sum rounded to fp32 (the double rounding
    differs from an fma's only on ties of the fp64 sum, absent from random data)."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    fma = lambda a, b, c: (a.double() * b.double() + c.double()).float()
    bc1, bc2 = 1 - beta1**step, (1 - beta2**step) ** 0.5
    w1, b2, c2, alpha = f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(-(lr / bc1))
    p = p * f32(1 - lr * wd) if wd != 0 else p.clone()
    diff = g - m
    m = fma(w1, diff, m) if lerp_fma else m + w1 * diff
    v = v * b2
    v = fma(c2, g * g, v) if addcmul_fma else v + c2 * (g * g)
    # an IEEE sqrt, as CUDA's: from fp64, where it is exact enough to round once (torch's
    # vectorised CPU fp32 sqrt is off by an ulp in about one value in six, seen with 2.13)
    s = v.double().sqrt().float()
    d = s * f32(1.0 / bc2) if div_recip else s / f32(bc2)
    q = m / (d + f32(eps))
    p = fma(q, alpha, p) if contract else p + q * alpha
    return p, m, v


@pytest.mark.parametrize("switches", [(True, True, True, True), (False, True, True, True),
                                      (True, False, True, True), (True, True, False, True),
                                      (True, True, True, False), (False, False, False, False)])
def test_whole_step_arithmetic(switches):
    """``kernels.adamw_step_`` computes what its docstring lists, for each rounding switch (the
    GPU decides which is torch's: test_optim_gpu.py, jobs/gpu/adamw_bits.py); NaN and inf
    gradients, a zero expert, weights of every magnitude; the amax of the stored values."""
    lerp_fma, addcmul_fma, div_recip, contract = switches
    p0 = _stack(torch.float32, seed=3)
    m0 = torch.randn(p0.shape, generator=torch.Generator().manual_seed(4)) * 1e-2
    v0 = torch.rand(p0.shape, generator=torch.Generator().manual_seed(5)) * 1e-4
    g = _grad(torch.float32, 2)
    hyper = {"lr": 0.05, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "step": 3.0}
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    amax = kernels.adamw_step_(p, g, m, v, weight_decay=0.1, amax=True, lerp_fma=lerp_fma,
                               addcmul_fma=addcmul_fma, div_recip=div_recip, contract=contract,
                               **hyper)
    want = _whole_reference(p0, g, m0, v0, wd=0.1, lerp_fma=lerp_fma, addcmul_fma=addcmul_fma,
                            div_recip=div_recip, contract=contract, **hyper)
    for name, got, ref in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v), want):
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan), name
        assert torch.equal(_bits(got)[~nan], _bits(ref)[~nan]), name
    _same_amax(amax, _ref_amax(want[0]), payload=True)


def test_whole_step_lerp_with_a_large_weight_and_no_decay():
    """beta1 = 0.3: ATen's lerp takes its other branch, end - (end - self) * (1 - w); and no
    weight decay leaves the param's first op out."""
    g = torch.Generator().manual_seed(8)
    p0, m0, gr = (torch.randn(2, 8, 32, generator=g) for _ in range(3))
    v0 = torch.rand(2, 8, 32, generator=g)
    hyper = {"lr": 1e-3, "beta1": 0.3, "beta2": 0.99, "eps": 1e-6, "step": 1.0}
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    assert kernels.adamw_step_(p, gr, m, v, weight_decay=0.0, lerp_fma=False, **hyper) is None
    w = torch.tensor(1 - 0.3, dtype=torch.float32)
    assert torch.equal(_bits(m), _bits(gr - (gr - m0) * (torch.tensor(1.0) - w)))
    # the rest from the kernel's own exp_avg: the large branch is the only change
    _, _, want_v = _whole_reference(p0, gr, m0, v0, wd=0.0, lerp_fma=False, addcmul_fma=True,
                                    div_recip=True, contract=True, **hyper)
    assert torch.equal(_bits(v), _bits(want_v))
    inv_bc2 = torch.tensor(1 / (1 - 0.99) ** 0.5, dtype=torch.float32)
    d = v.double().sqrt().float() * inv_bc2 + torch.tensor(1e-6)
    alpha = torch.tensor(-(1e-3 / (1 - 0.3)), dtype=torch.float32)
    assert torch.equal(_bits(p), _bits(((m / d).double() * alpha.double() + p0.double()).float()))


def test_whole_step_rejects_what_it_cannot_update():
    p = torch.zeros(2, 4, 16)
    ok = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
          "step": 1.0}
    with pytest.raises(ValueError, match="grad is torch.bfloat16"):
        kernels.adamw_step_(p, p.bfloat16(), p.clone(), p.clone(), **ok)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        kernels.adamw_step_(p, p.clone(), torch.zeros(2, 16, 4).transpose(1, 2), p.clone(), **ok)
    with pytest.raises(ValueError, match="stack with amax"):
        kernels.adamw_step_(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8),
                            amax=True, **ok)


def test_optimizer_takes_the_whole_step_for_fp32_only(monkeypatch):
    """fp32 params (stacks and matrices, amax wanted or not) go through ``adamw_step_``; bf16
    stacks through ``addcdiv_amax_``; ``whole_step=False`` keeps torch's ops for fp32 (bitwise
    against torch's CUDA ops: test_optim_gpu.py; here, close to its CPU roundings)."""
    whole, last = [], []
    real_whole, real_last = kernels.adamw_step_, kernels.addcdiv_amax_
    monkeypatch.setattr(kernels, "adamw_step_",
                        lambda *a, **kw: whole.append(a[0].shape) or real_whole(*a, **kw))
    monkeypatch.setattr(kernels, "addcdiv_amax_",
                        lambda *a, **kw: last.append(a[0].shape) or real_last(*a, **kw))
    stack = nn.Parameter(_stack(torch.float32, 1))
    flat = nn.Parameter(_stack(torch.float32, 2).reshape(E * O, I))
    half = nn.Parameter(_stack(torch.bfloat16, 3))
    runs = {}
    for whole_step in (True, False):
        params = [nn.Parameter(t.detach().clone()) for t in (stack, flat, half)]
        # wanted: the bf16 stack (its last op is fused)
        _, sink = _book({"bf16_stack": params[2]}, {"stack": params[0], "flat": params[1]})
        opt = AdamW(params, lr=1e-2, foreach=False, amax_path="always", whole_step=whole_step,
                    amax_sink=sink)
        whole.clear(), last.clear()
        for step in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)
                                     ).to(p.dtype)
            opt.step()
        runs[whole_step] = [p.detach().clone() for p in params[:2]]
        assert whole == ([stack.shape, flat.shape] * 2 if whole_step else []), whole_step
        assert last == [half.shape] * 2, whole_step
    for a, b in zip(runs[True], runs[False]):  # the same update (the bits: the tests above)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _prepared(seed: int = 0):
    from workbench.model.experts import GroupedExperts
    from workbench.qat import prepare
    from workbench.scope import QuantScope

    torch.manual_seed(seed)
    m = nn.Module()
    m.experts = GroupedExperts(E, I, O)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) * torch.logspace(-2, 2, E)[:, None, None])
    state = QATState()
    prepare(m, "nvfp4", QuantScope.from_patterns(["re:experts$"]), state=state)
    return m, state


def _layer_reference(m, x, offs):
    """The layer with each weight quantized per expert by the reference codec."""
    e = m.experts
    wq = {n: torch.stack([fake_quantize(getattr(e, n)[k].detach(), R) for k in range(E)])
          for n in ("w1", "w3", "w2")}
    ends = offs.tolist()
    starts = [0] + ends[:-1]

    def mm(a, w):
        return torch.cat([a[s:t] @ w[k].t() for k, (s, t) in enumerate(zip(starts, ends))])

    with torch.no_grad():
        return mm(nn.functional.silu(mm(x, wq["w1"])) * mm(x, wq["w3"]), wq["w2"])


def test_trainer_flow_optimizer_amax_feeds_the_forward_and_a_checkpoint_load_voids_it(
        tmp_path, amax_calls):
    """A prepared layer, its QATState and the optimizer wired as `train.build` wires them: after
    each step the forward takes the optimizer's amax (no amax pass) and gives the reference's
    bits. Loading a checkpoint through the trainer's state dict (`train.checkpointing`, DCP)
    after more steps writes other values: the forward must not take the amax the optimizer
    wrote before the load."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from workbench.train import checkpointing as ckpt
    from workbench.train.distributed import DistInfo

    m, state = _prepared()
    opt = AdamW(m.parameters(), lr=0.05, foreach=False, amax_path="always",
                amax_sink=state.optimizer_sink(m))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    info = DistInfo(0, 1, 0, torch.device("cpu"), None, False)
    offs = torch.tensor([3, 7, 7, 16], dtype=torch.int32)  # an empty expert too
    x = torch.randn(16, I, generator=torch.Generator().manual_seed(3))

    def step():
        y = m.experts(x, offs)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        return y.detach()

    ref = _layer_reference(m, x, offs)
    assert torch.equal(step(), ref) and len(amax_calls) == 3  # the first step computes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(ckpt.state_dict(m, opt, sched, 1, info), checkpoint_id=str(tmp_path / "ck"))
    for _ in range(2):
        before = len(amax_calls)
        with torch.no_grad():
            y = m.experts(x, offs)
        assert len(amax_calls) == before  # every amax from the optimizer's write
        assert torch.equal(y, _layer_reference(m, x, offs))
        step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = ckpt.state_dict(m, opt, sched, 0, info)
        dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    before = len(amax_calls)
    with torch.no_grad():
        y = m.experts(x, offs)
    assert len(amax_calls) == before + 3  # the loaded values: computed again
    assert torch.equal(y, _layer_reference(m, x, offs))
