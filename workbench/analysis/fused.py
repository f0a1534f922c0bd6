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
with the reason said once per session: a grid under a recipe of another format, tie rules
without a closed form here, bytes outside ``SAFE_BYTES``, padded K, CUDA tensors, or a failed
compile (no C++ compiler...). Whether this pass is tried at all is the plan's route (``plans.plan``: path
"fused", the CPU default for large jobs). Compiling costs seconds once per ``Session`` and tie
rule (logged); Inductor caches the C++ on disk across runs.
"""

from __future__ import annotations

import functools
import logging

import torch

from workbench.formats import QuantizedTensor, Recipe, format_spec
from workbench.formats.mx_profiles import PROFILES, cached_lut, scale_byte

from . import fused_fp8, fused_nvfp4
from .fused_common import FusedResult, count_ratios, mag_e2m1, pack_blocks, round_e2m1
from .metrics import metrics_from_sums
from .session import Session, Unavailable

_log = logging.getLogger(__name__)
SAFE_BYTES = (77, 177)
CHUNK = 256  # blocks per partial sum: 4096 elements per nibble half, fp32 counts stay exact
BATCH_BLOCKS = 1 << 18  # blocks per compiled call (~8M elements): amortises call overhead
# A first fused call pays ~3 s of torch.compile imports and set-up plus the compile: ~4 s more
# with Inductor's disk cache warm, ~20 s into an empty cache (jobs/bench_analysis.py measures
# it); plans.COMPILE_ELEMENTS is where "auto" starts to take it.
TIES = ("even", "away", "down")
_MAGS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


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
        out = [(mag_e2m1(cmax) * s).amax(-1), (byte != sbyte).float().sum(-1)]
        s_, sm_, r_ = s.unsqueeze(-1), sm.unsqueeze(-1), r.unsqueeze(-1)
        for c in (data & 7, (data >> 4) & 7):  # low, high nibble (sign bits are not needed)
            m = mag_e2m1(c.to(torch.float32))
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


def _run(session: Session, ties: str, *args):
    # the tables are the same size on every call: only the chunk dims are dynamic
    return session.run("fused", ties, lambda: _fused(ties), args, label=f"(ties {ties})",
                       log=_log, dynamic_args=args[:2])


def static_reason(recipe: Recipe, device: torch.device) -> str | None:
    """Why no closed form serves ``recipe`` on ``device`` (None: one does, for grids of the
    recipe's own format). Whether the fused path is taken at all is the plan's decision
    (``plans.plan``)."""
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


def stored_vs_recipe(session: Session, grids: list[QuantizedTensor], recipe: Recipe
                     ) -> list[FusedResult | None] | None:
    """The reference's metrics for each stored grid (``grid_reason`` None, one stored profile)
    re-quantized with ``recipe``, in one compiled call of ``session``; None when compiling fails
    (logged). An entry is None where the closed form refused that grid after reading it (NVFP4:
    a global scale out of its range; the reason said): the caller takes another path for it."""
    if recipe.fmt.startswith("mxfp8"):
        return fused_fp8.stored_vs_recipe(session, grids, recipe)
    if recipe.fmt == "nvfp4":
        return fused_nvfp4.stored_vs_recipe(session, grids, recipe)
    if any(g.profile != grids[0].profile for g in grids):
        raise ValueError("one call, one stored profile: the decode table is per profile")
    prof, nw = PROFILES[recipe.profile], len(grids)
    # all grids in one buffer, whole chunks each (at least two: dynamo specialises a dim of
    # size 1); padding blocks are all-zero codes under a safe byte: they add nothing but zero
    # codes and scale mismatches, subtracted below
    data, sbyte, nblk, chunks = pack_blocks(session, grids, 16, CHUNK, 127)
    total, c0 = data.shape[0], sum(chunks)
    try:
        byte, _, _, _, part = _run(session, prof.ties, data, sbyte,
                                   *block_tables(grids[0].profile, prof.name))
    except Unavailable:
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
    clip = count_ratios([lo[6] + hi[6] for lo, hi in lo_hi[:nw]], elems)
    smis = count_ratios([sums[i][1] - pad[i] for i in range(nw)], nblk)
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
