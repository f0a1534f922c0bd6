"""The expert combine and the token gather run without atomics (docs/determinism.md) and give the
same bits as the ops they replaced, on the CPU where those ops are sequential: `index_add_` into
zeros for the combine, the index backward (an accumulating `index_put_`) for the gather."""

from __future__ import annotations

import torch

from workbench.model.dispatch import _combine, _gather_tokens, _slots, _sort_assignments


def _routing(T: int, E: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    experts_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights_TK = torch.rand(T, K, generator=g)
    return experts_TK, weights_TK, g


def test_combine_equals_index_add_bitwise_forward_and_backward():
    T, E, K, D = 97, 8, 4, 33
    experts_TK, weights_TK, g = _routing(T, E, K, 0)
    order_A, token_A, _ = _sort_assignments(experts_TK, E)
    slots_TK = _slots(order_A, K)
    x_TD = torch.randn(T, D, generator=g)
    # wide dynamic range, so a different summation order changes low bits somewhere
    y_AD = (torch.randn(T * K, D, generator=g) * torch.logspace(-3, 3, T * K)[:, None])
    y1 = y_AD.clone().requires_grad_()
    y2 = y_AD.clone().requires_grad_()
    w1 = weights_TK.clone().requires_grad_()
    w2 = weights_TK.clone().requires_grad_()

    ours = _combine(x_TD, y1, w1, order_A, token_A, slots_TK)
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
    slots_TK = _slots(order_A, K)
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
    slots_TK = _slots(order_A, K)
    assert torch.equal(token_A[slots_TK], torch.arange(T)[:, None].expand(T, K))
    sorted_experts = experts_TK.reshape(-1)[order_A]
    assert torch.equal(sorted_experts[slots_TK], experts_TK.sort(dim=1).values)
