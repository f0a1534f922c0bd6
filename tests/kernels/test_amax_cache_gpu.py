"""On CUDA, NVFP4 expert weights through the STE: the kernel amax (one launch over the stack) and
the one-pass Triton quantize give the reference's bits per expert, whether the amax is computed
in the forward or handed in from the trainer's amax book (`workbench.qat.QATState`), before and
after an in-place update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the kernels need Triton (the gpu extra)")

from workbench.formats import fake_quantize, parse_recipe
from workbench.qat import QATState, expert_amax, ste

from .inputs import assert_same_bits


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvfp4:torchao", "nvfp4:te"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_amax_computed_or_from_the_book_matches_reference_per_expert(recipe, dtype):
    from workbench import kernels

    r = parse_recipe(recipe)
    torch.manual_seed(0)
    scale = torch.logspace(-2, 2, 6)[:, None, None]
    w = nn.Parameter((torch.randn(6, 256, 512) * scale).to(dtype).cuda())
    state = QATState()
    state.want("w")
    for update in range(3):
        ref = torch.stack([fake_quantize(w[e].detach().cpu(), r) for e in range(6)])
        assert_same_bits(ste.fake_quant_ste(w, r, per_leading=True).cpu(), ref)
        state.put("w", w, expert_amax(w, kernels))
        amax = state.amax("w", w)
        assert amax is not None
        assert_same_bits(ste.fake_quant_ste(w, r, per_leading=True, global_amax=amax).cpu(), ref)
        with torch.no_grad():
            w.mul_(torch.rand(6, 1, 1, device="cuda", dtype=dtype) + 0.5)
        assert state.amax("w", w) is None  # the write is seen


@pytest.mark.parametrize("recipe", ["nvfp4:torchao", "nvfp4:te"])
def test_kernel_amax_then_one_pass_equals_reference(recipe, device):
    """What the STE runs on CUDA (under the interpreter on CPU): the kernel amax, bit-equal to
    torch's, then the quantize with the amax given."""
    from workbench import kernels

    r = parse_recipe(recipe)
    torch.manual_seed(1)
    scale = torch.logspace(-3, 1, 3)[:, None, None]
    w = nn.Parameter((torch.randn(3, 16, 256) * scale).to(torch.bfloat16).to(device))
    amax = expert_amax(w, kernels)
    assert torch.equal(amax.cpu(), expert_amax(w.cpu()))
    ref = torch.stack([fake_quantize(w[e].detach().cpu(), r) for e in range(3)])
    assert_same_bits(kernels.fake_quantize(w.detach(), r, global_amax=amax).cpu(), ref)
