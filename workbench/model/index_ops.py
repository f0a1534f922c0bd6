"""Index ops without a scatter, forward or backward.

PyTorch's deterministic mode runs every CUDA scatter, scatter-add and `index_put_` as a sort
followed by a kernel that adds (or writes) each index's duplicates one after another: exact and
repeatable, but serial over duplicates (docs/performance.md says what that cost). The model's
index ops have structure those general kernels cannot use: a permutation has no duplicates, a
top-k row names each expert once, a count is an integer. The ops here use it and give the same
bits, up to the sign of a zero gradient: an integer count is exact in any order, and every
gradient element they write is one value written once.

Legend: T rows (tokens), E columns (experts), K picks per row.
"""

from __future__ import annotations

import torch


def sorted_counts(sorted_ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each of 0..n-1 occurs in the ascending 1-D `sorted_ids` (values
    outside are not counted), by a sorted search for the n + 1 bin edges."""
    edges = torch.searchsorted(sorted_ids, torch.arange(n + 1, device=sorted_ids.device,
                                                        dtype=sorted_ids.dtype))
    return edges[1:] - edges[:-1]


def counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """`torch.bincount(ids.flatten(), minlength=n)` for ids in 0..n-1 (others are not counted),
    with a static shape and no scatter."""
    return sorted_counts(torch.sort(ids.reshape(-1)).values, n)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse permutation, ``inverse(perm)[perm[i]] = i``: an argsort (its keys are distinct,
    so any sort gives it), not the write ``inv[perm] = arange`` (an `index_put_`)."""
    return torch.argsort(perm)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inv):
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        return g[inv], None, None


def permute(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation whose inverse is `inv`; its backward is the gather
    ``g[inv]``, where autograd's index backward would be an accumulating `index_put_`."""
    return _Permute.apply(x, perm, inv)


class _Pick(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TE, idx_TK):
        ctx.save_for_backward(idx_TK)
        ctx.shape, ctx.dtype = x_TE.shape, x_TE.dtype
        return x_TE.gather(1, idx_TK)

    @staticmethod
    def backward(ctx, g_TK):
        (idx_TK,) = ctx.saved_tensors
        cols_E = torch.arange(ctx.shape[1], device=g_TK.device)
        out_TE = torch.zeros(ctx.shape, dtype=g_TK.dtype, device=g_TK.device)
        for k in range(idx_TK.shape[1]):  # one pass per pick; a row's picks are distinct
            out_TE = torch.where(cols_E == idx_TK[:, k:k + 1], g_TK[:, k:k + 1], out_TE)
        return out_TE, None


def pick(x_TE: torch.Tensor, idx_TK: torch.Tensor) -> torch.Tensor:
    """``x_TE.gather(1, idx_TK)`` for rows whose K indices are distinct (top-k picks); the
    backward writes each row's K gradients with K `where` passes, where gather's own backward is
    a scatter-add (and `topk`'s a scatter)."""
    return _Pick.apply(x_TE, idx_TK)


def mark(idx_TK: torch.Tensor, n: int) -> torch.Tensor:
    """bool [T, n]: True where a row's `idx_TK` names the column (``zeros.scatter_(1, idx, 1)``
    without the scatter)."""
    cols = torch.arange(n, device=idx_TK.device)
    return (idx_TK[:, :, None] == cols).any(dim=1)
