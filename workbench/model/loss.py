"""The LM head and its cross-entropy in row chunks, gradients taken in the forward.

Legend: N scored tokens, D hidden, V vocab, C rows per chunk.

The plain path writes the logits of the whole batch ([N, V] in bf16, then an fp32 copy, its
log-softmax and its gradient: with a 151,936-word vocabulary and 16k tokens, four tensors of
5-10 GB each, and several passes over them). Here the head is run C rows at a time: each chunk's
logits are made, reduced to their per-row loss, turned into the softmax gradient, multiplied back
into the gradients of the hidden states and of the head's weight, and dropped. The loss is the
last node of the graph, so its upstream gradient is a scalar that only scales what is computed
here: the backward multiplies the stored gradients by it (the approach of Liger's fused linear
cross-entropy). No GEMM is recomputed: the forward runs the three GEMMs of the plain forward
and backward, nothing more.

What equals the plain path (`F.cross_entropy(F.linear(h, w).float(), labels)`): each chunk's
logits are the same GEMM on the same rows, widened to fp32 the same way, and each row's loss is
`logsumexp - logit[label]` in fp32. Where the row results of a GEMM do not depend on how many
rows it has, the per-token losses are the plain path's bits; the mean over tokens and the
weight's gradient are sums in another order (chunk by chunk, the weight's gradient accumulated
in fp32 across chunks instead of rounded once), equal within rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# fp32 logits of one chunk, in bytes: large enough that every GEMM is big, small enough that the
# chunk's temporaries (logits, their fp32 copy, the softmax gradient) stay a few GiB.
CHUNK_BYTES = 1 << 30


def _chunk(z: torch.Tensor, labels: torch.Tensor, ok: torch.Tensor, scale: torch.Tensor,
           want: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's per-row losses and, with ``want``, the gradient of the mean loss with respect
    to its logits ``z`` [C, V] (in z's dtype): ``(softmax(z) - onehot(label)) * scale`` on the
    counted rows, 0 elsewhere. Elementwise and row reductions only, so on a GPU it compiles into
    a few passes over the chunk (eager it is six)."""
    zf = z.float()
    safe = torch.where(ok, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(zf, dim=-1)
    picked = zf.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(ok, lse - picked, torch.zeros_like(lse))
    if not want:
        return loss, None
    g = torch.exp(zf - lse[:, None])
    cols = torch.arange(z.shape[1], device=z.device)
    g = torch.where(cols[None, :] == safe[:, None], g - 1.0, g)  # no scatter: no atomics
    g = g * (ok.to(g.dtype) * scale)[:, None]
    return loss, g.to(z.dtype)


@functools.cache
def _chunk_compiled():
    """``_chunk`` compiled for a GPU (the chunk's shape is fixed but for the last one); made on
    first use, because ``torch.compile`` loads Inductor and Triton, which importing the model
    must not. The plain function is its reference (and what CPUs run)."""
    return torch.compile(_chunk, fullgraph=True, dynamic=False)


def _accumulate(acc: torch.Tensor, part: torch.Tensor) -> None:
    """``acc += part`` in acc's dtype: part widened exactly, one rounding per element."""
    acc.add_(part.to(acc.dtype))


@functools.cache
def _accumulate_compiled():
    """``_accumulate`` compiled for a GPU: eager, the widening is a pass of its own that writes
    an fp32 copy of the whole [V, D] partial gradient once per chunk; compiled, the widening
    happens inside the add (the same bits)."""
    return torch.compile(_accumulate, fullgraph=True, dynamic=False)


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    if h.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return h.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, rows, ignore_index, compiled):
        dt = _compute_dtype(h_ND)
        with torch.autocast(h_ND.device.type, enabled=False):
            h, w = h_ND.to(dt), w_VD.to(dt)
            valid_N = labels_N != ignore_index
            count = valid_N.sum()
            # the mean's divisor, as a tensor: no host synchronisation; 0 tokens gives 0/0 = nan,
            # as F.cross_entropy's mean does
            scale = 1.0 / count.to(torch.float32)
            want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
            loss_N = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
            dh = torch.empty_like(h) if want else None
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want else None
            chunk = _chunk_compiled() if h.is_cuda and compiled else _chunk
            accumulate = _accumulate_compiled() if h.is_cuda and compiled else _accumulate
            for a in range(0, h.shape[0], rows):
                b = min(a + rows, h.shape[0])
                loss_N[a:b], g = chunk(F.linear(h[a:b], w), labels_N[a:b], valid_N[a:b], scale,
                                       want)
                if want:
                    dh[a:b] = g @ w
                    accumulate(dw, g.t() @ h[a:b])
            loss = loss_N.sum() * scale
        ctx.save_for_backward(dh, dw)
        ctx.dtypes = (h_ND.dtype, w_VD.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        gh = (dh * grad.to(dh.dtype)).to(h_dtype) if ctx.needs_input_grad[0] else None
        gw = (dw * grad).to(w_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's fp32 logits take about ``budget`` bytes."""
    return max(1, budget // (4 * vocab))


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, *,
                         ignore_index: int = -100, rows: int | None = None,
                         compiled: bool = True) -> torch.Tensor:
    """``F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=...)`` (mean over the
    counted tokens) without the [N, V] logits; see the module doc. Under CUDA autocast the GEMMs
    run in the autocast dtype, as ``F.linear`` would. ``compiled``: on a GPU, each chunk's
    elementwise work runs as the compiled ``_chunk`` (False: the plain function)."""
    if h_ND.dim() != 2 or w_VD.dim() != 2 or h_ND.shape[1] != w_VD.shape[1]:
        raise ValueError(f"linear_cross_entropy expects h [N, D] and w [V, D], got "
                         f"{tuple(h_ND.shape)} and {tuple(w_VD.shape)}")
    if labels_N.shape != h_ND.shape[:1]:
        raise ValueError(f"labels must be [N={h_ND.shape[0]}], got {tuple(labels_N.shape)}")
    n = rows if rows is not None else chunk_rows(w_VD.shape[0])
    if n <= 0:
        raise ValueError(f"rows per chunk must be positive, got {n}")
    return _LinearCrossEntropy.apply(h_ND, w_VD, labels_N, n, ignore_index, compiled)
