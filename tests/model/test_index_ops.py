"""The model's index ops without scatters (workbench.model.index_ops): the same bits as the
torch ops they replace, and a training step of every family that dispatches no scatter or
`index_put_` (which PyTorch's deterministic mode runs as a slow sort-and-serial-add on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from workbench.arch import preset
from workbench.model import MoEForCausalLM
from workbench.model.index_ops import counts, inverse, mark, pick, sorted_counts

# the ops run on the CPU here and on CUDA where a GPU is (the kernels that matter)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_counts_are_bincount_with_absent_values_and_out_of_range_ids_left_out(device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 37, (5000,), generator=g).to(device)
    ids[ids == 11] = 3  # an absent bin in the middle
    assert torch.equal(counts(ids.view(50, 100), 40), torch.bincount(ids, minlength=40))
    assert counts(ids, 40)[11] == 0 and counts(ids, 40)[37:].eq(0).all()
    assert torch.equal(counts(torch.tensor([-1, 0, 2, 5, 5], device=device), 3),
                       torch.tensor([1, 0, 1], device=device))
    none = torch.empty(0, dtype=torch.long, device=device)
    assert torch.equal(counts(none, 4), torch.zeros(4, dtype=torch.long, device=device))
    s = torch.sort(ids).values
    assert torch.equal(sorted_counts(s, 37), torch.bincount(ids, minlength=37))


@pytest.mark.parametrize("device", DEVICES)
def test_inverse_undoes_the_permutation(device):
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(1)).to(device)
    inv = inverse(perm)
    ar = torch.arange(1000, device=device)
    assert torch.equal(inv[perm], ar) and torch.equal(perm[inv], ar)


@pytest.mark.parametrize("device", DEVICES)
def test_pick_is_gather_forward_and_backward_bitwise(device):
    g = torch.Generator().manual_seed(2)
    T, E, K = 300, 16, 4
    x = torch.randn(T, E, generator=g).to(device)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = pick(x1, idx), x2.gather(1, idx)
    assert torch.equal(ours, ref)
    gout = (torch.randn(T, K, generator=g) * torch.logspace(-30, 30, T * K).view(T, K)).to(device)
    ours.backward(gout)
    ref.backward(gout)
    # bits, up to the sign of a zero gradient: gather's scatter-add gives 0 + -0 = +0, topk's
    # scatter (and pick) keep -0; torch.equal counts them equal, and no later sum can tell
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_pick_equals_topk_values_and_their_gradient(device):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g).to(device)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    idx = torch.topk(x1.detach(), 5, dim=-1).indices
    ref = torch.topk(x2, 5, dim=-1).values
    ours = pick(x1, idx)
    assert torch.equal(ours, ref)
    gout = torch.randn(64, 5, generator=g).to(device)
    ours.backward(gout)
    ref.backward(gout)
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_mark_is_the_scatter_of_ones(device):
    idx = torch.tensor([[0, 3], [2, 1], [3, 0]], device=device)
    ref = torch.zeros(3, 5, device=device).scatter_(1, idx, 1).bool()
    assert torch.equal(mark(idx, 5), ref)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# the ops deterministic mode sends through the sorted index_put kernel on CUDA
_SLOW = {"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
         "scatter_reduce_", "index_put", "index_put_", "_index_put_impl_", "index_add",
         "index_add_", "index_copy", "index_copy_"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["tiny", "tiny_gpt_oss", "tiny_deepseek"])
def test_a_training_step_dispatches_no_scatter_or_index_put(name, device):
    cfg = preset(name)
    model = MoEForCausalLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    mode = _Ops()
    # on CUDA as the trainer runs it: bf16 autocast, the GPU kernels of the expert path
    amp = torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda")
    with mode, amp:
        out = model(ids, ids, return_logits=False)
        (out.loss + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    assert "embedding" in mode.seen and "gather" in mode.seen  # the mode saw the step
    assert not mode.seen & _SLOW, sorted(mode.seen & _SLOW)
