"""qat's hook seam: observers wrap every fake quantization without patching qat's modules."""

from __future__ import annotations

import pytest
import torch

from workbench.formats import fake_quantize, parse_recipe
from workbench.qat import fake_quant_reference, fake_quant_ste, register_fake_quant_hook

MX = parse_recipe("mxfp4")


def test_hook_wraps_each_call_once_and_its_result_is_returned():
    seen = []

    def hook(call, x):
        seen.append(tuple(x.shape))
        return call() * 2  # what the hook returns is what the caller gets

    x = torch.randn(64, 8)
    handle = register_fake_quant_hook(hook)
    try:
        y = fake_quant_ste(x, MX, dim=0)  # transposed inside: still one call for the hook
        r = fake_quant_reference(torch.randn(2, 32), MX)
    finally:
        handle.remove()
    assert seen == [(64, 8), (2, 32)]  # the caller's tensor, not the transposed copy
    want = fake_quantize(x.t().contiguous(), MX).t()  # the codec itself, independent of qat
    torch.testing.assert_close(y, 2 * want, rtol=0, atol=0)
    assert r.shape == (2, 32)
    seen.clear()
    fake_quant_ste(x, MX, dim=0)
    assert seen == []  # removed


def test_the_first_registered_hook_is_outermost_and_backward_passes_no_hook():
    order = []

    def make(tag):
        def hook(call, x):
            order.append(f"{tag}<")
            out = call()
            order.append(f">{tag}")
            return out
        return hook

    handles = [register_fake_quant_hook(make("a")), register_fake_quant_hook(make("b"))]
    try:
        x = torch.randn(4, 32, requires_grad=True)
        fake_quant_ste(x, MX).sum().backward()
    finally:
        for h in handles:
            h.remove()
    assert order == ["a<", "b<", ">b", ">a"]
    assert torch.equal(x.grad, torch.ones_like(x))  # identity STE


def test_a_hook_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        register_fake_quant_hook("time it")
