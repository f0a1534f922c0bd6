"""The analysis hot loop of ``stored_vs_recipes``, fused into one compiled CPU pass per batch.

For an MXFP4-stored weight and an MXFP4 recipe the reference (``tables.py`` + ``metrics.py``)
decodes the grid to BF16, re-quantizes, dequantizes to fp32 and makes ~20 eager passes for the
metrics: ~30 ns per element on 2 CPU cores. Here the same numbers come from the stored codes in
one ``torch.compile``d function (Inductor's C++/OpenMP backend, AVX-512 where the CPU has it),
run over a batch of weights at once so Python and OpenMP start-up are paid per batch.

Why the numbers equal the reference's. A decoded element is ``m * S``, m in {0, .5, 1 ... 6},
S = 2^(b-127). While every stored byte lies in ``SAFE_BYTES`` (S in 2^-50 .. 2^50; real weights
sit near 2^-9 .. 2^-1) every product and difference below is an exact fp32 number, far from
subnormals and overflow, so per element the fused values are the reference's bit for bit:
- a block's amax is mag(largest code) * S, so its recipe scale byte depends only on (largest
  code, stored byte): ``block_tables`` runs the reference ``scale_byte`` on all 8 x 256 pairs;
- the scaled value x = m * S * 2^(127-byte) needs no BF16 rounding (two significant bits);
- E2M1 rounding of x has a closed form per binade (``round_e2m1``; tested on every BF16 value);
- magnitudes suffice: a non-zero re-quantized element keeps its stored sign, so |deq - w| and
  w * deq are sign-free, "+0 equals -0" makes a code mismatch a magnitude mismatch, and clipping
  (largest code while |w| > |deq| = 6 * 2^(byte-127)) is exactly x > 6.
So counts (zero, clip, mismatch, histogram), ``max_abs_err`` and ``amax`` equal the reference's.
The four float sums differ in summation order only: the reference takes fp32 BLAS dots (fp32
accumulators; on the benchmark's 1.5M-element experts the sum of squares is 5e-5 off the float64
value and rel_err 1e-5), this path sums fp32 per 4096 elements and then in float64 (7e-8).

The same idea for the other formats lives beside this module: ``fused_fp8.py`` (an MXFP8 grid
under an MXFP8 recipe of its element format) and ``fused_nvfp4.py`` (an NVFP4 grid under an NVFP4
recipe); ``static_reason``, ``grid_reason`` and ``stored_vs_recipe`` here dispatch to them, and
their docstrings say why their numbers equal the reference's.

Anything else takes the compiled passes of ``compiled.py`` (or the batched path, ``batched.py``),
with the reason logged once: a grid under a recipe of another format, tie rules without a closed
form here, bytes outside ``SAFE_BYTES``, padded K, CUDA tensors, or a failed compile (no C++
compiler...). Whether this pass is tried at all is
``paths.choose_path``'s decision ("fused", the CPU default for large jobs). Compiling costs
seconds once per process and tie rule (logged); Inductor caches the C++ on disk across runs.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import torch

from workbench.formats import QuantizedTensor, Recipe, format_spec
from workbench.formats.mx_profiles import PROFILES, cached_lut, scale_byte

# fused_fp8 / fused_nvfp4 use this module's helpers (run_graph, pack_blocks, round_e2m1) and
# this module dispatches to them: a cycle, which works at module top because neither side
# touches the other's names until a call
from . import fused_fp8, fused_nvfp4, graphs
from .metrics import count_ratio, e8m0_exponents, metrics_from_sums

_log = logging.getLogger(__name__)
SAFE_BYTES = (77, 177)
CHUNK = 256  # blocks per partial sum: 4096 elements per nibble half, fp32 counts stay exact
BATCH_BLOCKS = 1 << 18  # blocks per compiled call (~8M elements): amortises call overhead
# A process's first fused call pays ~3 s of torch.compile imports and set-up plus the compile:
# ~4 s more with Inductor's disk cache warm, ~20 s into an empty cache (measured on 2 cores by
# jobs/bench_analysis.py); paths.COMPILE_ELEMENTS is where "auto" starts to take it.
TIES = ("even", "away", "down")
_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_COMPILED: dict[str, object] = {}
COMPILE_SECONDS: dict[str, float] = {}  # first call (trace + compile, or disk-cache load) per tie rule
_BROKEN: list[str] = []  # why compiling failed in this process; from then on: batched
_LOGGED: set[str] = set()


def log_choice(recipe: str, why: str | None) -> None:
    """Say once per (recipe, path, reason) whether the compiled pass serves a recipe."""
    text = (f"stored grid vs {recipe}: fused CPU path (torch.compile)" if why is None else
            f"stored grid vs {recipe}: batched path ({why})")
    if text not in _LOGGED:
        _LOGGED.add(text)
        _log.info(text)


def _mag(c: torch.Tensor) -> torch.Tensor:
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
    """E2M1 magnitude nearest to BF16-exact ``x`` >= 0, saturating at 6: the grid steps by 0.5
    below 2, by 1 below 4 and by 2 above, so each binade rounds to an integer multiple of its
    step, ties as ``elements.e2m1_magnitude_code`` sends them."""
    return torch.where(x < 2, _rint(x * 2, ties) * 0.5,
                       torch.where(x < 4, _rint(x, ties),
                                   torch.clamp_max(_rint(x * 0.5, ties) * 2, 6.0)))


@functools.lru_cache(maxsize=32)
def block_tables(stored_profile: str, recipe_profile: str):
    """Per (largest magnitude code, stored byte), index ``code * 256 + byte``: the recipe's scale
    byte, the stored scale S, S times the recipe's encode multiplier, and the recipe's decode
    scale; all from the reference (``scale_byte`` and the profiles' tables)."""
    spec, prof = format_spec("mxfp4"), PROFILES[recipe_profile]
    s = cached_lut("decode", stored_profile, "cpu", torch.float32).repeat(8)
    amax = torch.tensor(_MAGS).repeat_interleave(256) * s
    byte = scale_byte(amax, spec, prof)
    enc = cached_lut("encode", recipe_profile, "cpu", torch.float32)[byte.long()]
    dec = cached_lut("decode", recipe_profile, "cpu", torch.float32)[byte.long()]
    return byte, s, s * enc, dec


def _fused(ties: str):
    def analyse(data, sbyte, t_byte, t_s, t_sm, t_r):
        # data [chunks, CHUNK, 16] packed codes, sbyte [chunks, CHUNK] stored bytes. (Blocks in
        # the vector lanes, i.e. data transposed, runs this ~15% faster but the transposing copy
        # costs more than that.)
        cmax = torch.maximum(data & 7, (data >> 4) & 7).to(torch.float32).amax(-1)
        idx = cmax.long() * 256 + sbyte.long()
        byte, s, sm, r = t_byte[idx], t_s[idx], t_sm[idx], t_r[idx]
        out = [(_mag(cmax) * s).amax(-1), (byte != sbyte).float().sum(-1)]
        s_, sm_, r_ = s.unsqueeze(-1), sm.unsqueeze(-1), r.unsqueeze(-1)
        for c in (data & 7, (data >> 4) & 7):  # low, high nibble (sign bits are not needed)
            m = _mag(c.to(torch.float32))
            w, x = m * s_, m * sm_
            mq = round_e2m1(x, ties)
            deq = mq * r_
            err = deq - w
            dims = (1, 2)  # one partial per chunk and quantity: Inductor fuses all into one loop
            out += [(w * w).sum(dims), (err * err).sum(dims), (w * deq).sum(dims),
                    (deq * deq).sum(dims), err.abs().amax(dims), (mq == 0).float().sum(dims),
                    (x > 6).float().sum(dims), (mq != m).float().sum(dims)]
        # s, sm, r are returned so that Inductor stores them once instead of re-deriving them
        # per element; the partials stay a list (a stack in the graph splits the loop)
        return byte, s, sm, r, out

    return analyse


class _Unavailable(Exception):
    """Compiling failed (no C++ compiler, an Inductor error): the caller takes the batched path."""


def _run(ties: str, *args):
    fn = graphs.compiled(_COMPILED, ties, lambda: _fused(ties))
    graphs.mark_leading_dynamic(args[:2])  # one graph for any number of chunks
    return graphs.first_call_timed(fn, args, ties, COMPILE_SECONDS, _BROKEN,
                                   what="fused analysis", label=f"(ties {ties})",
                                   unavailable=_Unavailable, log=_log)


# Inductor stores a pointwise result to memory (and re-reads it in one loop per reduction) once
# its expression exceeds ~50 ops or a few readers: the closed forms are one loop only when every
# element value stays in registers (10x faster, measured)
_ONE_LOOP = {"realize_opcount_threshold": 1 << 20, "realize_reads_threshold": 1 << 20,
             "realize_acc_reads_threshold": 1 << 20}


def run_graph(key: tuple, build, args: list, *, bf16_casts: bool = False):
    """``build()`` compiled once per ``key`` and called on ``args`` (the first dim of each
    argument dynamic), for the closed forms of the other formats (``fused_fp8``,
    ``fused_nvfp4``); a failed compile raises ``_Unavailable`` and turns every fused pass off
    for the process. ``bf16_casts``: a ``.to(bfloat16)`` in the graph rounds, as in eager
    (Inductor's ``emulate_precision_casts``)."""
    opts = {**_ONE_LOOP, **({"emulate_precision_casts": True} if bf16_casts else {})}
    fn = graphs.compiled(_COMPILED, key, build, **opts)
    graphs.mark_leading_dynamic(args)
    return graphs.first_call_timed(fn, args, key, COMPILE_SECONDS, _BROKEN,
                                   what="fused analysis", label=key,
                                   unavailable=_Unavailable, log=_log)


def pack_blocks(grids: list[QuantizedTensor], width: int, chunk: int, pad_byte: int, *,
                transpose: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The grids' element bytes ``[chunks, chunk, width]`` (``transpose``: ``[chunks, width,
    chunk]``, blocks in the vector lanes) and scale bytes ``[chunks, chunk]`` in one reused
    per-thread buffer, each grid in whole chunks, at least two chunks (dynamo specialises a dim
    of size 1). Padding blocks are all-zero codes under ``pad_byte``. Returns (data, scale
    bytes, blocks per grid, chunks per grid)."""
    nblk = [g.scale.numel() for g in grids]
    chunks = [-(-n // chunk) for n in nblk]
    total = max(sum(chunks), 2)
    key = (width, chunk, transpose)
    bufs = getattr(_LOCAL, "blocks", None)
    if bufs is None:
        bufs = _LOCAL.blocks = {}
    have = bufs.get(key)
    if have is None or have[1].shape[0] < total:
        shape = (total, width, chunk) if transpose else (total, chunk, width)
        bufs[key] = have = (torch.empty(shape, dtype=torch.uint8),
                            torch.empty(total, chunk, dtype=torch.uint8))
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


def static_reason(recipe: Recipe, device: torch.device) -> str | None:
    """Why the fused pass does not serve ``recipe`` on ``device`` (None: it does). Whether the
    fused path is taken at all is ``paths.choose_path``'s decision."""
    if _BROKEN:
        return f"compiling failed earlier ({_BROKEN[0]})"
    if device.type != "cpu":
        return f"{device.type} tensors (the batched path runs there)"
    if recipe.fmt.startswith("mxfp8"):
        return None  # every MXFP8 rule: fused_fp8's closed form (no tie or sign rule matters)
    if recipe.fmt == "nvfp4":
        return fused_nvfp4.static_reason(recipe)
    if recipe.fmt != "mxfp4":
        return f"recipe format {recipe.fmt} (fused path: mxfp4, mxfp8, nvfp4)"
    prof = PROFILES[recipe.profile]
    if prof.ties not in TIES:
        return f"tie rule {prof.ties!r}"
    if prof.truncated_sticky and prof.sign == "not-positive":
        # sticky rounding acts on fp32 work values only, i.e. with ModelOpt's sign rule
        return "sticky-bit rounding of fp32 values"
    return None


def grid_reason(stored: QuantizedTensor, recipe: Recipe | None = None) -> str | None:
    """Why one stored grid needs the reference (None: fused) under ``recipe`` (None: a recipe
    of the grid's own format). The closed forms re-quantize a grid in its own format only."""
    if recipe is not None and recipe.fmt != stored.fmt:
        return f"{stored.fmt} grid under a {recipe.fmt} recipe"
    if stored.fmt.startswith("mxfp8"):
        return fused_fp8.grid_reason(stored)
    if stored.fmt == "nvfp4":
        return fused_nvfp4.grid_reason(stored)
    if stored.fmt != "mxfp4":
        return f"stored format {stored.fmt}"
    if stored.shape[-1] != stored.padded_k:
        return "padded last dimension"
    if stored.data.device.type != "cpu":
        return f"{stored.data.device.type} tensors"
    sb = stored.scale.view(torch.uint8)
    lo, hi = torch.aminmax(sb)
    if int(lo) < SAFE_BYTES[0] and int(hi) <= SAFE_BYTES[1]:
        # a block whose codes are all (+-)0 decodes to zeros under any finite scale and every
        # product above is an exact 0: only blocks with a non-zero code need a safe byte
        # (all-zero blocks are common: libraries write byte 0 or 127 for them)
        live = (stored.data.reshape(-1, 16) & 0x77).amax(-1) != 0
        lo = sb.reshape(-1)[live].amin() if bool(live.any()) else hi
    if int(lo) < SAFE_BYTES[0] or int(hi) > SAFE_BYTES[1]:
        # no numbers of this weight in the text: it is logged once, not once per weight
        return f"scale bytes outside {SAFE_BYTES[0]}..{SAFE_BYTES[1]}, i.e. 2^-50..2^50"
    return None


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


_LOCAL = threading.local()


def _buffers(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch buffers (codes [chunks, CHUNK, 16], stored bytes [chunks, CHUNK]), grown as needed
    and kept per thread: fresh ones would cost a page fault per 4 KiB on every call."""
    have = getattr(_LOCAL, "bufs", None)
    if have is None or have[1].shape[0] < chunks:
        _LOCAL.bufs = have = (torch.empty(chunks, CHUNK, 16, dtype=torch.uint8),
                              torch.empty(chunks, CHUNK, dtype=torch.uint8))
    return have[0][:chunks], have[1][:chunks]


def _ratios(counts: list[float], n: list[int]) -> list[float]:
    # the reference's metrics.count_ratio: exact integer counts (fp32 sums of at most 4096 ones
    # per chunk, added in float64) over n
    return [count_ratio(round(c), m) for c, m in zip(counts, n)]


def stored_vs_recipe(grids: list[QuantizedTensor], recipe: Recipe
                     ) -> list[FusedResult | None] | None:
    """The reference's metrics for each stored grid (``grid_reason`` None, one stored profile)
    re-quantized with ``recipe``, in one compiled call; None when compiling fails (logged). An
    entry is None where the closed form refused that grid after reading it (NVFP4: a global
    scale out of its range; the reason logged): the caller takes another path for it."""
    if recipe.fmt.startswith("mxfp8"):
        return fused_fp8.stored_vs_recipe(grids, recipe)
    if recipe.fmt == "nvfp4":
        return fused_nvfp4.stored_vs_recipe(grids, recipe)
    if any(g.profile != grids[0].profile for g in grids):
        raise ValueError("one call, one stored profile: the decode table is per profile")
    prof, nw = PROFILES[recipe.profile], len(grids)
    nblk = [g.scale.numel() for g in grids]
    chunks = [-(-n // CHUNK) for n in nblk]
    total = max(sum(chunks), 2)  # dynamo specialises a dim of size 1: never pass one chunk
    # all grids in one buffer, whole chunks each; padding blocks are all-zero codes under a
    # safe byte: they add nothing but zero codes and scale mismatches, subtracted below
    data, sbyte = _buffers(total)
    flat, flat_s = data.view(-1, 16), sbyte.view(-1)
    c0 = 0
    for g, n, c in zip(grids, nblk, chunks):
        a = c0 * CHUNK
        flat[a:a + n] = g.data.reshape(n, 16)
        flat_s[a:a + n] = g.scale.view(torch.uint8).reshape(n)
        flat[a + n:a + c * CHUNK] = 0
        flat_s[a + n:a + c * CHUNK] = 127
        c0 += c
    data[c0:] = 0
    sbyte[c0:] = 127
    try:
        byte, _, _, _, part = _run(prof.ties, data, sbyte,
                                   *block_tables(grids[0].profile, prof.name))
    except _Unavailable:
        return None
    part = torch.stack(part).T  # [chunks, 18]: amax, scale mismatches, then 8 per nibble half
    spare = total - c0  # the chunk added to reach two, owned by no weight
    chunk_owner = torch.repeat_interleave(torch.arange(nw + 1), torch.tensor([*chunks, spare]))
    sums = torch.zeros(nw + 1, 18, dtype=torch.float64).index_add_(0, chunk_owner, part.double())
    maxs = torch.zeros(nw + 1, 18).scatter_reduce_(0, chunk_owner[:, None].expand(-1, 18), part,
                                                   "amax")  # every maximum here is >= 0
    starts = [0, *torch.tensor(chunks).cumsum(0).mul(CHUNK).tolist()]
    byte = byte.view(-1)
    pad = [c * CHUNK - n for n, c in zip(nblk, chunks)]
    elems = [n * 32 for n in nblk]
    sums, maxs = sums.tolist(), maxs.tolist()
    lo_hi = [(s_[2:10], s_[10:18]) for s_ in sums]
    clip = _ratios([lo[6] + hi[6] for lo, hi in lo_hi[:nw]], elems)
    smis = _ratios([sums[i][1] - pad[i] for i in range(nw)], nblk)
    out = []
    for i, (lo, hi) in enumerate(lo_hi[:nw]):
        m = metrics_from_sums(lo[0] + hi[0], lo[1] + hi[1], lo[2] + hi[2], lo[3] + hi[3],
                              max(maxs[i][6], maxs[i][14]), maxs[i][0], clip_frac=clip[i],
                              zero_frac=int(lo[5] + hi[5] - 32 * pad[i]) / elems[i])
        m["scale_mismatch_frac"] = smis[i]
        m["code_mismatch_frac"] = int(lo[7] + hi[7]) / elems[i]
        counts = torch.bincount(byte[starts[i]:starts[i] + nblk[i]], minlength=256)
        out.append(FusedResult(m, counts))
    return out
