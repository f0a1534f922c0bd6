"""`ShardIndex.read_into`: a selection read straight into a caller's buffer.

Files are written by safetensors itself; every result is compared bit for bit (uint8 views, so
NaN payloads and -0 count) with `read`, which goes through safetensors' own get_slice.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from writers import save_sharded

from workbench.checkpoint import index as index_mod
from workbench.checkpoint.errors import CheckpointError, CorruptShardError, UnsafePathError
from workbench.checkpoint.index import ShardIndex, selection

DTYPES = [torch.uint8, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e8m0fnu]


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # every byte pattern (NaNs and -0 included): the copy must not touch the values
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                        dtype=torch.uint8)
    return raw.view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# (index, contiguous?) on a stacked [E=3, N=6, K=8] tensor
SELECTIONS = [
    ((), True),
    ((1,), True),
    ((-1,), True),
    ((2, slice(1, 5)), True),  # one expert's rows: compressed-tensors / stacked with int lead
    ((0, slice(None)), True),
    ((1, slice(3, 3)), True),  # empty
    ((1, slice(4, 5), slice(None)), True),
    ((slice(1, 3),), True),
    ((1, 2), True),
    ((1, slice(0, 6, 2)), False),  # gpt-oss interleaved gate/up rows
    ((1, slice(1, 6, 2)), False),
    ((slice(None), 2), False),
    ((1, slice(1, 4), slice(0, 4)), False),
    ((slice(0, 3, 2),), False),
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards written by safetensors: stacked [E, N, K] and per-expert [N, K] tensors."""
    tensors = {}
    for i, dt in enumerate(DTYPES):
        tensors[f"stack.{i}"] = _random((3, 6, 8), dt, i)
        tensors[f"expert.{i}"] = _random((6, 8), dt, 10 + i)
    tensors["scalar"] = torch.tensor(2.5)
    folder = save_sharded(tmp_path_factory.mktemp("ri") / "ck", tensors, shards=2)
    return folder, tensors


def _count_preadv(monkeypatch) -> list:
    calls = []
    real = index_mod._pread_full
    monkeypatch.setattr(index_mod, "_pread_full", lambda *a: calls.append(a) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sel,contiguous", SELECTIONS, ids=[repr(s) for s, _ in SELECTIONS])
def test_read_into_equals_read(shards, dtype, sel, contiguous, monkeypatch):
    folder, tensors = shards
    name = f"stack.{DTYPES.index(dtype)}"
    idx = ShardIndex(folder)
    want = idx.read(name, sel)
    assert _same(want, tensors[name][sel])  # the reference itself, against torch indexing
    calls = _count_preadv(monkeypatch)
    # filled with a byte pattern first: a read that leaves bytes alone cannot pass
    out = torch.full((*want.shape, dtype.itemsize), 0x5A, dtype=torch.uint8).view(dtype) \
        .reshape(want.shape)
    assert idx.read_into(name, sel, out) is out
    assert _same(out, want), (name, sel)
    # contiguous selections go straight to the file, the others through read()
    assert (len(calls) == 1) == (contiguous and want.numel() > 0), (sel, len(calls))
    assert selection(tensors[name].shape, sel)[1] is not None or not contiguous


def test_read_into_a_slice_of_a_stack_buffer(shards):
    """The loader's use: each member into its slice of one [E, ...] buffer, per-expert tensors
    and stacked ones alike."""
    folder, tensors = shards
    idx = ShardIndex(folder)
    for i, dt in enumerate(DTYPES):
        buf = torch.zeros((4, 4, 8, dt.itemsize), dtype=torch.uint8).view(dt).reshape(4, 4, 8)
        idx.read_into(f"expert.{i}", (slice(1, 5),), buf[0])
        for e in range(3):
            idx.read_into(f"stack.{i}", (e, slice(2, 6)), buf[e + 1])
        assert _same(buf[0], tensors[f"expert.{i}"][1:5])
        for e in range(3):
            assert _same(buf[e + 1], tensors[f"stack.{i}"][e, 2:6])


def test_read_into_refuses_a_buffer_of_another_shape_or_dtype(shards):
    folder, _ = shards
    idx = ShardIndex(folder)
    with pytest.raises(ValueError, match="shape"):
        idx.read_into("stack.0", (1,), torch.empty(6, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="bfloat16"):
        idx.read_into("stack.1", (1,), torch.empty(6, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="strided"):
        idx.read_into("stack.0", (1,), torch.empty(8, 6, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="out of range"):
        idx.read_into("stack.0", (3,), torch.empty(6, 8, dtype=torch.uint8))
    assert idx.stats.requests == 0


def test_stats_count_each_read_into_once(shards):
    folder, _ = shards
    idx = ShardIndex(folder)
    idx.read_into("stack.1", (1, slice(0, 4)), torch.empty(4, 8, dtype=torch.bfloat16))
    idx.read_into("stack.1", (1, slice(0, 6, 2)), torch.empty(3, 8, dtype=torch.bfloat16))
    idx.read_into("scalar", (), torch.empty((), dtype=torch.float32))
    assert idx.stats.requests == 3
    assert idx.stats.per_tensor == {"stack.1": (4 + 3) * 8 * 2, "scalar": 4}
    assert idx.stats.bytes_read == (4 + 3) * 8 * 2 + 4


def _truncated_copy(tmp_path: Path, tensors) -> tuple[Path, Path]:
    folder = tmp_path / "ck"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, folder / "model.safetensors"


@pytest.mark.parametrize("open_first", [False, True], ids=["fresh", "descriptor-open"])
def test_shard_truncated_after_indexing_is_a_clear_error(tmp_path, open_first):
    """A shard cut short after the index was built (a copy still running, a full disk): the
    read names the file and the tensor; it must not hang or return the buffer's old bytes."""
    tensors = {"a": _random((4, 64), torch.uint8, 1), "b": _random((4, 64), torch.bfloat16, 2)}
    folder, shard = _truncated_copy(tmp_path, tensors)
    idx = ShardIndex(folder)
    last = max(idx.entries.values(), key=lambda e: e.end)
    if open_first:  # the descriptor is cached before the cut
        first = min(idx.entries.values(), key=lambda e: e.end)
        idx.read_into(first.name, (0,), torch.empty(64, dtype=first.dtype))
    os.truncate(shard, last.end - 10)
    out = torch.empty(2, 64, dtype=last.dtype)
    with pytest.raises(CorruptShardError, match="truncated after the index was built") as ei:
        idx.read_into(last.name, (slice(2, 4),), out)
    assert ei.value.path == str(shard) and ei.value.tensor == last.name
    # rows wholly before the cut still read
    got = idx.read_into(last.name, (0,), torch.empty(64, dtype=last.dtype))
    assert _same(got, tensors[last.name][0])


def test_shard_replaced_by_a_fifo_after_indexing_is_refused(tmp_path):
    """The descriptor is opened through open_regular (non-blocking, fstat): a FIFO put in the
    shard's place after indexing is refused, not read (a plain open would block forever)."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    folder, shard = _truncated_copy(tmp_path, {"a": _random((4, 64), torch.uint8, 1)})
    idx = ShardIndex(folder)
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(UnsafePathError, match="FIFO") as ei:
        idx.read_into("a", (0,), torch.empty(64, dtype=torch.uint8))
    assert ei.value.tensor == "a" and str(shard) in str(ei.value)


def test_shard_removed_after_indexing(tmp_path):
    folder, shard = _truncated_copy(tmp_path, {"a": _random((4, 64), torch.uint8, 1)})
    idx = ShardIndex(folder)
    shard.unlink()
    with pytest.raises(CheckpointError) as ei:
        idx.read_into("a", (0,), torch.empty(64, dtype=torch.uint8))
    assert ei.value.tensor == "a" and str(shard.name) in str(ei.value)


def test_many_threads_read_the_same_bytes_and_count_them(tmp_path):
    """16 threads, read_into (preadv and fallback) and read mixed, over 6 shards with room for
    2 open descriptors and handles, so descriptors are evicted while other threads read them:
    every result equals the tensor, and the stats add up exactly."""
    tensors = {f"t{i}": _random((4, 16, 64), [torch.uint8, torch.bfloat16][i % 2], 100 + i)
               for i in range(12)}
    folder = save_sharded(tmp_path / "ck", tensors, shards=6)
    idx = ShardIndex(folder, max_open=2)
    rng = random.Random(0)
    jobs = []
    for _ in range(16):
        mine = []
        for _ in range(150):
            name = f"t{rng.randrange(12)}"
            e = rng.randrange(4)
            a = rng.randrange(16)
            b = rng.randrange(a, 17)
            sel = rng.choice([(e, slice(a, b)), (e,), (e, slice(a, 16, 2)), (slice(0, 2),)])
            mine.append((name, sel, rng.random() < 0.25))
        jobs.append(mine)
    bad, want_bytes, want_per = [], 0, {}
    for mine in jobs:
        for name, sel, _ in mine:
            n = tensors[name][sel].numel() * tensors[name].element_size()
            want_bytes += n
            want_per[name] = want_per.get(name, 0) + n
    start = threading.Barrier(len(jobs))

    def work(mine):
        start.wait()
        for name, sel, plain in mine:
            ref = tensors[name][sel]
            got = idx.read(name, sel) if plain else \
                idx.read_into(name, sel, torch.empty(ref.shape, dtype=ref.dtype))
            if not _same(got, ref):
                bad.append((name, sel))

    threads = [threading.Thread(target=work, args=(m,)) for m in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    assert idx.stats.requests == sum(len(m) for m in jobs)
    assert idx.stats.bytes_read == want_bytes
    assert idx.stats.per_tensor == want_per
    assert len(idx._fds) <= 2 and all(fd.users == 0 for fd in idx._fds.values())
    idx.close()
    assert not idx._fds


# -- read_span: one run of a shard, front to back ------------------------------------------------


def test_read_span_is_the_file_bytes_and_counts_asked_and_gaps(shards, monkeypatch):
    """The span holds the file's bytes (each tensor's equal to `read`); requests are cut at
    SPAN_CHUNK; the tensors named are counted as read_into counts them, the rest as gaps."""
    folder, _ = shards
    idx = ShardIndex(folder)
    monkeypatch.setattr(index_mod, "SPAN_CHUNK", 100)  # several requests, one cut mid-tensor
    calls = _count_preadv(monkeypatch)
    for f in idx.files:
        es = sorted((e for e in idx.entries.values() if e.file == f), key=lambda e: e.begin)
        lo, hi = es[0].begin, es[-1].end
        out = torch.empty(hi - lo, dtype=torch.uint8)
        idx.stats.reset()
        calls.clear()
        asked = [(e.name, e.nbytes) for e in es[::2]]
        idx.read_span(f, lo, out, asked)
        assert len(calls) == -(-(hi - lo) // 100)
        assert idx.stats.per_tensor == dict(asked)
        assert idx.stats.bytes_read + idx.stats.gap_bytes == hi - lo
        assert idx.stats.gap_bytes == sum(e.nbytes for e in es[1::2]) + \
            sum(b.begin - a.end for a, b in itertools.pairwise(es))
        assert bytes(out.numpy()) == f.read_bytes()[lo:hi]
        for e in es:
            got = out[e.begin - lo:e.end - lo].view(e.dtype).view(e.shape)
            assert _same(got, idx.read(e.name))


def test_read_span_refuses_spans_outside_the_data_and_foreign_files(shards, tmp_path):
    folder, _ = shards
    idx = ShardIndex(folder)
    f = idx.files[0]
    end = max(e.end for e in idx.entries.values() if e.file == f)
    with pytest.raises(ValueError, match="outside the tensor data"):
        idx.read_span(f, end - 4, torch.empty(8, dtype=torch.uint8), [])
    with pytest.raises(ValueError, match="outside the tensor data"):
        idx.read_span(f, -1, torch.empty(1, dtype=torch.uint8), [])
    other = tmp_path / "other.safetensors"
    other.write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="not a shard"):
        idx.read_span(other, 0, torch.empty(8, dtype=torch.uint8), [])
    with pytest.raises(ValueError, match="uint8"):
        idx.read_span(f, end - 8, torch.empty(4, dtype=torch.bfloat16), [])


def test_read_span_of_a_shard_truncated_after_indexing_names_it(tmp_path):
    tensors = {"a": _random((4, 64), torch.uint8, 1), "b": _random((4, 64), torch.bfloat16, 2)}
    folder, shard = _truncated_copy(tmp_path, tensors)
    idx = ShardIndex(folder)
    es = sorted(idx.entries.values(), key=lambda e: e.begin)
    os.truncate(shard, es[-1].end - 10)
    out = torch.empty(es[-1].end - es[0].begin, dtype=torch.uint8)
    with pytest.raises(CorruptShardError, match="truncated after the index was built") as ei:
        idx.read_span(shard, es[0].begin, out, [(es[0].name, es[0].nbytes)])
    assert ei.value.path == str(shard)
