"""``stored_vs_recipes`` for an NVFP4 stored grid under an NVFP4 recipe, as compiled CPU passes
over the stored bytes: the closed form of ``fused.py`` (MXFP4) for NVFP4.

The reference (``tables.py`` + ``metrics.py``) decodes the grid to BF16 with the stored
profile's arithmetic, re-quantizes it with the recipe's (``nvfp4.quantize_nvfp4_parts``: a
global scale from the tensor amax, an E4M3 scale per 16 elements, E2M1 rounding), decodes that
to fp32 and takes the metrics. NVFP4's scales are no powers of two, so nothing here is exact in
the way MXFP4's products are; instead every per-element number is computed by the same fp32
operations on the same operands as the reference, and everything per block or per tensor comes
from tables the reference's own functions fill:

- a decoded element is ``bf16(decode(m, s, g))``: m the E2M1 magnitude, s the block's stored
  E4M3 scale, g the stored global in the library's form (``library_global``). It depends only on
  (m, scale byte): ``decode_table`` runs the reference ``dequantize_nvfp4`` on all 8 x 256 pairs.
  Rounding is monotone and every factor positive, so a block's amax is the table entry of (its
  largest code, its byte), and the tensor amax the largest entry over the pairs present;
- the recipe's global is its ``global_from_amax`` of that amax, its block scale its
  ``block_scale`` of (pair's amax, global): both per weight, over the 8 x 256 pairs
  (statistics in BF16 where the profile computes them in the input dtype; the entries are BF16
  values, so that cast is exact);
- per element the pass calls the profiles' own ``decode`` (stored), ``scaled`` and ``decode``
  (recipe) on magnitudes with per-block scales and per-chunk globals, the same elementwise fp32
  operations as the reference's calls on whole tensors; Inductor keeps IEEE fp32 (no fast-math,
  no FMA contraction) and rounds ``.to(bfloat16)`` as eager does (``emulate_precision_casts``);
- E2M1 rounding is ``fused_common.round_e2m1`` (ties to even, as every NVFP4 profile; exact for any
  fp32 >= 0: tested on every BF16 value and around every boundary in fp32);
- magnitudes suffice: all scales are positive, so a non-zero re-quantized code keeps the stored
  sign, |deq - w| and w * deq are sign-free, a code mismatch (+0 equals -0) is a magnitude
  mismatch. A clipped element is the reference's predicate itself (largest code while
  |w| > |deq|), counted only where the reference's early exit (some block's amax within 1e-5 of
  its limit, ``metrics.clip_fraction``) lets it count: evaluated per (code, byte) pair;
- scale mismatches (bytes differ, or every block when the globals differ, as
  ``metrics.grid_mismatch``) and the exponent histogram (``metrics.scale_exponents`` of the
  recipe's scales, per pair) are counts over the pairs' block counts.
So counts, ``max_abs_err`` and ``amax`` equal the reference's; the four float sums differ in
summation order only (fp32 per 4096 elements, then float64), as in ``fused.py``.

Two passes: the first finds each block's largest code (the tensor amax, hence the recipe's
global, needs all of them before the second can run), the second does the element work.
What falls back (reason logged once): padded last dimensions, negative or NaN scale bytes,
non-finite or non-positive globals (checked before reading), and after the first pass weights
whose decoded values leave 2^-50 .. 2^50 (squares near fp32 subnormals make the float sums
order-sensitive, as in ``fused.py``) or whose recipe global is not finite and positive (an
all-zero weight).
"""

from __future__ import annotations

import torch

from workbench.formats import QuantizedTensor, Recipe, format_spec
from workbench.formats.elements import pack_fp4
from workbench.formats.nvfp4 import dequantize_nvfp4, from_library_global, to_library_global
from workbench.formats.nvfp4_profiles import get_profile

from .fused_common import FusedResult, mag_e2m1, pack_blocks, round_e2m1, run_graph, say
from .metrics import block_scales, count_ratio, metrics_from_sums, scale_exponents
from .session import Session, Unavailable

CHUNK = 256  # blocks per partial: 4096 elements per nibble half (longer reductions take
# Inductor's cascade summation, several times slower; 4096 fp32 ones count exactly)
PAIRS = 8 * 256  # (largest magnitude code, scale byte)
RANGE = (2.0**-50, 2.0**50)  # decoded magnitudes of the weights served


def static_reason(recipe: Recipe) -> str | None:
    """Every NVFP4 profile's arithmetic is called as is (tested for each): no exclusions."""
    get_profile(recipe.profile)
    return None


def _lib_global(q: QuantizedTensor) -> torch.Tensor:
    # what dequantize_nvfp4 decodes with: the library's own form when the grid carries it
    g = q.library_global if q.library_global is not None else \
        to_library_global(q.global_scale, q.profile)
    return torch.as_tensor(g, dtype=torch.float32).reshape(())


def grid_reason(stored: QuantizedTensor) -> str | None:
    """Why one stored NVFP4 grid needs another path (None: these passes, unless the weight's
    decoded range, known after the first pass, says otherwise)."""
    if stored.shape[-1] != stored.padded_k:
        return "padded last dimension"
    if stored.data.device.type != "cpu":
        return f"{stored.data.device.type} tensors"
    if stored.global_scale is None or stored.global_scale.numel() != 1:
        return "no single global scale"
    g = _lib_global(stored)
    if not bool(torch.isfinite(g)) or float(g) <= 0:
        return "global scale not finite and positive"
    sb = stored.scale.view(torch.uint8)
    if bool(((sb & 0x80) != 0).any()) or bool(((sb & 0x7F) == 0x7F).any()):
        return "negative or NaN E4M3 scale bytes"
    return None


def decode_table(stored: QuantizedTensor) -> torch.Tensor:
    """[8 * 256] fp32, index ``code * 256 + byte``: the reference's BF16 decode of magnitude
    code 0..7 under scale byte 0..255 and the grid's global (``dequantize_nvfp4`` itself, on one
    block per byte holding every code)."""
    codes = (torch.arange(16, dtype=torch.uint8) & 7).repeat(256, 1)
    scale = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(256, 1)
    w = dequantize_nvfp4(pack_fp4(codes), scale, stored.global_scale.float().reshape(()),
                         stored.profile, torch.bfloat16, library_global=_lib_global(stored))
    return w[:, :8].float().T.reshape(-1).contiguous()


def _cmax_graph():
    def cmax(data):
        # data [chunks, 8, CHUNK] packed codes, blocks in the lanes -> each block's largest
        # magnitude code (through fp32: a uint8 max reduction compiles to a scalar loop)
        return torch.maximum(data & 7, (data >> 4) & 7).to(torch.float32).amax(1)

    return cmax


def _element_graph(stored_profile: str, recipe_profile: str):
    sp, rp = get_profile(stored_profile), get_profile(recipe_profile)

    def analyse(data, s, s_new, g, g_new):
        # data [chunks, 8, CHUNK]: byte j of each block down the columns, the blocks of a chunk
        # in the vector lanes (a block's 8 bytes in the lanes fill half a vector, and the
        # per-block factors would be re-broadcast per element). s, s_new [chunks, 1, CHUNK]
        # fp32 stored and recipe block scales; g, g_new [chunks, 1, 1] library-form globals.
        # The profiles' functions take elements in a last dim of their own: [..., None].
        out = []
        for c in (data & 7, (data >> 4) & 7):  # low, high nibble (sign bits are not needed)
            m = mag_e2m1(c.to(torch.float32))
            w = sp.decode(m[..., None], s, g)[..., 0].to(torch.bfloat16).to(torch.float32)
            q = round_e2m1(rp.scaled(w[..., None], s_new, g_new)[..., 0], "even")
            deq = rp.decode(q[..., None], s_new, g_new)[..., 0]
            err = deq - w
            d = (1, 2)  # one partial per chunk and quantity: Inductor fuses them into one loop
            out += [(w * w).sum(d), (err * err).sum(d), (w * deq).sum(d), (deq * deq).sum(d),
                    err.abs().amax(d), (q == 0).float().sum(d),
                    ((q == 6) & (w > deq)).float().sum(d), (q != m).float().sum(d)]
        return out

    return analyse


def _recipe_tables(W: torch.Tensor, present: torch.Tensor, recipe: Recipe):
    """The recipe's global (library form) and, per pair, its scale (E4M3), for a weight whose
    decode table is ``W`` and whose blocks cover the pairs ``present``: the reference's
    ``global_from_amax`` and ``block_scale``, fed as ``quantize_nvfp4_parts`` feeds them."""
    prof = get_profile(recipe.profile)
    amax = W[present].amax()
    bamax = W
    if prof.stats_in_input_dtype:  # the decoded weights are BF16: exact casts
        amax, bamax = amax.to(torch.bfloat16), W.to(torch.bfloat16)
    g = prof.global_from_amax(amax).float()
    return g, prof.block_scale(bamax, g)


def stored_vs_recipe(session: Session, grids: list[QuantizedTensor], recipe: Recipe
                     ) -> list | None:
    """The reference's metrics of each stored NVFP4 grid (``grid_reason`` None, one stored
    profile) re-quantized with ``recipe``, in compiled calls of ``session``; an entry is None
    where a weight is refused after the first pass (reason said); None when compiling fails
    (logged)."""
    if any((g.fmt, g.profile) != ("nvfp4", grids[0].profile) for g in grids):
        raise ValueError("one call, one stored profile of NVFP4 grids")
    sprof = grids[0].profile
    data, sbyte, nblk, chunks = pack_blocks(session, grids, 8, CHUNK, 0x38,  # pad scale 1.0
                                            transpose=True)
    try:
        cmax = run_graph(session, ("nvfp4-cmax",), _cmax_graph, [data], bf16_casts=True)
    except Unavailable:
        return None
    pair = (cmax.long() * 256 + sbyte.long()).reshape(-1)
    nw = len(grids)
    # per weight: blocks per pair, then the tables of its pairs; chunk rows of the inputs
    t_new = torch.ones(nw + 1, PAIRS)  # the row of the spare chunk: any finite scale
    g_old, g_new = torch.ones(nw + 1), torch.ones(nw + 1)
    info: list[tuple | None] = []
    start = 0
    for i, (q, n, c) in enumerate(zip(grids, nblk, chunks)):
        counts = torch.bincount(pair[start:start + n], minlength=PAIRS)
        start += c * CHUNK
        present = counts > 0
        W = decode_table(q)
        live = present.reshape(8, 256)[1:].any(0)  # bytes of blocks with a non-zero code
        smallest = W[256:512][live & (torch.arange(256) != 0)]  # code 0.5, scale not zero
        big = float(W[present].amax())
        if big == 0 or (smallest.numel() and float(smallest.amin()) < RANGE[0]) or \
                big > RANGE[1]:
            say(session, str(recipe), "decoded weights outside 2^-50..2^50 (or all zero)")
            info.append(None)
            continue
        g, s_new = _recipe_tables(W, present, recipe)
        g_dec = from_library_global(g, recipe.profile)
        if not (bool(torch.isfinite(g_dec)) and float(g_dec) > 0 and
                bool(torch.isfinite(s_new.float()[present]).all())):
            say(session, str(recipe), "the recipe's scales are not finite")
            info.append(None)
            continue
        t_new[i] = s_new.float()
        g_old[i], g_new[i] = _lib_global(q), g
        info.append((counts, present, W, g_dec, s_new))
    owner = torch.repeat_interleave(torch.arange(nw + 1),
                                    torch.tensor([*chunks, data.shape[0] - sum(chunks)]))
    s_old = sbyte.view(torch.float8_e4m3fn).float().unsqueeze(1)
    s_rec = t_new.reshape(-1)[owner[:, None] * PAIRS + pair.view(-1, CHUNK)].unsqueeze(1)
    try:
        part = run_graph(session, ("nvfp4", sprof, recipe.profile),
                         lambda: _element_graph(sprof, recipe.profile),
                         [data, s_old, s_rec, g_old[owner, None, None], g_new[owner, None, None]],
                         bf16_casts=True)
    except Unavailable:
        return None
    part = torch.stack(part).T  # [chunks, 16]: 8 per nibble half
    sums = torch.zeros(nw + 1, 16, dtype=torch.float64).index_add_(0, owner, part.double())
    maxs = torch.zeros(nw + 1, 16).scatter_reduce_(0, owner[:, None].expand(-1, 16), part,
                                                   "amax")  # every maximum here is >= 0
    return [None if x is None else _result(recipe, grids[i], x, sums[i].tolist(),
                                           maxs[i].tolist(), chunks[i] * CHUNK - nblk[i])
            for i, x in enumerate(info)]


def _result(recipe: Recipe, stored: QuantizedTensor, info, sm: list, mx: list, pad: int):
    counts, present, W, g_dec, s_new = info
    n_blk = stored.scale.numel()
    n = 16 * n_blk
    lo, hi = sm[:8], sm[8:]
    # per-pair block quantities as the reference computes them per block, from a grid of the
    # recipe's scales, one block per pair
    table = QuantizedTensor("nvfp4", recipe.profile, torch.zeros(PAIRS, 8, dtype=torch.uint8),
                            s_new.reshape(PAIRS, 1), g_dec, (PAIRS, 16))
    limit = block_scales(table).reshape(-1) * format_spec("nvfp4").elem_max
    near = bool((present & (W >= limit * (1 - 1e-5))).any())  # clip_fraction's early exit
    clip = count_ratio(round(lo[6] + hi[6]), n) if near else 0.0
    same_byte = s_new.view(torch.uint8) == (torch.arange(PAIRS) % 256).to(torch.uint8)
    smis = count_ratio(int(counts[~same_byte].sum()), n_blk)
    if not torch.equal(stored.global_scale.float(), g_dec.float()):
        smis = 1.0  # every block's effective scale changes with the global
    m = metrics_from_sums(lo[0] + hi[0], lo[1] + hi[1], lo[2] + hi[2], lo[3] + hi[3],
                          max(mx[4], mx[12]), float(W[present].amax()), clip_frac=clip,
                          zero_frac=(round(lo[5] + hi[5]) - 16 * pad) / n)
    m["scale_mismatch_frac"] = smis
    m["code_mismatch_frac"] = round(lo[7] + hi[7]) / n
    exps = scale_exponents(table).reshape(-1)
    hist = torch.zeros(4096, dtype=torch.int64).index_add_(0, exps[present].long() + 2048,
                                                           counts[present])
    keys = hist.nonzero().flatten()
    return FusedResult(m, None, list(zip((keys - 2048).tolist(), hist[keys].tolist())))
