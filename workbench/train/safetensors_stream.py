"""A safetensors file written one tensor at a time, its header computed up front from shapes.

The on-disk layout is the one `safetensors.torch.save_file` (safetensors 0.8, the reference this
is tested against byte for byte) writes: an 8-byte little-endian header length, a compact JSON
header (`__metadata__` first, then every tensor in data order with `dtype`, `shape` and
`data_offsets`), padded with spaces to a multiple of 8, then the tensors' bytes back to back.
The data order is safetensors' own: by dtype, in descending order of its `Dtype` enum (roughly
widest first), then by name. Everything in it depends on names, dtypes and shapes only, so a
writer can place every tensor before any tensor exists: the FSDP export
(`workbench.train.export`) gathers one parameter or MoE layer at a time and writes it at its
offset, so no rank ever holds the whole model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import torch

# safetensors' Dtype enum order (safetensors/src/tensor.rs; F4/F6 have no torch dtype here):
# its writer sorts tensors by this, descending, then by name.
_ENUM_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
               "I32", "U32", "F32", "F64", "I64", "U64")
DTYPE_NAME = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3", torch.int16: "I16", torch.uint16: "U16",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.uint32: "U32",
    torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.uint64: "U64",
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPE_NAME[torch.float8_e8m0fnu] = "F8_E8M0"


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def layout(entries: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
           metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """(the file's first bytes: length + padded header, {name: (start, end) in the data}) for
    tensors `entries` = {name: (dtype, shape)}, as `save_file` would write them."""
    for name, (dtype, _) in entries.items():
        if dtype not in DTYPE_NAME:
            raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
    order = sorted(entries, key=lambda n: (-_ENUM_ORDER.index(DTYPE_NAME[entries[n][0]]), n))
    head: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    offsets, pos = {}, 0
    for name in order:
        dtype, shape = entries[name]
        end = pos + nbytes(dtype, shape)
        offsets[name] = (pos, end)
        head[name] = {"dtype": DTYPE_NAME[dtype], "shape": list(shape), "data_offsets": [pos, end]}
        pos = end
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()  # serde_json
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


class StreamedFile:
    """Write `entries` into `path` tensor by tensor, in any order; `close()` checks that every
    tensor was written exactly once and fsyncs. Each `write` checks dtype and shape."""

    def __init__(self, path: str | Path, entries: Mapping[str, tuple[torch.dtype, tuple]],
                 metadata: Mapping[str, str] | None = None) -> None:
        self.path, self.entries = Path(path), dict(entries)
        head, self.offsets = layout(self.entries, metadata)
        self.base = len(head)
        self.pending = set(self.entries)
        self.f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self.f.write(head)
        self.f.truncate(self.base + max((e for _, e in self.offsets.values()), default=0))

    def write(self, name: str, t: torch.Tensor) -> None:
        if name not in self.pending:
            raise KeyError(f"{self.path.name}: {name} is not in the header or was written twice")
        dtype, shape = self.entries[name]
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.path.name}: {name} is {t.dtype} {tuple(t.shape)}, the header "
                             f"says {dtype} {tuple(shape)}")
        start, end = self.offsets[name]
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        assert raw.nbytes == end - start
        self.f.seek(self.base + start)
        self.f.write(memoryview(raw))
        self.pending.discard(name)

    def close(self) -> None:
        if self.pending:
            self.f.close()
            raise RuntimeError(f"{self.path.name}: {len(self.pending)} tensors never written, "
                               f"e.g. {sorted(self.pending)[:3]}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
