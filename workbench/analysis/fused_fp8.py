"""``stored_vs_recipes`` for an MXFP8 stored grid under an MXFP8 recipe of the same element
format (E4M3 or E5M2), as one compiled CPU pass over the stored bytes: the closed form of
``fused.py`` (MXFP4) for FP8 elements.

The reference (``tables.py`` + ``metrics.py``) decodes the grid to BF16, re-quantizes it with the
recipe (``mx.quantize_mx``), decodes that to fp32 and takes the metrics. Here the same numbers
come from the stored element bytes and E8M0 bytes directly.

Why the numbers equal the reference's. A stored element decodes to ``m * S``: m a finite FP8
magnitude (E4M3: 2^-9 .. 448, E5M2: 2^-16 .. 57344, at most 4 resp. 3 significant bits) and
S = 2^(b-127). While every live block's byte lies in ``SAFE_BYTES`` (S in 2^-40 .. 2^40) that
product is an exact fp32 and BF16 number, far from subnormals (its square too) and overflow, so:
- the decoded weight is exactly ``m * S`` (the reference's BF16 decode is that product, exact);
- a block's amax is m(largest magnitude code) * S: its recipe scale byte depends only on (largest
  code, stored byte); ``block_tables`` runs the reference ``scale_byte`` on every such pair, and
  takes the recipe's encode multiplier and decode scale from the profiles' own tables;
- the scaled value is v = m * 2^(b - byte), exact in BF16 and fp32 alike (whether the recipe
  scales in BF16 or, as ModelOpt does, in fp32);
- the recipe clamps v to the element maximum and casts (round to nearest even; the profile's tie
  and sign rules are FP4 rules). v is an element value times a power of two, so it already lies
  on the FP8 grid wherever it is >= the smallest normal and <= the maximum; above the maximum
  the clamp gives the maximum; below the smallest normal the cast rounds to the subnormal step,
  ``round(v / step) * step`` with a power-of-two step, exact (``round_fp8``; tested on every code
  times every binade shift against torch's own cast);
- the recipe's decode is q * 2^(byte-127), the same fp32 product as the reference's, so the
  error ``deq - w`` is the same fp32 operation on the same operands;
- magnitudes suffice: a non-zero q keeps v's sign, which is the stored sign, so |deq - w| and
  w * deq are sign-free; a code mismatch ("+0 equals -0": bytes differ and not both zero) is a
  magnitude mismatch; a clipped element (largest magnitude while |w| > |deq|) is exactly v > max
  (then q = max, and |w| > |deq| is v > q: both sides scaled by the same power of two); the
  reference's early exit (no block near its limit) only ever skips a count of zero.
So counts (zero, clip, code and scale mismatch, byte histogram), ``max_abs_err`` and ``amax``
equal the reference's; the four float sums differ in summation order only (fp32 per 4096
elements, then float64, against the reference's fp32 BLAS dots), as in ``fused.py``.

All-zero blocks decode to exact zeros under any byte but 255 (NaN there), so only blocks with a
non-zero code need a safe byte. Grids with NaN (or E5M2 inf) element codes, bytes outside the
safe range in a live block, or a padded last dimension take the other paths, the reason said
once per session.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType

import torch

from workbench.formats import QuantizedTensor, Recipe, format_spec
from workbench.formats.mx_profiles import PROFILES, cached_lut, scale_byte

from .fused_common import FusedResult, count_ratios, pack_blocks, run_graph, say
from .metrics import metrics_from_sums
from .session import Session, Unavailable

SAFE_BYTES = (87, 167)  # 2^-40 .. 2^40: squares of m * S stay fp32 normals for E5M2's 2^-16 too
CHUNK = 128  # blocks per partial sum: 4096 elements. Longer reductions make Inductor emit its
# cascade summation, ~10x slower here; 4096 fp32 ones also count exactly


@dataclass(frozen=True)
class Elem:
    """What the closed form needs of an FP8 element format (torch's float8 dtypes define it)."""

    dtype: torch.dtype
    mantissa: int  # mantissa bits
    bias: int
    finite_codes: int  # magnitude codes 0 .. finite_codes-1 are finite (above: NaN / inf)

    @property
    def max(self) -> float:
        return float(torch.finfo(self.dtype).max)

    @property
    def min_normal(self) -> float:
        return float(torch.finfo(self.dtype).tiny)

    @property
    def step_exp(self) -> int:
        """-log2 of the subnormal step: 9 for E4M3 (2^-6 / 8), 16 for E5M2 (2^-14 / 4)."""
        return self.bias - 1 + self.mantissa


ELEMS = MappingProxyType({"e4m3": Elem(torch.float8_e4m3fn, 3, 7, 0x7F),
                          "e5m2": Elem(torch.float8_e5m2, 2, 15, 0x7C)})


def mag_fp8(c: torch.Tensor, el: Elem) -> torch.Tensor:
    """fp32 value of FP8 magnitude codes ``c`` (integer tensor, finite codes) by arithmetic:
    normal codes are their fp32 bits re-biased (exponent + mantissa fields shifted into place),
    subnormal ones ``mantissa * step``. Inductor vectorises this; a float8 cast it does not."""
    ci = c.to(torch.int32)
    shift = 23 - el.mantissa
    normal = ((ci << shift) + ((127 - el.bias) << 23)).view(torch.float32)
    return torch.where(ci >= (1 << el.mantissa), normal, ci.to(torch.float32) * 2.0**-el.step_exp)


def round_fp8(v: torch.Tensor, el: Elem) -> torch.Tensor:
    """The recipe's ``clamp(v, max).to(fp8)`` for v >= 0 that is an FP8 value times a power of
    two (see the module docstring): on the grid above the smallest normal, rounded to the
    subnormal step below it (``torch.round``: half to even, as the cast)."""
    step = 2.0**el.step_exp
    return torch.where(v < el.min_normal, torch.round(v * step) * (1 / step),
                       torch.clamp_max(v, el.max))


def _elem(fmt: str) -> Elem:
    return ELEMS[format_spec(fmt).element]


@functools.lru_cache(maxsize=64)
def block_tables(fmt: str, stored_profile: str, recipe_profile: str):
    """Per (largest magnitude code, stored byte), index ``code * 256 + byte``: the recipe's scale
    byte, the stored scale S, S times the recipe's encode multiplier, and the recipe's decode
    scale; all from the reference (``scale_byte`` and the profiles' tables)."""
    spec, el = format_spec(fmt), _elem(fmt)
    codes = torch.arange(el.finite_codes)
    s = cached_lut("decode", stored_profile, "cpu", torch.float32).repeat(el.finite_codes)
    amax = mag_fp8(codes, el).repeat_interleave(256) * s
    byte = scale_byte(amax, spec, PROFILES[recipe_profile])
    enc = cached_lut("encode", recipe_profile, "cpu", torch.float32)[byte.long()]
    dec = cached_lut("decode", recipe_profile, "cpu", torch.float32)[byte.long()]
    return byte, s, s * enc, dec


def graph(fmt: str):
    """The per-batch function: stored bytes -> recipe bytes and per-chunk partials."""
    el = _elem(fmt)

    def analyse(data, sbyte, t_byte, t_s, t_sm, t_r):
        # data [chunks, CHUNK, 32] element bytes, sbyte [chunks, CHUNK] stored E8M0 bytes
        c = data & 0x7F  # magnitude codes (the sign is not needed, see the docstring)
        # the block's largest code through fp32: a uint8 max reduction compiles to a scalar loop
        # (NaN / inf codes are counted below and such grids dropped: clamped only to keep the
        # table index in range)
        cmax = c.to(torch.float32).amax(-1).clamp_max(el.finite_codes - 1)
        idx = cmax.long() * 256 + sbyte.long()
        byte, s, sm, r = t_byte[idx], t_s[idx], t_sm[idx], t_r[idx]
        m = mag_fp8(c, el)
        w, v = m * s.unsqueeze(-1), m * sm.unsqueeze(-1)
        q = round_fp8(v, el)
        deq = q * r.unsqueeze(-1)
        err = deq - w
        d = (1, 2)  # one partial per chunk and quantity: Inductor fuses them into one loop
        out = [w.amax(d), (byte != sbyte).float().sum(-1), (w * w).sum(d), (err * err).sum(d),
               (w * deq).sum(d), (deq * deq).sum(d), err.abs().amax(d),
               (q == 0).float().sum(d), (v > el.max).float().sum(d), (q != m).float().sum(d),
               (c >= el.finite_codes).float().sum(d)]
        # s, sm, r returned: Inductor then stores them once instead of re-deriving them per
        # element; the partials stay a list (a stack in the graph splits the loop)
        return byte, s, sm, r, out

    return analyse


def grid_reason(stored: QuantizedTensor) -> str | None:
    """Why one stored MXFP8 grid needs another path (None: this closed form). NaN and inf
    element codes are counted inside the pass instead (one more partial costs less than a
    pass over the bytes here): ``stored_vs_recipe`` gives None for such grids."""
    if stored.shape[-1] != stored.padded_k:
        return "padded last dimension"
    if stored.data.device.type != "cpu":
        return f"{stored.data.device.type} tensors"
    sb = stored.scale.view(torch.uint8).reshape(-1)
    lo, hi = (int(x) for x in torch.aminmax(sb))
    if lo >= SAFE_BYTES[0] and hi <= SAFE_BYTES[1]:
        return None
    why = f"scale bytes outside {SAFE_BYTES[0]}..{SAFE_BYTES[1]}, i.e. 2^-40..2^40"
    if hi == 255:  # NaN: even an all-zero block decodes to NaN under it
        return why
    # all-zero blocks decode to exact zeros under any other byte (libraries write 0 or 127 for
    # them): only blocks with a non-zero code need a safe byte
    live = (stored.data.view(torch.uint8).reshape(-1, 32) & 0x7F).amax(-1) != 0
    if bool(live.any()):
        lo, hi = (int(x) for x in torch.aminmax(sb[live]))
        if lo < SAFE_BYTES[0] or hi > SAFE_BYTES[1]:
            return why
    return None


def stored_vs_recipe(session: Session, grids: list[QuantizedTensor], recipe: Recipe
                     ) -> list | None:
    """The reference's metrics of each stored MXFP8 grid (``grid_reason`` None, one stored
    profile and format) re-quantized with ``recipe`` (same format), in one compiled call of
    ``session``; None when compiling fails (logged)."""
    if any((g.profile, g.fmt) != (grids[0].profile, recipe.fmt) for g in grids):
        raise ValueError("one call, one stored profile and format (the recipe's)")
    data, sbyte, nblk, chunks = pack_blocks(session, grids, 32, CHUNK, 127)
    tables = block_tables(recipe.fmt, grids[0].profile, recipe.profile)
    try:
        byte, _, _, _, part = run_graph(session, ("mxfp8", recipe.fmt),
                                        lambda: graph(recipe.fmt), [data, sbyte, *tables])
    except Unavailable:
        return None
    return _assemble(session, torch.stack(part).T, byte.reshape(-1), nblk, chunks, str(recipe))


def _assemble(session: Session, part: torch.Tensor, byte: torch.Tensor, nblk: list[int],
              chunks: list[int], recipe: str) -> list:
    """Per grid: partials [chunks, 11] summed (float64) or maxed over its chunks, less what its
    padding blocks added (zero codes; scale mismatches against the pad byte 127)."""
    nw = len(nblk)
    spare = part.shape[0] - sum(chunks)  # the chunk added to reach two, owned by no weight
    owner = torch.repeat_interleave(torch.arange(nw + 1), torch.tensor([*chunks, spare]))
    sums = torch.zeros(nw + 1, part.shape[1], dtype=torch.float64).index_add_(0, owner,
                                                                            part.double())
    maxs = torch.zeros(nw + 1, part.shape[1]).scatter_reduce_(
        0, owner[:, None].expand(-1, part.shape[1]), part, "amax")  # every maximum is >= 0
    starts = [0, *torch.tensor(chunks).cumsum(0).mul(CHUNK).tolist()]
    padded = [c * CHUNK for c in chunks]
    out = []
    for i, (sm, mx) in enumerate(zip(sums.tolist()[:nw], maxs.tolist()[:nw])):
        n, pad = nblk[i] * 32, padded[i] - nblk[i]
        if sm[10]:
            say(session, recipe, "NaN or inf element codes")
            out.append(None)
            continue
        blocks = byte[starts[i]:starts[i] + nblk[i]]
        counts = torch.bincount(blocks, minlength=256)
        # padding blocks: all-zero codes under byte 127; their recipe byte is the all-zero
        # block's byte (the same for every pad block), a mismatch unless that is 127
        pad_mis = pad * int(byte[starts[i] + nblk[i]] != 127) if pad else 0
        m = metrics_from_sums(sm[2], sm[3], sm[4], sm[5], mx[6], mx[0],
                              clip_frac=count_ratios([sm[8]], [n])[0],
                              zero_frac=(round(sm[7]) - 32 * pad) / n)
        m["scale_mismatch_frac"] = count_ratios([sm[1] - pad_mis], [nblk[i]])[0]
        m["code_mismatch_frac"] = round(sm[9]) / n
        out.append(FusedResult(m, counts))
    return out
