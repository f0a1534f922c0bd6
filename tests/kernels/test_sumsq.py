"""The one-pass fp64 sum of squares (``kernels.sumsq.sum_of_squares``) and the trainer's two users
of it: ``global_grad_norm`` (the kernel for CUDA gradients) and ``_clip_`` (one foreach multiply
per device and dtype).

The oracle is ``math.fsum`` of the squares taken in Python floats: an fp32 or bf16 value's square
is exact in a double, and fsum rounds the exact sum once, so the kernel (whose fp64 additions
round in its own fixed order) must sit within a few ulps of n of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from workbench.kernels.sumsq import sum_of_squares
from workbench.train import loop
from workbench.train.distributed import DistInfo

from .inputs import gaussian

# every addition rounds at most once by 2^-53 and the terms are positive: the relative error of
# any order of summation of n terms is below n * 2^-53; the sizes here stay under 2^17 terms
REL = 2.0**17 * 2.0**-53


def _exact(x: torch.Tensor) -> float:
    return math.fsum(v * v for v in x.double().flatten().tolist())


def _check(x: torch.Tensor, **tiling) -> torch.Tensor:
    got = sum_of_squares(x, **tiling)
    assert got.dtype == torch.float64 and got.dim() == 0 and got.device == x.device
    want = _exact(x)
    assert math.isclose(got.item(), want, rel_tol=REL, abs_tol=0.0), (got.item(), want)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 4096 * 3 + 5])
def test_matches_the_exact_sum(device, dtype, n):
    x = gaussian((n,), dtype=dtype, seed=n).to(device)
    _check(x)


@pytest.mark.parametrize("block,max_programs", [(16, 1), (16, 7), (64, 3), (256, 1000)])
def test_many_programs_and_loop_iterations(device, block, max_programs):
    # 10007 elements: a ragged tail in the last program's last iteration, and (with few programs)
    # many iterations per program, so the mask and the per-program offsets are both exercised
    x = gaussian((10007,), dtype=torch.float32, seed=3).to(device)
    got = _check(x, block=block, max_programs=max_programs)
    # the same tiling gives the same bits (no atomics)
    assert torch.equal(got, sum_of_squares(x, block=block, max_programs=max_programs))


def test_squares_are_exact_in_fp64(device):
    # (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46: 47 significant bits, lost by any fp32 square
    x = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32, device=device)
    assert sum_of_squares(x).item() == 1.0 + 2.0**-22 + 2.0**-46
    # the smallest fp32 subnormal squares to 2^-298, a normal double
    tiny = torch.tensor([2.0**-149], dtype=torch.float32, device=device)
    assert sum_of_squares(tiny).item() == 2.0**-298
    # bf16 subnormals are not flushed: 2^-133 is the smallest
    sub = torch.tensor([2.0**-133, -(2.0**-130)], dtype=torch.bfloat16, device=device)
    assert sum_of_squares(sub).item() == 2.0**-266 + 2.0**-260


def test_multidimensional_tensor_is_flattened(device):
    x = gaussian((3, 5, 64), dtype=torch.bfloat16, seed=9).to(device)
    _check(x)


def test_empty_is_zero(device):
    got = sum_of_squares(torch.empty(0, 4, device=device))
    assert got.item() == 0.0 and got.dtype == torch.float64


def test_nan_and_inf_propagate(device):
    x = torch.ones(100, device=device)
    x[37] = float("inf")
    assert sum_of_squares(x).item() == math.inf
    x[38] = float("nan")
    assert math.isnan(sum_of_squares(x).item())
    # -inf squares to +inf
    assert sum_of_squares(torch.tensor([-math.inf], device=device)).item() == math.inf


def test_rejects(device):
    with pytest.raises(TypeError, match="fp32/bf16"):
        sum_of_squares(torch.ones(4, dtype=torch.float16, device=device))
    with pytest.raises(TypeError, match="fp32/bf16"):
        sum_of_squares(torch.ones(4, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        sum_of_squares(torch.ones(8, 8, device=device).t())
    with pytest.raises(ValueError, match="power of two"):
        sum_of_squares(torch.ones(8, device=device), block=48)
    with pytest.raises(ValueError, match="max_programs"):
        sum_of_squares(torch.ones(8, device=device), max_programs=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: 4.3 GB past int32 offsets")
def test_offsets_past_int32_on_gpu():
    # 2^31 + 4097 bf16 elements: programs past element 2^31 - 1 need 64-bit offsets; ones with
    # three 3.0s at the end sum to n + 24 exactly (n < 2^53)
    n = 2**31 + 4097
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    x[-3:] = 3.0
    assert sum_of_squares(x).item() == n + 24
    del x
    torch.cuda.empty_cache()


# -- the trainer's users ---------------------------------------------------------------------

def _model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32, bias=False))
    m[1].to(torch.bfloat16)
    for p in m.parameters():
        p.grad = (torch.randn(p.shape) * 3.0).to(p.dtype)
    return m


def _info(device="cpu") -> DistInfo:
    return DistInfo(rank=0, world=1, local_rank=0, device=torch.device(device), group=None,
                    owns_group=False)


def _exact_norm(m: nn.Module) -> float:
    return math.sqrt(math.fsum(v * v for p in m.parameters()
                               for v in p.grad.double().flatten().tolist()))


def test_cpu_gradients_keep_torch_ops():
    # the CPU trainer's bits are unchanged: the kernel is for CUDA gradients only
    assert not loop._use_sumsq_kernel(torch.ones(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel branch of CUDA gradients")
def test_cuda_gradients_take_the_kernel(monkeypatch):
    m = _model().cuda()
    assert all(loop._use_sumsq_kernel(p.grad) for p in m.parameters())
    calls = []
    real = loop.sum_of_squares
    monkeypatch.setattr(loop, "sum_of_squares", lambda g: calls.append(g.shape) or real(g))
    got = loop.global_grad_norm(m, _info("cuda"))
    assert len(calls) == len(list(m.parameters()))
    assert math.isclose(got.item(), _exact_norm(m), rel_tol=REL, abs_tol=0.0)


def test_grad_norm_through_the_kernel(monkeypatch, device):
    m = _model().to(device)
    unpatched = loop.global_grad_norm(m, _info(device))
    # the CUDA branch (on a CPU-only machine run by the interpreter on CPU gradients)
    monkeypatch.setattr(loop, "_use_sumsq_kernel", lambda g: True)
    via_kernel = loop.global_grad_norm(m, _info(device))
    want = _exact_norm(m)
    for got in (unpatched, via_kernel):
        assert math.isclose(got.item(), want, rel_tol=REL, abs_tol=0.0), (got.item(), want)


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_is_the_per_tensor_multiply(max_norm):
    m, ref = _model(seed=1), _model(seed=1)
    norm = loop.global_grad_norm(m, _info())
    loop._clip_(m, norm, max_norm)
    # the rule, written per tensor: the coefficient rounded to the gradient's dtype, one product
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
    for p in ref.parameters():
        p.grad.mul_(coef.to(p.grad.dtype))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == q.grad.dtype
        assert torch.equal(p.grad.view(torch.int16 if p.grad.dtype == torch.bfloat16
                                       else torch.int32),
                           q.grad.view(torch.int16 if q.grad.dtype == torch.bfloat16
                                       else torch.int32)), name
    if max_norm < norm.item():
        # and it clipped: the new norm is max_norm (to the dtypes' rounding)
        assert loop.global_grad_norm(m, _info()).item() == pytest.approx(max_norm, rel=1e-2)


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_clip_off_leaves_gradients(max_norm):
    m, ref = _model(seed=2), _model(seed=2)
    loop._clip_(m, torch.tensor(1e6, dtype=torch.float64), max_norm)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
