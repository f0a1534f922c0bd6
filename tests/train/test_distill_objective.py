"""The distillation objective at temperatures and weights other than 1, against a hand formula.

`workbench.train.distill` documents, per predicted token (positions 0..S-2; the last position
predicts nothing) and averaged over the tokens:

    ce_weight * CE + kd_weight * T^2 * KL(softmax(t/T) || softmax(s/T)) + aux_coef * aux

The expected values here are computed in float64 from the fixed logits with
sum p (log p - log q), and the gradient with its closed form T (q_T - p_T) / N (d KL / d s =
(q_T - p_T) / T per token), not with the trainer's own helpers.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from workbench.train.config import TrainConfig
from workbench.train.distill import objective

B, S, V = 2, 5, 7


class _FixedTeacher(nn.Module):
    """A teacher whose logits are fixed; checks it is given the student's tokens."""

    def __init__(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.tokens = logits, tokens

    def forward(self, tok_BS, **kw):
        assert tok_BS is self.tokens
        return SimpleNamespace(logits=self.logits)


def _logits():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(B, S, V, generator=g) * 2
    t = torch.randn(B, S, V, generator=g) * 2
    s[:, -1] += 40 * torch.arange(V)  # the last position is far off: it must not count
    return s, t


def _kl(s: torch.Tensor, t: torch.Tensor, T: float) -> torch.Tensor:
    """Per-token mean of KL(teacher_T || student_T) over positions 0..S-2, float64."""
    p = torch.softmax(t[:, :-1].double() / T, -1)
    q = torch.softmax(s[:, :-1].double() / T, -1)
    return (p * (p.log() - q.log())).sum(-1).mean()


def _cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(out=str(tmp_path), init="ckpt", distill=True, **kw)


def _run(tmp_path, T, *, kd_weight=1.0, ce_weight=0.0, aux_coef=0.0, aux=None):
    s, t = _logits()
    s.requires_grad_(True)
    tok = torch.zeros(B, S, dtype=torch.long)
    res = SimpleNamespace(logits=s, ce_loss=torch.tensor(3.0, dtype=torch.float64),
                          aux_loss=aux)
    cfg = _cfg(tmp_path, kd_temperature=T, kd_weight=kd_weight, ce_weight=ce_weight)
    loss, kl1 = objective(res, _FixedTeacher(t, tok), tok, cfg, aux_coef)
    return s, t, loss, kl1


@pytest.mark.parametrize("T", [2.0, 4.0])
def test_kd_loss_is_t_squared_kl_teacher_to_student(tmp_path, T):
    s, t, loss, kl1 = _run(tmp_path, T)
    kl_T = _kl(s.detach(), t, T)
    assert kl_T > 1e-3  # the logits differ: a missing factor cannot hide behind a zero
    torch.testing.assert_close(loss.double(), T * T * kl_T, rtol=1e-5, atol=0)
    # what is logged is the T = 1 divergence, whatever T trains
    torch.testing.assert_close(kl1.double(), _kl(s.detach(), t, 1.0), rtol=1e-5, atol=0)
    assert not kl1.requires_grad
    # the gradient's scale: T^2 * (q_T - p_T) / (T N) = T (q_T - p_T) / N per student logit
    loss.backward()
    p = torch.softmax(t[:, :-1].double() / T, -1)
    q = torch.softmax(s.detach()[:, :-1].double() / T, -1)
    want = T * (q - p) / (B * (S - 1))
    torch.testing.assert_close(s.grad[:, :-1].double(), want, rtol=1e-4, atol=1e-9)
    assert torch.count_nonzero(s.grad[:, -1]) == 0


def test_kl_direction_is_teacher_to_student(tmp_path):
    s, t, loss, _ = _run(tmp_path, 2.0)
    loss = loss.detach()
    p = torch.softmax(s.detach()[:, :-1].double() / 2, -1)  # the other direction
    q = torch.softmax(t[:, :-1].double() / 2, -1)
    reverse = 4 * (p * (p.log() - q.log())).sum(-1).mean()
    assert abs(loss.item() - reverse.item()) > 1e-2 * reverse.item()


def test_weights_of_kd_ce_and_aux(tmp_path):
    aux = torch.tensor(0.5, dtype=torch.float64)
    s, t, loss, _ = _run(tmp_path, 2.0, kd_weight=0.5, ce_weight=0.25, aux_coef=0.01, aux=aux)
    want = 0.5 * 4 * _kl(s.detach(), t, 2.0) + 0.25 * 3.0 + 0.01 * 0.5
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=0)
    # kd_weight 0: CE alone, whatever the temperature
    s, t, loss, _ = _run(tmp_path, 4.0, kd_weight=0.0, ce_weight=1.0)
    torch.testing.assert_close(loss.double(), torch.tensor(3.0, dtype=torch.float64))
