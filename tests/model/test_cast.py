"""The fp32-master -> bf16 cast with the one-pass gradient widening (``workbench.model.cast``,
``workbench.kernels.cast.widen_bf16``): the bits of ``.float()`` for every bf16 value, the bits
of autocast's own cast for ``Linear``, the router and the grouped expert GEMM, forward and
backward. The widening runs under the Triton interpreter on CPU; the autocast comparisons need
a GPU (autocast's CUDA casts are what is replaced)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workbench.kernels.cast import widen_bf16
from workbench.model import cast
from workbench.model.cast import Linear, _MasterCast, autocast_operand
from workbench.model.grouped import grouped_mm

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _i16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _every_bf16() -> torch.Tensor:
    # all 65536 bit patterns: zeros, subnormals, normals, infinities, NaNs with every payload
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_widen_is_the_exact_float_of_every_bf16_value():
    x = _every_bf16().to(DEV)
    got = widen_bf16(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    # the widening by definition: the 16 bits in the high half of an fp32 word
    want = (x.view(torch.int16).to(torch.int32) << 16)
    assert torch.equal(_i32(got), want)


@pytest.mark.parametrize("shape", [(1,), (15,), (1000,), (3, 7, 33)])
def test_widen_tiles_and_shapes(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 1e3).bfloat16().to(DEV)
    got = widen_bf16(x, block=16)  # many programs, a ragged last one
    assert got.shape == x.shape and torch.equal(got, x.float())


def test_widen_empty_and_rejects():
    assert widen_bf16(torch.empty(0, 3, dtype=torch.bfloat16, device=DEV)).shape == (0, 3)
    with pytest.raises(TypeError, match="bf16"):
        widen_bf16(torch.ones(4, device=DEV))
    with pytest.raises(ValueError, match="contiguous"):
        widen_bf16(torch.ones(4, 4, dtype=torch.bfloat16, device=DEV).t())
    with pytest.raises(ValueError, match="power of two"):
        widen_bf16(torch.ones(4, dtype=torch.bfloat16, device=DEV), block=24)


def test_master_cast_function_bits():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 48, generator=g) * 3).to(DEV).requires_grad_()
    y = _MasterCast.apply(w)
    assert y.dtype == torch.bfloat16 and torch.equal(_i16(y), _i16(w.detach().to(torch.bfloat16)))
    gy = torch.randn(64, 48, generator=g).bfloat16().to(DEV)
    (gw,) = torch.autograd.grad(y, w, gy)
    assert gw.dtype == torch.float32 and torch.equal(_i32(gw), _i32(gy.float()))
    # a non-contiguous incoming gradient takes torch's copy, the same values
    y = _MasterCast.apply(w)
    gt = torch.randn(48, 64, generator=g).bfloat16().to(DEV).t()
    (gw,) = torch.autograd.grad(y, w, gt)
    assert torch.equal(gw, gt.float())


def test_without_cuda_autocast_nothing_changes():
    w = torch.randn(8, 4, requires_grad=True)
    assert autocast_operand(w) is w and autocast_operand(None) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_operand(w) is w  # CPU autocast is not the trainer's (loop._autocast)


def test_linear_is_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    lin = Linear(16, 8)
    lin.load_state_dict(ref.state_dict())
    assert isinstance(lin, nn.Linear) and list(lin.state_dict()) == list(ref.state_dict())
    x = torch.randn(5, 16)
    assert torch.equal(lin(x), ref(x))


# -- CUDA autocast: the replaced casts -------------------------------------------------------

def _spy(monkeypatch):
    calls = []
    monkeypatch.setattr(cast, "widen_bf16", lambda g: calls.append(tuple(g.shape)) or widen_bf16(g))
    return calls


@pytest.mark.skipif(not GPU, reason="CUDA autocast's casts are what is replaced")
@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_autocast_has_nn_linears_bits(monkeypatch, bias):
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    ref = nn.Linear(256, 96, bias=bias).cuda()
    lin = Linear(256, 96, bias=bias).cuda()
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(4, 33, 256, device="cuda")
    outs = []
    for m in (ref, lin):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(xi)
        y.float().pow(2).sum().backward()
        outs.append((y, xi.grad, m.weight.grad, m.bias.grad if bias else None))
    for a, b in zip(*outs):
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert sorted(calls) == sorted([(96, 256)] + ([(96,)] if bias else []))


@pytest.mark.skipif(not GPU, reason="CUDA autocast's casts are what is replaced")
def test_plain_cast_where_no_gradient_is_wanted(monkeypatch):
    calls = _spy(monkeypatch)
    w = torch.randn(8, 8, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.no_grad():
            assert autocast_operand(w).grad_fn is None
        assert autocast_operand(w.detach()).dtype == torch.bfloat16
        bf = w.detach().bfloat16()
        assert autocast_operand(bf) is bf  # already the autocast dtype: nothing to cast
        # and where one is, the cast is ours (its backward widens; nothing ran backward here)
        assert type(autocast_operand(w).grad_fn).__name__ == "_MasterCastBackward"
    assert calls == []


@pytest.mark.skipif(not GPU, reason="CUDA autocast's casts are what is replaced")
def test_grouped_mm_weight_gradient_bits(monkeypatch):
    calls = _spy(monkeypatch)
    torch.manual_seed(0)
    w = torch.randn(4, 64, 128, device="cuda")
    x = torch.randn(40, 128, device="cuda")
    offs = torch.tensor([8, 8, 24, 40], device="cuda", dtype=torch.int32)
    gy = torch.randn(40, 64, device="cuda")
    grads = []
    for use_cast in (False, True):
        wi = w.clone().requires_grad_()
        if not use_cast:
            monkeypatch.setattr("workbench.model.grouped.autocast_operand",
                                lambda t: t.to(torch.bfloat16))
        else:
            monkeypatch.setattr("workbench.model.grouped.autocast_operand", autocast_operand)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = grouped_mm(x, wi, offs, end=40)
        (y.float() * gy).sum().backward()
        grads.append((y, wi.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert calls == [(4, 64, 128)]
