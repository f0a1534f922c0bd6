"""gpt-oss attention on CUDA (`workbench.model.flex.attend_flex`: FlexAttention with a block
mask for the causal window, sinks through the logsumexp) against the SDPA reference
(`attend_sdpa`: a boolean mask and a sink key). FlexAttention's backward does not run on a
CPU: there the forward is checked through its eager reference; the CUDA test checks forward and
every gradient, compiled."""

from __future__ import annotations

import warnings

import pytest
import torch

from workbench.model.attention import attend, attend_sdpa
from workbench.model.flex import attend_flex

CASES = [(0, True), (64, False), (64, True), (1, True)]  # (window, sinks)


def _inputs(device, dtype=torch.float32, S=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, G, Dh = 2, 8, 2, 32

    def t(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()

    # sinks around the scores' own size, so the sink's share of each softmax is neither 0 nor 1
    return t(B, H, S, Dh), t(B, G, S, Dh), t(B, G, S, Dh), t(H)


@pytest.mark.parametrize("window,sinks", CASES)
def test_flex_forward_equals_the_sdpa_reference_on_cpu(window, sinks):
    q, k, v, s = (t.detach() for t in _inputs("cpu"))
    ref = attend_sdpa(q, k, v, scale=32 ** -0.5, window=window, sinks_H=s if sinks else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile": on purpose
        got = attend_flex(q, k, v, scale=32 ** -0.5, window=window,
                          sinks_H=s if sinks else None, compiled=False)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_attend_keeps_the_reference_on_cpu():
    q, k, v, s = _inputs("cpu")
    with torch.no_grad():
        a = attend(q, k, v, scale=0.2, window=64, sinks_H=s)
        b = attend_sdpa(q, k, v, scale=0.2, window=64, sinks_H=s)
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("window,sinks,dtype", [(0, True, torch.float32), (64, True, torch.float32),
                                                (64, True, torch.bfloat16)])
def test_flex_forward_and_gradients_equal_the_reference_on_cuda(window, sinks, dtype):
    S = 640  # five 128-row blocks, the window inside them (a partial block: test_families_gpu)
    leaves = _inputs("cuda", dtype, S=S)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    q, k, v, s = leaves
    qr, kr, vr, sr = ref_leaves
    out = attend(q, k, v, scale=32 ** -0.5, window=window, sinks_H=s if sinks else None)
    ref = attend_sdpa(qr.float(), kr.float(), vr.float(), scale=32 ** -0.5, window=window,
                      sinks_H=sr.float() if sinks else None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to("cuda")
    out.float().mul(g).sum().backward()
    ref.mul(g).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), ref, **tol)
    for name, a, b in zip("qkvs", leaves, ref_leaves):
        if name == "s" and not sinks:
            continue
        torch.testing.assert_close(a.grad.float(), b.grad.float(), **tol, msg=lambda m, n=name:
                                   f"d{n}: {m}")
