"""One launch of NVFP4 fake quantization for an expert stack, each expert with its own amax.

The two-launch schedule (amax pass over the stack, then the quantize pass) reads the tensor
twice from DRAM: 2/3 of the copy rate at best. Here one grid interleaves the amax chunks of
expert e+1 with the quantize tiles of expert e, so a tile is re-read soon after its amax
chunk was read: from L2 when an expert is small enough (NOTES.md has the measurement).

Work items are taken in ticket order, and an item only ever waits for items with smaller
tickets. The ticket is the program id: GPUs dispatch programs in increasing id order, so every
item waited for belongs to a program already running (the forward-progress assumption of
CUB's decoupled look-back scan). ``TICKET`` takes it from an atomic counter instead, which
needs no such assumption; measured far slower (one same-address atomic per 4 KB tile, NOTES.md).

Ticket order, with C amax chunks per expert (a chunk is CHUNK_TILES quantize tiles):
``[A(0, 0..C)] [A(1,0) Q(0, 8 tiles) A(1,1) Q(0, ...) ...] ... [Q(E-1, all tiles)]``, the
quantize tiles of each expert in reverse (the chunk read last is re-read first).

``sync`` (int32, zeroed): ``[0, E)`` the amax bits per expert (an integer max of magnitude bits,
as ``_nvfp4_kernel.amax_kernel``), ``[E, 2E)`` amax chunks finished per expert, ``[2E]`` the
ticket counter (``TICKET`` only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import bits_of, load_f32, store_rounded
from ._nvfp4_kernel import _globals, fake_tile


@triton.jit
def nvfp4_experts_fake_kernel(x_ptr, out_ptr, sync_ptr, n_experts, bpe, n_chunks,
                              NB: tl.constexpr, CHUNK_TILES: tl.constexpr,
                              PROFILE: tl.constexpr, BF16_BITS: tl.constexpr,
                              HW: tl.constexpr, IGNORE_NAN: tl.constexpr,
                              TICKET: tl.constexpr):
    BLOCK: tl.constexpr = 16
    GROUP: tl.constexpr = CHUNK_TILES + 1  # one amax chunk, then CHUNK_TILES quantize tiles
    if TICKET:
        t = tl.atomic_add(sync_ptr + 2 * n_experts, 1)
    else:
        t = tl.program_id(0)
    span = GROUP * n_chunks  # tickets per middle region
    k = t - n_chunks
    region = k // span
    r = k - region * span
    g = r // GROUP
    s = r - g * GROUP
    last = region >= n_experts - 1
    # decode the ticket: (is this an amax chunk, expert, chunk or tile index)
    is_amax = (t < n_chunks) | ((region < n_experts - 1) & (s == 0))
    e = tl.where(t < n_chunks, 0, tl.where(last | (s != 0), region, region + 1))
    e = tl.minimum(e, n_experts - 1)
    pos = tl.where(last, k - (n_experts - 1) * span, g * CHUNK_TILES + s - 1)
    j = tl.where(t < n_chunks, t, tl.where(is_amax, g, CHUNK_TILES * n_chunks - 1 - pos))
    e64 = e.to(tl.int64)
    if is_amax:
        # amax chunk j of expert e; its lines are kept in L2 for the quantize tiles
        CB: tl.constexpr = CHUNK_TILES * NB * BLOCK
        offs = j.to(tl.int64) * CB + tl.arange(0, CB)
        x = load_f32(x_ptr, e64 * bpe * BLOCK + offs, offs < bpe * BLOCK, BF16_BITS,
                     "evict_last")
        m = bits_of(x) & 0x7FFFFFFF
        if IGNORE_NAN:
            m = tl.where(m > 0x7F800000, 0, m)
        tl.atomic_max(sync_ptr + e, tl.max(m, axis=0), sem="relaxed")
        # release: the amax above is visible to whoever sees this count
        tl.atomic_add(sync_ptr + n_experts + e, 1, sem="release")
    elif j * NB < bpe:  # quantize tile j of expert e (tiles past the expert's end: none)
        lb = j * NB + tl.arange(0, NB)
        blk = e64 * bpe + lb
        idx = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = (lb < bpe)[:, None]
        x = load_f32(x_ptr, idx, mask, BF16_BITS, "evict_first")  # issued before the wait
        done = tl.atomic_add(sync_ptr + n_experts + e, 0, sem="acquire")
        while done < n_chunks:
            done = tl.atomic_add(sync_ptr + n_experts + e, 0, sem="acquire")
        amax = tl.atomic_max(sync_ptr + e, 0, sem="acquire").to(tl.float32, bitcast=True)
        ga, gb, gc = _globals(amax, PROFILE)
        m = bits_of(x) & 0x7FFFFFFF
        y = fake_tile(x, m, tl.max(m, axis=1), amax, ga, gb, gc, PROFILE)
        store_rounded(out_ptr + idx, y, mask, BF16_BITS, HW, "evict_first")


def grid_size(n_experts: int, n_chunks: int, chunk_tiles: int) -> int:
    """Tickets: expert 0's chunks, E-1 middle regions, the last expert's tiles."""
    return n_chunks * (1 + (n_experts - 1) * (chunk_tiles + 1) + chunk_tiles)
