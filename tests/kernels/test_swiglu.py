"""The fused SwiGLU + MX activation fake quantization (``kernels.silu_mul_fake_quantize``) and the
QAT seam that uses it: the same bits as ``F.silu(g) * u`` followed by the down projection's
activation fake quantization, forward and backward.

On a GPU every comparison is exact, silu included (all 65536 bf16 inputs). Under the interpreter
(CPU) the kernel's silu uses numpy's exp, which can differ from torch's CPU silu in the last fp32
bit: there the fake quantization is checked exactly on the kernel's own ``s``, and the layer
comparison runs on data where the two silus agree (asserted first, so the test says so if not).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench.qat.grouped as qg
from workbench import kernels as K
from workbench.formats import fake_quantize, parse_recipe
from workbench.model.experts import GroupedExperts
from workbench.qat import QATExpertGemms, prepare, unprepare
from workbench.scope import QuantScope

from .inputs import assert_same_bits, gaussian, specials

GPU = torch.cuda.is_available()
SCOPE = QuantScope.from_patterns(["re:experts$"])  # the test model's one expert module
MX_ACTS = ["mxfp8_e4m3:rceil", "mxfp8_e4m3:floor", "mxfp8_e5m2:even", "mxfp4:ceil"]


def _operands(device, rows=64, cols=128, seed=0):
    g = gaussian((rows, cols), seed=seed).float().clamp(-30, 30).bfloat16()  # silu's live range
    u = gaussian((rows, cols), seed=seed + 1)
    return g.to(device), u.to(device)


def _silu(g):
    """The kernels' silu(g), read back through the backward: du = 1 * silu(g)."""
    return K.silu_mul_backward(torch.ones_like(g), g, torch.ones_like(g))[1]


def test_kernel_silu_is_torchs(device):
    g, _ = _operands(device)
    s, ref = _silu(g), F.silu(g)  # on a GPU: torch's CUDA silu
    if GPU:
        assert_same_bits(s.cpu(), ref.cpu(), "silu")
    else:
        ulps = (s.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
        assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99, ulps.max()


@pytest.mark.parametrize("act", MX_ACTS)
def test_fused_output_is_silu_times_up_then_fake_quantize(act, device):
    g, u = _operands(device)
    q = K.silu_mul_fake_quantize(g, u, act)
    # the reference codec on the product of the kernels' own silu (torch's on a GPU)
    assert_same_bits(q.cpu(), fake_quantize((_silu(g) * u).cpu(), act), f"{act} fake_quantize")


def test_special_values_follow_the_unfused_ops(device):
    """NaN, inf, subnormals and scale edges in the up projection's values (and NaN/inf in the
    gate's): the fake quantization of silu(g) * u, position for position."""
    act = "mxfp8_e4m3:rceil"
    u = specials(32, 256).to(device)
    g = gaussian((32, 256), seed=3).to(device)
    g[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    q = K.silu_mul_fake_quantize(g, u, act)
    assert_same_bits(q.cpu(), fake_quantize((_silu(g) * u).cpu(), act), "specials")


def _every_bf16(rows_of=256):
    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return g.reshape(-1, rows_of)


@pytest.mark.skipif(not GPU, reason="bit equality with torch's CUDA ops is a GPU fact (the "
                    "interpreter has no libdevice)")
def test_silu_and_its_backward_are_torchs_for_every_bf16_gate():
    """silu(g) for all 65536 bf16 g, and the backward against torch's autograd of
    ``F.silu(g) * u`` for every g with random incoming gradients and up values (four rounds),
    NaN and inf included."""
    g = _every_bf16().cuda()
    assert_same_bits(_silu(g).cpu(), F.silu(g).cpu(), "silu over all bf16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for r in range(4):
        dq = (torch.randn(g.shape, generator=gen, device="cuda") * 4.0 ** r).bfloat16()
        u = (torch.randn(g.shape, generator=gen, device="cuda") * 2.0 ** -r).bfloat16()
        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
        (F.silu(gl) * ul).backward(dq)
        dg, du = K.silu_mul_backward(dq, g, u)
        assert_same_bits(du.cpu(), ul.grad.cpu(), f"du, round {r}")
        assert_same_bits(dg.cpu(), gl.grad.cpu(),
                         f"dg, round {r} (SILU_BACKWARD_CONTRACT={K.api.SILU_BACKWARD_CONTRACT})")


def test_backward_matches_autograd_where_the_silus_agree(device):
    """Everywhere on a GPU; under the interpreter on the gate values whose silu agrees with
    torch's CPU one (the rest of the arithmetic is the same IEEE fp32 on both)."""
    g, u = _operands(device)
    dq = gaussian(tuple(g.shape), seed=9).to(device)
    gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
    (F.silu(gl) * ul).backward(dq)
    dg, du = K.silu_mul_backward(dq, g, u)
    agree = _silu(g) == F.silu(g)
    assert agree.float().mean() > 0.99
    assert_same_bits(du[agree].cpu(), ul.grad[agree].cpu(), "du")
    if GPU:
        assert_same_bits(dg.cpu(), gl.grad.cpu(), "dg")
    else:  # the interpreter's exp also feeds the backward's sigmoid: within an ulp there
        ulps = (dg.view(torch.int16).int() - gl.grad.view(torch.int16).int()).abs()
        assert ulps[agree].max() <= 1 and (ulps[agree] == 0).float().mean() > 0.99


def test_rejects_what_it_does_not_serve(device):
    g, u = _operands(device)
    with pytest.raises(NotImplementedError, match="MX formats"):
        K.silu_mul_fake_quantize(g, u, "nvfp4")
    with pytest.raises(ValueError, match="bf16 tensors of one shape"):
        K.silu_mul_fake_quantize(g.float(), u.float(), "mxfp8_e4m3")
    with pytest.raises(ValueError, match="bf16 tensors of one shape"):
        K.silu_mul_fake_quantize(g, u[:, :96], "mxfp8_e4m3")
    with pytest.raises(ValueError, match="blocks are 32 wide"):
        K.silu_mul_fake_quantize(g[:, :48], u[:, :48], "mxfp8_e4m3")
    with pytest.raises(ValueError, match="silu_mul_backward takes bf16"):
        K.silu_mul_backward(g, g, u.float())


# -- the QAT seam ---------------------------------------------------------------------------


def _layer(device, dtype=torch.bfloat16, E=4, D=64, F_=96, seed=0):
    torch.manual_seed(seed)
    m = nn.Module()
    m.experts = GroupedExperts(E, D, F_, device=device, dtype=dtype)
    for p in m.parameters():
        nn.init.normal_(p, std=0.05)
    return m


def _run(m, x, offs, dy):
    for p in m.parameters():
        p.grad = None
    xi = x.clone().requires_grad_()
    # fp32 masters run under bf16 autocast on a GPU, as the trainer runs them
    fp32 = m.experts.w1.dtype == torch.float32 and x.is_cuda
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fp32):
        y = m.experts(xi, offs, end=int(offs[-1]))
    y.backward(dy)
    return [y.detach(), xi.grad] + [getattr(m.experts, n).grad for n in ("w1", "w3", "w2")]


@pytest.fixture
def fused_anywhere(monkeypatch):
    """Let the seam take the fused kernel for CPU tensors too (it runs under the interpreter)."""
    def pick(g, u, recipe):
        if recipe is None or g.dtype != torch.bfloat16 or u.dtype != torch.bfloat16 \
                or not K.supports(recipe) or recipe.fmt == "nvfp4":
            return None
        return K

    monkeypatch.setattr(qg, "_fused_kernels", pick)


def _counting(monkeypatch):
    calls = {"fake_quantize": 0, "silu_mul_fake_quantize": 0}
    for name in calls:
        real = getattr(K, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(K, name, counted)
    return calls


@pytest.mark.parametrize("masters", ["bf16", "fp32"])
@pytest.mark.parametrize("recipe", ["mxfp4+mxfp8", "nvfp4+mxfp8", "mxfp8+mxfp8_e5m2"])
def test_fused_layer_is_the_unfused_layer_bit_for_bit(recipe, masters, device, monkeypatch,
                                                     request):
    """Forward output and every gradient (x, w1, w3, w2) of a prepared SwiGLU layer, with the
    fused SwiGLU and with the unfused ops, and the down projection quantizes nothing again.
    fp32 masters: under bf16 autocast on a GPU, where the GEMMs hand the SwiGLU bf16."""
    if masters == "fp32" and not GPU:
        pytest.skip("fp32 masters reach the SwiGLU as bf16 only under CUDA autocast")
    if not GPU:
        request.getfixturevalue("fused_anywhere")
    m = _layer(device, dtype=torch.float32 if masters == "fp32" else torch.bfloat16)
    offs = torch.tensor([20, 20, 45, 64], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 64, generator=gen) * 2).bfloat16().to(device)
    dy = torch.randn(64, 64, generator=gen).bfloat16().to(device)
    prepare(m, recipe, SCOPE)
    assert isinstance(m.experts.gemms, QATExpertGemms) and m.experts.gemms.fuse_act
    calls = _counting(monkeypatch)
    seen = []
    if not GPU:
        # The interpreter's exp is numpy's, not torch's: the forward's silu must agree with
        # torch's on this layer's gate values (asserted below), and the backward's dg (checked
        # on its own above: within an ulp here, bit-exact on a GPU) is torch's op, so this
        # test checks the seam's plumbing and the kernel's du exactly.
        forward, backward = K.silu_mul_fake_quantize, K.silu_mul_backward

        def watched(g, u, act):
            seen.append(torch.equal(backward(torch.ones_like(g), g, torch.ones_like(g))[1],
                                    F.silu(g)))
            return forward(g, u, act)

        def torch_dg(dq, g, u):
            return torch.ops.aten.silu_backward(dq * u, g), backward(dq, g, u)[1]

        monkeypatch.setattr(K, "silu_mul_fake_quantize", watched)
        monkeypatch.setattr(K, "silu_mul_backward", torch_dg)
    fused = _run(m, x, offs, dy)
    assert calls["silu_mul_fake_quantize"] == 1, calls
    assert all(seen), "the interpreter's silu differs from torch's on this data: pick other data"
    monkeypatch.setattr(qg, "_fused_kernels", lambda *a: None)
    calls.update(fake_quantize=0, silu_mul_fake_quantize=0)
    unfused = _run(m, x, offs, dy)
    assert calls["silu_mul_fake_quantize"] == 0
    for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), fused, unfused):
        assert_same_bits(a.cpu(), b.cpu(), f"{recipe} {name}")


@pytest.mark.skipif(not GPU, reason="counts the CUDA fake-quant launches")
def test_down_projection_takes_the_fused_output_as_it_is(monkeypatch):
    """One weight fake quantization per weight, one for the input (shared by w1 and w3), and
    the fused SwiGLU: the product's quantization is not run a second time."""
    m = _layer("cuda")
    prepare(m, "mxfp4+mxfp8", SCOPE)
    calls = _counting(monkeypatch)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32, device="cuda")
    _run(m, torch.randn(64, 64, device="cuda").bfloat16(), offs,
         torch.randn(64, 64, device="cuda").bfloat16())
    assert calls == {"fake_quantize": 4, "silu_mul_fake_quantize": 1}


def test_only_the_plain_swiglu_is_fused(fused_anywhere, device, monkeypatch):
    """The seam fuses only `act is swiglu`: another activation, even one computing the same
    values, runs as given and the down projection quantizes its output (the same bits here)."""
    m = _layer(device)
    prepare(m, "mxfp4+mxfp8", SCOPE)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32, device=device)
    x = (torch.randn(64, 64, generator=torch.Generator().manual_seed(2)) * 2).bfloat16().to(device)
    calls = _counting(monkeypatch)
    with torch.no_grad():
        fused = m.experts(x, offs, end=64)
        assert calls["silu_mul_fake_quantize"] == 1
        m.experts.act = lambda g, u: F.silu(g) * u  # not the module's swiglu object
        other = m.experts(x, offs, end=64)
    assert calls["silu_mul_fake_quantize"] == 1
    if GPU:  # the interpreter's silu may differ from torch's CPU one by an ulp
        assert_same_bits(fused.cpu(), other.cpu(), "fused vs another activation")


def test_seam_is_installed_by_prepare_and_put_back_by_unprepare():
    m = _layer("cpu")
    plain = m.experts.gemms
    prepare(m, "mxfp4", SCOPE)  # weights only: nothing to fuse
    assert isinstance(m.experts.gemms, QATExpertGemms) and m.experts.gemms.act is None
    unprepare(m)
    assert m.experts.gemms is plain
    prepare(m, "mxfp4+mxfp8", SCOPE)
    assert m.experts.gemms.fuse_act and m.experts.gemms.plain is plain
    unprepare(m)
    assert m.experts.gemms is plain
    prepare(m, "mxfp4+mxfp8", SCOPE, fuse_swiglu=False)  # the A/B's unfused side
    assert not m.experts.gemms.fuse_act
    unprepare(m)
    # CPU without the interpreter's help: no fused kernel, the down projection quantizes
    g, u = _operands("cpu")
    assert qg._fused_kernels(g, u, parse_recipe("mxfp8_e4m3")) is None
