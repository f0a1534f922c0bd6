"""The CUDA fast path of workbench.qat.grouped_mm (Triton fake quant + torch._grouped_mm) against
the reference loop: same quantized operands (bit-exact), products and gradients equal up to the
GEMM's accumulation order; ragged, empty and tail routing; the STE dispatch picks Triton."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need Triton (the gpu extra)")

from workbench import formats as F
from workbench.qat import fake_quant_reference, grouped_mm
from workbench.qat.ste import _fq

from .inputs import assert_same_bits

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("weight,act", [("mxfp4", "mxfp8"), ("nvfp4", None), (None, None)])
def test_fast_path_matches_loop(weight, act):
    torch.manual_seed(0)
    E, O, I = 4, 256, 512
    counts = [64, 0, 200, 37]  # an empty expert, ragged groups, 19 tail rows past offs[-1]
    T = sum(counts) + 19
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, O, I, device="cuda", dtype=torch.bfloat16) * 0.05
    act = None if act is None else "mxfp8_e4m3"
    outs = []
    for mode in ("fast", "loop"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if mode == "fast":
            y = grouped_mm(xi, wi, offs, weight=weight, act=act)
        else:  # the reference loop on CPU
            xc, wc = xi.cpu(), wi.cpu()
            y = grouped_mm(xc, wc, offs.cpu(), weight=weight, act=act)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
        (y * g).sum().backward()
        outs.append((y.detach().cpu(), xi.grad.cpu(), wi.grad.cpu()))
    (yf, dxf, dwf), (yl, dxl, dwl) = outs
    assert _rel(yf, yl) < 1e-2 and _rel(dxf, dxl) < 1e-2 and _rel(dwf, dwl) < 1e-2
    assert torch.all(yf[sum(counts):] == 0) and torch.all(dxf[sum(counts):] == 0)
    assert torch.all(dwf[1] == 0), "an expert with no rows gets a zero weight gradient"
    assert torch.isfinite(dwf).all() and torch.isfinite(dxf).all()
    # y.sum(): an expanded gradient must pass
    xi = x.clone().requires_grad_()
    grouped_mm(xi, w, offs, weight=weight, act=act).sum().backward()
    assert torch.isfinite(xi.grad).all()


def test_ste_dispatch_uses_triton_and_matches_reference(caplog):
    from workbench.qat import ste

    recipe = F.parse_recipe("nvfp4:te")
    w = torch.randn(4, 128, 256, dtype=torch.bfloat16) * 0.02
    ste._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="workbench.qat.ste"):
        got = _fq(w.cuda(), recipe, -1, True).cpu()
    assert_same_bits(got, fake_quant_reference(w, recipe, per_leading=True), "nvfp4 per expert")
    assert any("nvfp4:te on cuda: triton path" in r.getMessage() for r in caplog.records)
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    r = F.parse_recipe("mxfp8_e4m3")
    assert_same_bits(_fq(x.cuda(), r, 0, False).cpu(), fake_quant_reference(x, r, dim=0), "dim 0")


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4+mxfp8", "nvfp4", "nvfp4+mxfp8",
                                    "nvfp4+book"])
def test_expert_layer_never_waits_for_the_host(recipe):
    """With the routed row count given (as the dispatchers give it), a prepared expert layer's
    forward and backward run without one host-device sync (CUDA's sync debug mode raises on
    any), and give the same output as the syncing call; "+book": the NVFP4 amax from the
    trainer's amax book (`QATState`), as after an optimizer step."""
    from torch import nn

    from workbench import kernels
    from workbench.model.experts import GroupedExperts
    from workbench.qat import QATState, expert_amax, prepare
    from workbench.scope import QuantScope

    torch.manual_seed(0)
    m = nn.Module()
    m.experts = GroupedExperts(4, 256, 128, device="cuda", dtype=torch.bfloat16)
    for p in m.parameters():
        nn.init.normal_(p, std=0.05)
    state = QATState() if recipe.endswith("+book") else None
    if recipe != "bf16":
        prepare(m, recipe.removesuffix("+book"), QuantScope.from_patterns(["re:experts$"]),
                state=state)
    if state is not None:
        for n, p in m.named_parameters():
            state.put(n, p, expert_amax(p, kernels))
    offs = torch.tensor([64, 64, 200, 256], dtype=torch.int32, device="cuda")
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = m.experts(x, offs).detach()  # warm-up: autotuning, allocations
    m.experts(x, offs, end=256).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = m.experts(x, offs, end=256)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y.detach(), ref)


@pytest.mark.parametrize("weight,act", [("nvfp4", None), ("nvfp4", "mxfp8_e4m3"),
                                        ("mxfp4", "mxfp8_e4m3")])
def test_fp32_masters_under_autocast_are_fake_quantized_into_bf16(weight, act, monkeypatch):
    """The trainer's case (fp32 masters, bf16 autocast): the kernels write the GEMM's bf16
    operands themselves, and output and gradients equal the fp32 fake quantization followed by
    autocast's cast (the path without out_dtype)."""
    from workbench.qat import grouped as qg
    from workbench.qat import ste

    torch.manual_seed(3)
    E, D, F, n = 4, 256, 128, 64
    x0 = torch.randn(E * n, D, device="cuda")
    w0 = torch.randn(E, F, D, device="cuda") * torch.logspace(-1, 1, E, device="cuda")[:, None, None]
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * n

    def run():
        x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
        outs = []
        h = ste.register_fake_quant_hook(lambda call, t: outs.append(call()) or outs[-1])
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = qg.grouped_mm(x, w, offs, weight=weight, act=act, end=E * n)
            y.float().square().sum().backward()
        finally:
            h.remove()
        return y, x.grad, w.grad, [o.dtype for o in outs]

    y, gx, gw, fused = run()
    monkeypatch.setattr(qg, "_narrowing", lambda t, dt: None)
    y_ref, gx_ref, gw_ref, plain_dt = run()
    assert set(fused) == {torch.bfloat16} and set(plain_dt) == {torch.float32}
    assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)
