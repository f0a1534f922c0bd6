"""The plain grouped GEMM the model owns (workbench.model.grouped): per-row oracle, ragged/empty groups, gradients, input checks."""

from __future__ import annotations

import pytest
import torch

from workbench.model.grouped import grouped_mm


def _rowwise_oracle(x_TI, w_EOI, ends):
    """Row t belongs to the first expert whose end offset exceeds t; rows past the end are 0."""
    out = torch.zeros(x_TI.shape[0], w_EOI.shape[1], dtype=torch.float64)
    for t in range(x_TI.shape[0]):
        owner = next((e for e, end in enumerate(ends) if t < end), None)
        if owner is not None:
            out[t] = (w_EOI[owner].double() * x_TI[t].double()).sum(dim=1)
    return out


@pytest.mark.parametrize("ends", [[3, 5, 10, 10], [0, 0, 10, 10], [0, 0, 0, 0], [2, 2, 6, 8]])
def test_matches_rowwise_oracle_and_gradients(ends):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 32, generator=gen, requires_grad=True)
    w = torch.randn(4, 24, 32, generator=gen, requires_grad=True)
    offs = torch.tensor(ends, dtype=torch.int32)
    y = grouped_mm(x, w, offs)
    torch.testing.assert_close(y.double(), _rowwise_oracle(x.detach(), w.detach(), ends),
                               rtol=1e-5, atol=1e-5)
    y.sum().backward()  # an expanded upstream gradient (torch._grouped_mm's CPU backward fails)
    start = 0
    for e, end in enumerate(ends):
        # d(sum y)/dw[e] = sum over its rows of x; zero for empty experts (not None).
        torch.testing.assert_close(w.grad[e], x.detach()[start:end].sum(0).expand(24, 32))
        start = end
    assert torch.all(x.grad[ends[-1]:] == 0)


def test_matches_torch_grouped_mm_forward():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 64, generator=gen)
    w = torch.randn(3, 32, 64, generator=gen)
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    torch.testing.assert_close(grouped_mm(x, w, offs), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("offs, err", [
    (torch.tensor([3, 2, 10], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([3, 5, 11], dtype=torch.int32), "exceeds"),
    (torch.tensor([3, 5, 10], dtype=torch.int64), "int32"),
    (torch.tensor([3, 10], dtype=torch.int32), r"offs must be \[E=3\]"),
])
def test_rejects_bad_offsets(offs, err):
    with pytest.raises((ValueError, TypeError), match=err):
        grouped_mm(torch.zeros(10, 8), torch.zeros(3, 4, 8), offs)



@pytest.mark.parametrize("end, err", [(9, "offs ends at 10"), (11, "outside the 10 rows"),
                                      (-1, "outside the 10 rows")])
def test_a_wrong_end_is_refused(end, err):
    with pytest.raises(ValueError, match=err):
        grouped_mm(torch.zeros(10, 8), torch.zeros(3, 4, 8),
                   torch.tensor([3, 5, 10], dtype=torch.int32), end=end)


def test_dispatchers_pass_the_routed_row_count_as_end():
    """The experts' GEMMs get end = offs[-1] = the rows they see, so on CUDA they never read
    offs on the host (workbench.model.grouped)."""
    from workbench.model import GroupedExperts, MoEForCausalLM, preset
    from workbench.model.experts import ExpertGemms

    model = MoEForCausalLM(preset("tiny"), seed=0)
    seen = []

    class Spy(ExpertGemms):  # a seam of its own, as QAT's replaces the default
        def gate_up(self, x, w1, w3, offs, *, end=None):
            seen.append((end, int(offs[-1]), x.shape[0]))
            return super().gate_up(x, w1, w3, offs, end=end)

        def down(self, g, u, w2, offs, *, act, end=None):
            seen.append((end, int(offs[-1]), g.shape[0]))
            return super().down(g, u, w2, offs, act=act, end=end)

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.gemms = Spy()
    tok = torch.randint(0, model.config.vocab_size, (2, 16))
    model(tok, labels_BS=tok).loss.backward()
    n_layers = sum(isinstance(m, GroupedExperts) for m in model.modules())
    assert n_layers and len(seen) == 2 * n_layers  # the forward's two seam calls per layer
    assert all(e == last == rows for e, last, rows in seen), seen
