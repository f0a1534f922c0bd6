"""On CUDA the fused AdamW updates are torch.optim.AdamW(foreach=False) bit for bit (params and
moments): an NVFP4 expert stack (5 steps, bf16: the last op fused; fp32: the whole step), which
also hands its amax sink (a ``QATState``) the exact per-expert amax (NaN payload included: every
NaN result is canonical on the GPU); fp32 matrices through the whole step, one with more chunks
than a grid's second axis holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="the fused path needs Triton (the gpu extra)")

from workbench.qat import QATState
from workbench.train.optim import AdamW


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_update_is_torch_adamw_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    init = (torch.randn(6, 128, 256, generator=g) * torch.logspace(-3, 3, 6)[:, None, None])
    init[1] = 0  # an all-zero expert
    w, ref_w = (nn.Parameter(init.to(dtype).cuda()) for _ in range(2))
    holder = nn.Module()
    holder.w = w
    state = QATState()
    state.want("w")
    ours = AdamW([w], lr=1e-2, weight_decay=0.1, foreach=False,
                 amax_sink=state.optimizer_sink(holder))
    ref = torch.optim.AdamW([ref_w], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        grad = torch.randn(init.shape, generator=g) * 10.0 ** (step % 3 - 1)
        grad[1] = 0
        grad[3, 2, 1] = float("nan")
        w.grad, ref_w.grad = (grad.to(dtype).cuda() for _ in range(2))
        before = w._version
        ours.step()
        ref.step()
        # bf16: weight decay's mul_, then the kernel's write; fp32: the whole step's write
        assert w._version > before + (dtype == torch.bfloat16)
        assert torch.equal(_bits(w.detach()), _bits(ref_w.detach()))
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ours.state[w][k]), _bits(ref.state[ref_w][k]))
        seeded = state.amax("w", w)  # the optimizer's, for the values it wrote
        assert seeded is not None
        want = w.detach().abs().amax(dim=(-2, -1), keepdim=True).float()
        assert torch.equal(_bits(seeded), _bits(want))
        assert seeded[3].isnan().all() and seeded[1].eq(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape, steps", [((1000, 777), 5), ((65536 * 4096 + 5,), 1)],
                         ids=["matrix", "over-65535-chunks"])
def test_cuda_whole_step_of_fp32_tensors_is_torch_adamw_bit_for_bit(shape, steps):
    g = torch.Generator(device="cuda").manual_seed(1)
    init = torch.randn(shape, generator=g, device="cuda")
    w, ref_w = nn.Parameter(init.clone()), nn.Parameter(init)
    ours = AdamW([w], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    ref = torch.optim.AdamW([ref_w], lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=False)
    assert ours._whole(w, init, init, init)
    for step in range(steps):
        grad = torch.randn(shape, generator=g, device="cuda") * 10.0 ** (step % 3 - 1)
        grad.view(-1)[7] = float("nan")
        w.grad, ref_w.grad = grad, grad.clone()
        ours.step()
        ref.step()
        assert torch.equal(_bits(w.detach()), _bits(ref_w.detach())), step
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(_bits(ours.state[w][k]), _bits(ref.state[ref_w][k])), (step, k)
