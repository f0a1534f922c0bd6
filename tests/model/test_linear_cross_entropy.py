"""The chunked LM head + cross-entropy (`workbench.model.loss`) against the plain path.

The oracle is torch's own `F.cross_entropy(F.linear(h, w).float(), labels)`; expected values
are never computed by the code under test. Tolerances are fp32 rounding of sums taken in
another order (the module doc says which sums)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workbench.model import MoEForCausalLM, tiny
from workbench.model.loss import chunk_rows, linear_cross_entropy


def _plain(h, w, labels):
    return F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100)


def _grads(fn, h, w, labels, scale=1.0):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = fn(h, w, labels)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(41, 24, generator=g)
    w = torch.randn(67, 24, generator=g) * 0.3
    labels = torch.randint(0, 67, (41,), generator=g)
    labels[[2, 17, 40]] = -100
    return h, w, labels


@pytest.mark.parametrize("rows", [41, 8, 1])
def test_loss_and_gradients_equal_the_plain_path(data, rows):
    ref = _grads(_plain, *data)
    got = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, rows=rows), *data)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_ignored_tokens_count_nowhere(data):
    h, w, labels = data
    kept = labels != -100
    # the mean runs over the counted tokens only, and ignored rows get no gradient
    ref = _plain(h[kept], w, labels[kept])
    loss, gh, _ = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, rows=5), h, w, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert torch.count_nonzero(gh[~kept]) == 0
    assert torch.count_nonzero(gh[kept].abs().sum(1)) == int(kept.sum())


def test_upstream_gradient_scales_the_stored_gradients(data):
    # the loss is usually the graph's last node, but a weighted sum (ce_weight, aux) scales it
    _, gh1, gw1 = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, rows=7), *data)
    _, gh3, gw3 = _grads(lambda h, w, y: linear_cross_entropy(h, w, y, rows=7), *data, scale=3.0)
    torch.testing.assert_close(gh3, 3 * gh1, rtol=1e-6, atol=0)
    torch.testing.assert_close(gw3, 3 * gw1, rtol=1e-6, atol=0)


def test_all_ignored_is_nan_like_cross_entropy(data):
    h, w, labels = data
    none = torch.full_like(labels, -100)
    assert torch.isnan(_plain(h, w, none))
    assert torch.isnan(linear_cross_entropy(h, w, none, rows=4))


def test_bad_shapes_are_named(data):
    h, w, labels = data
    with pytest.raises(ValueError, match="h \\[N, D\\] and w \\[V, D\\]"):
        linear_cross_entropy(h, w[:, :5], labels)
    with pytest.raises(ValueError, match="labels must be"):
        linear_cross_entropy(h, w, labels[:3])
    with pytest.raises(ValueError, match="positive"):
        linear_cross_entropy(h, w, labels, rows=0)


def test_chunk_rows_keeps_a_chunk_near_its_budget():
    assert chunk_rows(151_936, 1 << 30) == (1 << 30) // (4 * 151_936)
    assert chunk_rows(10**12, 1 << 30) == 1


def test_model_without_logits_trains_like_the_model_with_them():
    torch.manual_seed(0)
    cfg = tiny(num_layers=2)
    a, b = MoEForCausalLM(cfg, seed=3), MoEForCausalLM(cfg, seed=3)
    tok = torch.randint(0, cfg.vocab_size, (3, 19))
    ref = a(tok, labels_BS=tok)
    got = b(tok, labels_BS=tok, return_logits=False)
    assert got.logits is None and ref.logits is not None
    torch.testing.assert_close(got.ce_loss, ref.ce_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=0)
    ref.loss.backward()
    got.loss.backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
def test_compiled_chunk_equals_the_plain_function_on_the_gpu():
    # the GPU path runs each chunk's elementwise work compiled; the plain function is its
    # reference (fp32 exp and logsumexp in another fusion: equal within rounding)
    from workbench.model.loss import _chunk, _chunk_compiled

    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(96, 5003, generator=g, device="cuda") * 4).to(torch.bfloat16)
    labels = torch.randint(0, 5003, (96,), generator=g, device="cuda")
    ok = labels % 7 != 0
    scale = 1.0 / ok.sum().float()
    ref_loss, ref_g = _chunk(z, labels, ok, scale, True)
    loss, grad = _chunk_compiled()(z, labels, ok, scale, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_g.float(), rtol=1.6e-2, atol=1e-8)
    assert torch.count_nonzero(grad[~ok]) == 0


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.inductor_cpp),
    pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_accumulate_is_the_eager_add_bit_for_bit(device):
    # the weight's gradient gathers a bf16 partial per chunk into fp32: compiled, the widening
    # runs inside the add; each element is still the exact widening plus one fp32 rounding
    from workbench.model.loss import _accumulate_compiled

    g = torch.Generator(device=device).manual_seed(1)
    acc = torch.randn(5003, 96, generator=g, device=device) * 1e3
    ref = acc.clone()
    for scale in (1e-3, 1.0, 1e4):
        part = (torch.randn(5003, 96, generator=g, device=device) * scale).to(torch.bfloat16)
        _accumulate_compiled()(acc, part)
        ref.add_(part.float())
    assert torch.equal(acc, ref) and acc.dtype == torch.float32
