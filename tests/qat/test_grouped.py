"""The grouped fake-quant GEMM: STE gradients, routing edge cases, torchao equivalence, DCP, compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workbench.formats import fake_quantize, parse_recipe
from workbench.qat import fake_quant_ste, grouped_mm, prepare, register_fake_quant_hook
from workbench.scope import QuantScope

W, A = parse_recipe("mxfp4"), parse_recipe("mxfp8_e4m3")


def _data(offs, D=64, O=32, E=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(offs) if E is None else E
    T = (offs[-1] if offs else 0) + 3  # 3 trailing rows routed to no expert
    x = (torch.randn(T, D, generator=g) * 3).bfloat16().requires_grad_()
    w = (torch.randn(E, O, D, generator=g) * 0.05).bfloat16().requires_grad_()
    return x, w, torch.tensor(offs, dtype=torch.int32)


def _independent(x, w, offs, dy):
    """Quantized operands as leaves, a plain per-expert loop, autograd for the gradients."""
    wq = torch.stack([fake_quantize(w[e].detach(), W) for e in range(w.shape[0])]).requires_grad_()
    xq = fake_quantize(x.detach(), A).requires_grad_()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = xq[start:end] @ wq[e].t()
        start = end
    out.backward(dy)
    return out.detach(), xq.grad, wq.grad


@pytest.mark.parametrize("offs", [(5, 5, 12, 16), (0, 0, 0, 9), (7, 7, 7, 7), (0, 0, 0, 0)],
                         ids=["ragged+empty", "one-expert", "trailing-empty", "all-empty"])
def test_forward_and_ste_gradients(offs):
    x, w, offs_t = _data(list(offs))
    y = grouped_mm(x, w, offs_t, weight=W, act=A)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = _independent(x, w, offs_t, dy)
    assert torch.equal(y.detach(), ref_y)
    # STE: the gradient w.r.t. the BF16 master is the gradient w.r.t. its quantized image
    assert torch.equal(x.grad, ref_dx)
    assert torch.equal(w.grad, ref_dw)
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert torch.equal(y[offs_t[-1]:].detach(), torch.zeros_like(y[offs_t[-1]:]))


def test_ste_is_identity_even_where_values_clip():
    x = torch.tensor([[1000.0] + [1.0] * 31]).requires_grad_()  # FLOOR clips the block amax
    g = torch.randn(1, 32)
    fake_quant_ste(x, parse_recipe("mxfp4:floor")).backward(g)
    assert torch.equal(x.grad, g)


def test_w_EDF_down_projection_shapes():
    x, w, offs = _data([4, 9], D=32, O=64)  # down proj: x_TF, w [E, D, F]
    y = grouped_mm(x, w, offs, weight=W, act=A)
    assert y.shape == (x.shape[0], 64)


def test_matches_torchao_emulated_mx_linear():
    """torchao's MX QAT Linear: emulated MX matmul forward, dequantized-operand backward."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.qat.mx import MXFakeQuantizeConfig, MXFakeQuantizedLinear

    torch.manual_seed(0)
    lin = nn.Linear(128, 64, bias=False).bfloat16()
    ours = nn.Sequential()
    ours.add_module("proj", nn.Linear(128, 64, bias=False).bfloat16())
    ours.proj.weight = nn.Parameter(lin.weight.detach().clone())
    ao = MXFakeQuantizedLinear.from_linear(
        lin,
        activation_config=MXFakeQuantizeConfig(torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL),
        weight_config=MXFakeQuantizeConfig(torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.RCEIL),
    )
    prepare(ours, "mxfp4:rceil+mxfp8_e4m3:rceil", QuantScope.from_patterns(["Linear"]))
    x = torch.randn(4, 16, 128).bfloat16()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_ao = ours(x1), ao(x2)
    assert torch.equal(y_ours, y_ao)
    dy = torch.randn_like(y_ours)
    y_ours.backward(dy)
    y_ao.backward(dy)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ours.proj.weight.grad, ao.weight.grad)


def test_dcp_roundtrip_of_prepared_model(tmp_path):
    import torch.distributed.checkpoint as dcp

    from workbench.model.experts import GroupedExperts

    def model(seed):
        torch.manual_seed(seed)
        m = nn.Module()
        m.experts = GroupedExperts(4, 64, 32)
        for p in m.parameters():
            nn.init.normal_(p, std=0.05)
        prepare(m, "mxfp4+mxfp8", QuantScope.from_patterns(["re:experts$"]))
        return m

    a, b = model(0), model(1)
    dcp.save(a.state_dict(), checkpoint_id=str(tmp_path / "ck"))
    sd = b.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"))  # no add_safe_globals needed
    b.load_state_dict(sd)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


def test_fake_quant_path_compiles_without_graph_breaks():
    def f(x, w):
        return fake_quant_ste(x, A) @ fake_quant_ste(w, W).t()

    x, w = torch.randn(8, 64), torch.randn(16, 64)
    explanation = torch._dynamo.explain(f)(x, w)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, w), f(x, w))


def test_prepared_linear_experts_compile_with_zero_graph_breaks():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from qat_styles_zoo import build

    m = nn.Module()
    m.layers = nn.ModuleList([build("hf-linear")])
    prepare(m, "mxfp4+mxfp8", "routed-experts")
    x, offs = torch.randn(16, 64).bfloat16(), torch.tensor([5, 5, 12, 16], dtype=torch.int32)

    def fwd(x, offs):
        return m.layers[0](x, offs)

    explanation = torch._dynamo.explain(fwd)(x, offs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # aot_eager keeps eager kernels, so the traced graph must reproduce eager bit for bit
    assert torch.equal(torch.compile(fwd, backend="aot_eager")(x, offs), fwd(x, offs))


def _swiglu_experts(seed=0, E=4, D=64, F=32):
    from workbench.model.experts import GroupedExperts

    torch.manual_seed(seed)
    m = nn.Module()
    m.experts = GroupedExperts(E, D, F, dtype=torch.bfloat16)
    for p in m.parameters():
        nn.init.normal_(p, std=0.05)
    return m


def test_gate_up_quantizes_its_input_once_and_both_gemms_read_it(monkeypatch):
    """w1 and w3 read the same activations: the seam quantizes them once and hands the one
    quantized tensor to both GEMMs (one more activation quantization for w2's input), with
    outputs and gradients equal to quantizing each operand on its own."""
    import workbench.model.grouped as plain

    offs = torch.tensor([5, 9, 9, 16], dtype=torch.int32)
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    m = _swiglu_experts()
    prepare(m, "mxfp4+mxfp8", QuantScope.from_patterns(["re:experts$"]))
    quantized = []  # every fake quantization, through qat's public observer seam
    handle = register_fake_quant_hook(lambda call, t: quantized.append(tuple(t.shape)) or call())
    gemm_inputs = []
    real_mm = plain.grouped_mm
    monkeypatch.setattr(plain, "grouped_mm", lambda a, w, o, **kw: gemm_inputs.append(a)
                        or real_mm(a, w, o, **kw))
    try:
        xi = x.clone().requires_grad_()
        y = m.experts(xi, offs)
        dy = torch.randn_like(y)
        y.backward(dy)
    finally:
        handle.remove()
    # weights w1, w3, w2 ([4, 32, 64], [4, 32, 64], [4, 64, 32]) and two activations
    assert sorted(quantized) == sorted([(4, 32, 64), (4, 32, 64), (4, 64, 32), (16, 64), (16, 32)])
    assert len(gemm_inputs) == 3 and gemm_inputs[0] is gemm_inputs[1]
    assert torch.equal(gemm_inputs[0], fake_quantize(x, A))

    # The same layer by hand: every operand quantized on its own, autograd through leaves.
    e = m.experts
    xq = fake_quantize(x, A).requires_grad_()
    wq = {n: torch.stack([fake_quantize(getattr(e, n)[i].detach(), W) for i in range(4)])
          .requires_grad_() for n in ("w1", "w3", "w2")}

    def mm(a, w):
        out, start = [], 0
        for i, end in enumerate(offs.tolist()):
            out.append(a[start:end] @ w[i].t())
            start = end
        return torch.cat(out)

    h = torch.nn.functional.silu(mm(xq, wq["w1"])) * mm(xq, wq["w3"])
    hq = fake_quantize(h.detach(), A).requires_grad_()
    ref = mm(hq, wq["w2"])
    ref.backward(dy)
    h.backward(hq.grad)
    assert torch.equal(y.detach(), ref.detach())
    assert torch.equal(xi.grad, xq.grad)
    for n in ("w1", "w3", "w2"):
        assert torch.equal(getattr(e, n).grad, wq[n].grad), n


def test_down_applies_the_models_activation_then_quantizes_it():
    """A family with another activation (gpt-oss's clamped SwiGLU, say) keeps it under QAT: the
    seam applies the module's `act` and quantizes its output for w2, whatever the function."""
    offs = torch.tensor([5, 9, 9, 16], dtype=torch.int32)
    x = (torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    m = _swiglu_experts()
    e = m.experts
    e.act = lambda g, u: torch.clamp(g, max=0.5).sigmoid() * (u + 1)  # not swiglu
    prepare(m, "mxfp4+mxfp8", QuantScope.from_patterns(["re:experts$"]))
    with torch.no_grad():
        y = e(x, offs)
        xq = fake_quantize(x, A)
        wq = {n: torch.stack([fake_quantize(getattr(e, n)[i], W) for i in range(4)])
              for n in ("w1", "w3", "w2")}
        g = torch.cat([xq[a:b] @ wq["w1"][i].t() for i, (a, b) in enumerate(zip([0, 5, 9, 9], offs.tolist()))])
        u = torch.cat([xq[a:b] @ wq["w3"][i].t() for i, (a, b) in enumerate(zip([0, 5, 9, 9], offs.tolist()))])
        hq = fake_quantize(torch.clamp(g, max=0.5).sigmoid() * (u + 1), A)
        ref = torch.cat([hq[a:b] @ wq["w2"][i].t() for i, (a, b) in enumerate(zip([0, 5, 9, 9], offs.tolist()))])
    assert torch.equal(y, ref)
