"""What the closed-form passes share (``fused.py`` for MXFP4, ``fused_fp8.py``, ``fused_nvfp4.py``):
E2M1 arithmetic without tables, the packing of stored blocks into chunks, the result type, and
how a closed form's graph is compiled and run. The three modules import this one and nothing of
each other's (``fused.py`` dispatches to the other two).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType

import torch

from workbench.formats import QuantizedTensor

from .metrics import count_ratio, e8m0_exponents
from .session import Session

_log = logging.getLogger(__name__)

# Inductor stores a pointwise result to memory (and re-reads it in one loop per reduction) once
# its expression exceeds ~50 ops or a few readers: the closed forms are one loop only when every
# element value stays in registers (10x faster, measured)
ONE_LOOP = MappingProxyType({"realize_opcount_threshold": 1 << 20,
                             "realize_reads_threshold": 1 << 20,
                             "realize_acc_reads_threshold": 1 << 20})


def say(session: Session, recipe: str, why: str | None) -> None:
    """Say once per session whether a closed form serves a stored grid under ``recipe``."""
    session.say(_log, f"stored grid vs {recipe}: fused CPU path (torch.compile)" if why is None
                else f"stored grid vs {recipe}: batched path ({why})")


def mag_e2m1(c: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude of fp32 codes 0..7 (0, .5, 1, 1.5 | 2, 3 | 4, 6) by arithmetic: Inductor
    turns a table lookup into a scalar loop."""
    return torch.where(c < 4, c * 0.5, torch.where(c < 6, c - 2, c * 2 - 8))


def _rint(x: torch.Tensor, ties: str) -> torch.Tensor:
    if ties == "even":
        return torch.round(x)  # half to even
    if ties == "away":
        return torch.floor(x + 0.5)  # x >= 0; exact for BF16-exact x below 2^16
    return torch.ceil(x - 0.5)


def round_e2m1(x: torch.Tensor, ties: str = "even") -> torch.Tensor:
    """E2M1 magnitude nearest to ``x`` >= 0 (BF16-exact for MXFP4, any fp32 for NVFP4),
    saturating at 6: the grid steps by 0.5 below 2, by 1 below 4 and by 2 above, so each binade
    rounds to an integer multiple of its step, ties as ``elements.e2m1_magnitude_code`` sends
    them."""
    return torch.where(x < 2, _rint(x * 2, ties) * 0.5,
                       torch.where(x < 4, _rint(x, ties),
                                   torch.clamp_max(_rint(x * 0.5, ties) * 2, 6.0)))


def count_ratios(counts: list[float], n: list[int]) -> list[float]:
    """The reference's ``metrics.count_ratio`` of each exact integer count (fp32 sums of at most
    4096 ones per chunk, added in float64) over n."""
    return [count_ratio(round(c), m) for c, m in zip(counts, n)]


def run_graph(session: Session, key: tuple, build, args: list, *, bf16_casts: bool = False,
              dynamic_args=None):
    """A closed form's graph ``build()``, compiled once per ``key`` in ``session`` (family
    "fused": a failed compile turns every closed form off for the session) and called on
    ``args``. ``bf16_casts``: a ``.to(bfloat16)`` in the graph rounds, as in eager (Inductor's
    ``emulate_precision_casts``)."""
    opts = {**ONE_LOOP, **({"emulate_precision_casts": True} if bf16_casts else {})}
    return session.run("fused", key, build, args, label=key, log=_log, options=opts,
                       dynamic_args=dynamic_args)


def pack_blocks(session: Session, grids: list[QuantizedTensor], width: int, chunk: int,
                pad_byte: int, *, transpose: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The grids' element bytes ``[chunks, chunk, width]`` (``transpose``: ``[chunks, width,
    chunk]``, blocks in the vector lanes) and scale bytes ``[chunks, chunk]`` in the session's
    reused buffers, each grid in whole chunks, at least two chunks (dynamo specialises a dim of
    size 1). Padding blocks are all-zero codes under ``pad_byte``. Returns (data, scale bytes,
    blocks per grid, chunks per grid)."""
    nblk = [g.scale.numel() for g in grids]
    chunks = [-(-n // chunk) for n in nblk]
    total = max(sum(chunks), 2)

    def make(rows: int) -> tuple:
        shape = (rows, width, chunk) if transpose else (rows, chunk, width)
        return torch.empty(shape, dtype=torch.uint8), torch.empty(rows, chunk, dtype=torch.uint8)

    have = session.scratch(("blocks", width, chunk, transpose), total, make)
    data, sbyte = have[0][:total], have[1][:total]
    flat_s = sbyte.view(-1)
    c0 = 0
    for g, n, c in zip(grids, nblk, chunks):
        src = g.data.view(torch.uint8).reshape(n, width)
        a = c0 * chunk
        flat_s[a:a + n] = g.scale.view(torch.uint8).reshape(n)
        flat_s[a + n:a + c * chunk] = pad_byte
        if transpose:
            full = n // chunk
            dst = data[c0:c0 + c]
            dst[:full].copy_(src[:full * chunk].view(full, chunk, width).transpose(1, 2))
            if full < c:
                dst[full].zero_()
                dst[full, :, :n - full * chunk].copy_(src[full * chunk:].T)
        else:
            flat = data.view(-1, width)
            flat[a:a + n] = src
            flat[a + n:a + c * chunk] = 0
        c0 += c
    data[c0:] = 0
    sbyte[c0:] = pad_byte
    return data, sbyte, nblk, chunks


@dataclass(frozen=True)
class FusedResult:
    metrics: dict[str, float]  # error_metrics + grid_mismatch keys, as the reference
    byte_counts: torch.Tensor | None  # [256] int64: blocks per recipe E8M0 byte (MX formats)
    exponents: list[tuple[int, int]] | None = None  # NVFP4: (scale exponent, blocks) ascending

    def histogram(self) -> list[tuple[int, int]]:
        """(exponent, blocks) ascending, as ``metrics.scale_exponents`` + ``torch.unique``."""
        if self.exponents is not None:
            return self.exponents
        present = self.byte_counts.nonzero().flatten()
        return list(zip(e8m0_exponents(present).tolist(), self.byte_counts[present].tolist()))
