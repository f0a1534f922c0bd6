"""The expert combine and the token gather run without atomics (docs/determinism.md) and give the
same bits as the ops they replaced, on the CPU where those ops are sequential: `index_add_` into
zeros for the combine, the index backward (an accumulating `index_put_`) for the gather."""

from __future__ import annotations

import pytest
import torch

from workbench.arch import preset
from workbench.model import MoEForCausalLM
from workbench.model.dispatch import _combine, _gather_tokens, _slots, _sort_assignments
from workbench.model.index_ops import inverse, permute


def _routing(T: int, E: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights_TK = torch.rand(T, K, generator=g)
    return experts_TK, weights_TK, g


def test_combine_equals_index_add_bitwise_forward_and_backward():
    T, E, K, D = 97, 8, 4, 33
    experts_TK, weights_TK, g = _routing(T, E, K, 0)
    order_A, token_A, _ = _sort_assignments(experts_TK, E)
    pos_A = inverse(order_A)
    slots_TK = _slots(pos_A, K)
    x_TD = torch.randn(T, D, generator=g)
    # wide dynamic range, so a different summation order changes low bits somewhere
    y_AD = (torch.randn(T * K, D, generator=g) * torch.logspace(-3, 3, T * K)[:, None])
    y1 = y_AD.clone().requires_grad_()
    y2 = y_AD.clone().requires_grad_()
    w1 = weights_TK.clone().requires_grad_()
    w2 = weights_TK.clone().requires_grad_()

    ours = _combine(x_TD, y1, w1, order_A, pos_A, token_A, slots_TK)
    ref = torch.zeros_like(x_TD).index_add(0, token_A, y2 * w2.reshape(-1)[order_A, None])
    assert torch.equal(ours, ref)
    gout = torch.randn(T, D, generator=g)
    ours.backward(gout)
    ref.backward(gout)
    assert torch.equal(y1.grad, y2.grad) and torch.equal(w1.grad, w2.grad)


def test_gather_backward_equals_index_backward_bitwise():
    T, E, K, D = 64, 16, 6, 20
    experts_TK, _, g = _routing(T, E, K, 1)
    order_A, token_A, _ = _sort_assignments(experts_TK, E)
    slots_TK = _slots(inverse(order_A), K)
    x1 = torch.randn(T, D, generator=g).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    ours, ref = _gather_tokens(x1, token_A, slots_TK), x2[token_A]
    assert torch.equal(ours, ref)
    gout = torch.randn(T * K, D, generator=g) * torch.logspace(-4, 4, T * K)[:, None]
    ours.backward(gout)
    ref.backward(gout)
    assert torch.equal(x1.grad, x2.grad)


def test_slots_are_each_tokens_assignments_in_expert_order():
    T, E, K = 50, 12, 3
    experts_TK, _, _ = _routing(T, E, K, 2)
    order_A, token_A, _ = _sort_assignments(experts_TK, E)
    slots_TK = _slots(inverse(order_A), K)
    assert torch.equal(token_A[slots_TK], torch.arange(T)[:, None].expand(T, K))
    sorted_experts = experts_TK.reshape(-1)[order_A]
    assert torch.equal(sorted_experts[slots_TK], experts_TK.sort(dim=1).values)


def test_permute_backward_is_the_index_backward_bitwise():
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(200, generator=g)
    x1 = torch.randn(200, 7, generator=g).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    ours, ref = permute(x1, perm, inverse(perm)), x2[perm]
    assert torch.equal(ours, ref)
    gout = torch.randn(200, 7, generator=g)
    ours.backward(gout)
    ref.backward(gout)
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("name", ["tiny", "tiny_gpt_oss", "tiny_deepseek"])
def test_no_accumulating_index_backward_in_the_model(name):
    """Deterministic mode runs an index backward (an accumulating index_put_) as a slow
    sort-based kernel; the model's permutations and gathers have their own backward
    (docs/determinism.md), so none may be left in the graph of a training loss."""
    cfg = preset(name)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = MoEForCausalLM(cfg)(ids, ids, return_logits=False).loss
    names, stack, seen = set(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack += [nxt for nxt, _ in fn.next_functions]
    assert "_PermuteBackward" in names and "_PickBackward" in names  # combine and router reached
    assert not {n for n in names if n.startswith(("IndexBackward", "IndexPutBackward"))}
