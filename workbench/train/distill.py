"""Quantization-aware distillation: the frozen BF16 model (the --init weights) as teacher.

Objective (per predicted token, averaged over the global batch):

    ce_weight * CE(student, labels) + kd_weight * T^2 * KL(teacher_T || student_T)
    + aux_loss_coef * aux_loss

with p_T = softmax(logits / T). The T^2 factor keeps the KD gradient's scale independent of T
(Hinton et al. 2015). Defaults: T = 1, kd_weight = 1, ce_weight = 0: the teacher is the BF16
model the quantized student should recover, so its full distribution is the target and the
labels add nothing the teacher does not already carry (CE is still logged as `loss`).

Logged: `kl` = KL(teacher || student) at T = 1 per token (whatever T trains), so runs with
different temperatures compare; validation adds `val_kl`, `val_top1_agree` (fraction of
positions where student and teacher argmax agree) and `teacher_val_loss` (the teacher's CE on
the same batches: the floor `val_loss` recovers towards).

The teacher is a second workbench model, built exactly like the student (same config, same
layout: each rank holds and reads only its own experts, its MoE layers use the same all-to-all,
and under --fsdp it is sharded by `workbench.train.fsdp.apply_fsdp` like the student, so a rank
holds a 1/world share of its dense weights and a 1/dp share of its EP slice's experts), loaded
from --init before sharding, never QAT-prepared, `requires_grad_(False)`, eval mode. On GPU it
is stored in BF16 (it is frozen: no master copy is needed); on CPU in fp32 like the student, so
with recipe bf16 student and teacher compute the same logits bit for bit. Under FSDP every
teacher forward is followed by a reshard: with no backward to follow, FSDP would otherwise keep
the root unit (embeddings, lm_head) gathered between steps. The loop logs the bytes of the
teacher's weights a rank holds as `mem_teacher_bytes` (first step, max over ranks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workbench.train.data import global_batch, rank_slice
from workbench.train.distributed import DistInfo, Layout, all_reduce_sum
from workbench.train.fsdp import apply_fsdp, reshard_
from workbench.train.init_source import init_checkpoint
from workbench.train.build import build_model
from workbench.train.init import load_init


def kl_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """mean over tokens of KL(softmax(t/T) || softmax(s/T)), in fp32; logits [..., V]."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, -2)
    # kl_div(input=log q, target=log p, log_target) = sum p (log p - log q); batchmean = per row.
    return F.kl_div(s, t, reduction="batchmean", log_target=True)


def build_teacher(cfg, info: DistInfo, layout: Layout | None = None) -> nn.Module:
    """The frozen BF16 teacher, sharded like the student (`layout`: the student's; None: EP =
    world, no FSDP); collective (reads --init, and shards under FSDP)."""

    teacher = build_model(cfg, info, overwritten=True, layout=layout)
    # into the plain EP-local tensors, before FSDP; a remote --init is downloaded first
    load_init(init_checkpoint(cfg.init, teacher, progress=info.is_main), teacher, info)
    teacher.requires_grad_(False)
    if info.device.type == "cuda":
        # Parameters only: the RoPE inverse frequencies (a buffer) stay fp32, as the student's.
        for p in teacher.parameters():
            p.data = p.data.to(torch.bfloat16)
    if layout is not None and layout.fsdp:
        apply_fsdp(teacher, layout, info.device)
    teacher.layout = layout
    return teacher.eval()


def teacher_forward(teacher: nn.Module, tok_BS: torch.Tensor, **kw):
    """The teacher's output; under FSDP its units are resharded after it (see the module doc)."""
    out = teacher(tok_BS, **kw)
    layout = getattr(teacher, "layout", None)
    if layout is not None and layout.fsdp:
        reshard_(teacher)
    return out


def objective(res: Any, teacher: nn.Module, tok_BS: torch.Tensor, cfg, aux_coef: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to backpropagate, kl at T=1 detached) for the student's output `res`."""
    with torch.no_grad():
        t_logits = teacher_forward(teacher, tok_BS).logits[:, :-1]
    s_logits = res.logits[:, :-1]  # the positions CE scores: token t predicts t+1
    T = cfg.kd_temperature
    kd = kl_per_token(s_logits, t_logits, T)
    loss = cfg.kd_weight * T * T * kd
    if cfg.ce_weight:
        loss = loss + cfg.ce_weight * res.ce_loss
    if res.aux_loss is not None:
        loss = loss + aux_coef * res.aux_loss
    with torch.no_grad():
        kl1 = kd.detach() if T == 1 else kl_per_token(s_logits, t_logits, 1.0)
    return loss, kl1


@torch.no_grad()
def validate(model: nn.Module, teacher: nn.Module, val, cfg, info: DistInfo, autocast
             ) -> dict[str, float]:
    """val_loss, val_kl, val_top1_agree, teacher_val_loss over cfg.val_batches, rank means.
    `autocast`: a callable returning the loop's autocast context."""
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)
    for i in range(cfg.val_batches):
        tok_BS = rank_slice(global_batch(val, seed=cfg.seed, index=i, batch=cfg.batch,
                                         seq=cfg.seq, split="val"), info.rank, info.world)
        tok_BS = tok_BS.to(info.device)
        with autocast():
            out = model(tok_BS, labels_BS=tok_BS)
            t_out = teacher_forward(teacher, tok_BS, labels_BS=tok_BS)
        s, t = out.logits[:, :-1], t_out.logits[:, :-1]
        agree = (s.argmax(-1) == t.argmax(-1)).double().mean()
        sums += torch.tensor([float(out.ce_loss), float(kl_per_token(s, t)), float(agree),
                              float(t_out.ce_loss)], dtype=torch.float64)
    model.train()
    means = all_reduce_sum((sums / cfg.val_batches).to(info.device), info) / info.world
    return dict(zip(("val_loss", "val_kl", "val_top1_agree", "teacher_val_loss"),
                    means.tolist()))
