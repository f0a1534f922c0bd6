"""Logical BF16 views: a packed weight looks like one `[out, in]` (or `[E, out, in]`) tensor.

Legend: R rows (out features), C columns (in features), E experts, B block width along C.

`view[rows, cols]` reads through `ShardIndex.read` only the stored bytes of the scale blocks that
cover the requested columns (and only the requested rows / experts), decodes them with the
reference codecs of `workbench.formats`, and crops to the exact columns, so the result is
bit-identical to decoding the whole tensor and slicing. Rows and leading (expert) indices take
ints or slices with any positive step; columns take ints or slices with step 1.
"""

from __future__ import annotations

import torch

from .errors import CheckpointError
from .index import ShardIndex
from .layouts import LogicalSpec
from .registry import CODECS, row_slice


def _norm(k, n: int, what: str, allow_step: bool) -> tuple[range, bool]:
    """Key -> (range of indices, keeps the dim)."""
    if isinstance(k, bool) or not isinstance(k, (int, slice)):
        if hasattr(k, "__index__"):
            k = int(k)
        else:
            raise TypeError(f"{what} index must be an int or slice, got {type(k).__name__}")
    if isinstance(k, int):
        if not -n <= k < n:
            raise IndexError(f"{what} index {k} out of range for size {n}")
        k = k % n
        return range(k, k + 1), False
    r = range(n)[k]
    if r.step <= 0 or (not allow_step and r.step != 1):
        raise IndexError(f"{what} slices need step 1{' or more' if allow_step else ''}, got {k}")
    return r, True


class LogicalTensor:
    """Base: shape, dtype, indexing, materialize(), raw()."""

    dtype = torch.bfloat16

    def __init__(self, name: str, shape: tuple[int, ...]):
        self.name, self.shape = name, tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def _keys(self, key) -> list:
        key = key if isinstance(key, tuple) else (key,)
        if len(key) > self.ndim:
            raise IndexError(f"{len(key)} indices for a {self.ndim}-D view of {self.name!r}")
        return list(key) + [slice(None)] * (self.ndim - len(key))

    def __getitem__(self, key) -> torch.Tensor:
        raise NotImplementedError

    def _result_shape(self, ks: list) -> tuple[int, ...]:
        """Shape of `self[ks]` without reading anything."""
        out = []
        for k, n in zip(ks, self.shape):
            r, keep = _norm(k, n, "index", True)
            if keep:
                out.append(len(r))
        return tuple(out)

    def materialize(self) -> torch.Tensor:
        return self[(slice(None),) * self.ndim]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, shape={list(self.shape)})"


class StoredView(LogicalTensor):
    """A view of one stored logical weight (2-D, or 3-D with a leading expert dim).

    `lead` fixes the stored leading index (one expert of a fused 3-D tensor); `rows` maps the
    view's rows onto stored rows as `offset + stride * i` (gpt-oss gate = even rows, TE fc1
    up = the second half).
    """

    def __init__(self, index: ShardIndex, spec: LogicalSpec, *, lead: int | None = None,
                 rows: tuple[int, int, int] | None = None, name: str | None = None,
                 keep_dtype: bool = False):
        self.index, self.spec, self.lead = index, spec, lead
        R = spec.shape[-2] if len(spec.shape) >= 2 else None
        self.row_map = rows if rows is not None else ((0, 1, R) if R is not None else None)
        lead_dims = spec.shape[:-2] if lead is None else spec.shape[1:-2]
        shape = (*lead_dims, self.row_map[2], spec.shape[-1]) if R is not None else spec.shape
        super().__init__(name or spec.name, shape)
        self.keep_dtype = keep_dtype and spec.codec is None
        if self.keep_dtype:
            self.dtype = spec.stored_dtype

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.spec.stored_dtype

    def __getitem__(self, key) -> torch.Tensor:
        if self.ndim == 0:
            if key not in ((), Ellipsis):
                raise IndexError(f"{self.name!r} is a scalar: index it with [()]")
            out = self.index.read(self.spec.part("data"))
            return out if self.keep_dtype else out.to(torch.bfloat16)
        ks = self._keys(key)
        if self.ndim == 1:
            r, keep = _norm(ks[0], self.shape[0], "column", True)
            out = self.index.read(self.spec.part("data"), (row_slice(r),)) if len(r) else \
                torch.empty(0, dtype=self.spec.stored_dtype)
            out = out if self.keep_dtype else out.to(torch.bfloat16)
            return out if keep else out[0]
        lead_keys = ks[:-2]
        leads, keeps = [], []
        for k, n in zip(lead_keys, self.shape[:-2]):
            r, keep = _norm(k, n, "expert", True)
            leads.append(r)
            keeps.append(keep)
        rr, keep_r = _norm(ks[-2], self.shape[-2], "row", True)
        cr, keep_c = _norm(ks[-1], self.shape[-1], "column", False)
        off, stride, _ = self.row_map
        srows = range(off + stride * rr.start, off + stride * (rr.start + rr.step * len(rr)),
                      stride * rr.step) if len(rr) else range(0)
        lead_sel = ([] if self.lead is None else [slice(self.lead, self.lead + 1)]) + [
            row_slice(r) for r in leads]
        if any(len(r) == 0 for r in leads) or len(srows) == 0 or len(cr) == 0:
            return torch.empty(self._result_shape(ks), dtype=self.dtype)
        else:
            out = decode_region(self.index, self.spec, tuple(lead_sel), srows, cr.start,
                                cr.stop)
            if self.lead is not None:
                out = out[0]
            if self.keep_dtype is False and out.dtype != torch.bfloat16:
                out = out.to(torch.bfloat16)
        idx = tuple([slice(None) if k else 0 for k in keeps] + [slice(None) if keep_r else 0,
                                                                  slice(None) if keep_c else 0])
        return out[idx]

    def raw(self, experts=None) -> dict[str, torch.Tensor]:
        """Stored parts (packed bytes, scales, global scale...) of this weight, undecoded.

        For views with a leading expert dim, `experts` (int or slice) selects experts. Row maps
        (gate/up halves of fused tensors) are not applied: raw is the stored tensor.
        """
        out = {}
        for role, name in self.spec.parts:
            ent = self.index.entry(name)
            sel: tuple = ()
            if len(ent.shape) == len(self.spec.shape) + (1 if self.spec.blocks4d and role == "data"
                                                        else 0) and len(ent.shape) >= 3:
                sel = ((self.lead,) if self.lead is not None else
                       (experts,) if experts is not None else ())
            out[role] = self.index.read(name, sel)
        return out


class StackView(LogicalTensor):
    """`[E, out, in]` made of per-expert 2-D views; the leading index picks which are read."""

    def __init__(self, name: str, members: list[LogicalTensor]):
        shapes = {m.shape for m in members}
        if len(shapes) != 1:
            raise CheckpointError(f"experts of {name!r} differ in shape: {sorted(shapes)}",
                                  tensor=name)
        self.members = members
        super().__init__(name, (len(members), *members[0].shape))

    def __getitem__(self, key) -> torch.Tensor:
        ks = self._keys(key)
        r, keep = _norm(ks[0], self.shape[0], "expert", True)
        if not len(r):
            _norm(ks[-1], self.shape[-1], "column", False)  # same index checks as a read
            return torch.empty(self._result_shape(ks), dtype=self.dtype)
        parts = [self.members[i][tuple(ks[1:])] for i in r]
        return torch.stack(parts) if keep else parts[0]

    def raw(self, experts=None) -> dict[str, torch.Tensor]:
        r = range(self.shape[0])[experts] if isinstance(experts, slice) else (
            [experts] if experts is not None else range(self.shape[0]))
        raws = [self.members[i].raw() for i in r]
        return {k: torch.stack([d[k] for d in raws]) for k in raws[0]}


def decode_region(index: ShardIndex, spec: LogicalSpec, lead: tuple, rows: range, c0: int,
                  c1: int) -> torch.Tensor:
    """Decode stored rows `rows`, logical columns [c0, c1) -> [*lead_kept, len(rows), c1-c0]."""
    if spec.codec is None:
        rs, data = row_slice(rows), spec.part("data")
        if spec.transposed:  # stored [..., in, out]: read the column range, rows strided
            return index.read(data, (*lead, slice(c0, c1), rs)).transpose(-1, -2)
        return index.read(data, (*lead, rs, slice(c0, c1)))
    codec = CODECS.get(spec.codec)
    if codec is None:
        raise CheckpointError(f"no decoder for codec {spec.codec!r}", tensor=spec.name)
    return codec.decode(index, spec, lead, rows, c0, c1)
