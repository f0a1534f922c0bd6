"""The stack readers (``checkpoint.stacks``, ``checkpoint.windows``, ``checkpoint.stream``):
preadv (members read straight into one buffer per part) and the window reader (stacks cut out of
spans read front to back) against the per-member path, ``stack_grids`` of ``stored_grid``, bit
for bit, on checkpoints of every grid layout: the held-in ones written by their own libraries
(tests/checkpoint/oracles.py) and our writers (tests/checkpoint/writers.py), including
E8M0-typed scales and gpt-oss's [.., K/32, 16] blocks with interleaved gate/up rows.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workbench.checkpoint import index as index_mod
from workbench.checkpoint import open_checkpoint
from workbench.checkpoint.grid import stored_grid
from workbench.checkpoint.layouts import FMT_OF_CODEC
from workbench.checkpoint.stacks import (
    ReadPlan,
    Stager,
    grid_codec,
    load_stack,
    plan_batches,
    read_grid_stack,
    signature,
    stack_grids,
)
from workbench.checkpoint.stream import Source, stream_stacks
from workbench.checkpoint.windows import (
    WINDOW_ALIGN,
    load_window,
    plan_windows,
    side_stacks,
    window_parts,
    window_plan,
    window_stack,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "analysis"))
from analysis_ckpts import LIBRARY_LAYOUTS  # the held-in checkpoints of every layout

CPU = torch.device("cpu")
STAGE = Stager(CPU)


def _e8m0(write):
    """The checkpoint of ``write`` with its uint8 E8M0 scales retyped F8_E8M0 (same bytes), as
    newer exporters store them."""
    def go(w, p):
        p = write(w, p)
        for f in Path(p).glob("*.safetensors"):
            t = load_file(f)
            save_file({k: v.view(torch.float8_e8m0fnu) if k.endswith("weight_scale") and
                       v.dtype == torch.uint8 else v for k, v in t.items()}, f)
        return p
    return go


OURS = {  # tests/checkpoint/writers.py: 2 shards each
    "ours-ct-mxfp4": lambda w, p: w.write_ct(p, "mxfp4"),
    "ours-ct-nvfp4": lambda w, p: w.write_ct(p, "nvfp4"),
    "ours-ct-mxfp8": lambda w, p: w.write_ct(p, "mxfp8"),
    "ours-gpt-oss": lambda w, p: w.write_gpt_oss(p),
    "ours-modelopt-nvfp4": lambda w, p: w.write_modelopt(p, "NVFP4"),
    "ours-modelopt-mxfp4-e8m0": _e8m0(lambda w, p: w.write_modelopt(p, "MXFP4")),
    "ours-modelopt-mxfp8-e8m0": _e8m0(lambda w, p: w.write_modelopt(p, "MXFP8")),
}
# each written by its own library (fp8-block has no stored grid to stack)
ORACLES = {k: v for k, v in LIBRARY_LAYOUTS.items() if k != "fp8-block"}


@pytest.fixture(scope="module", params=sorted(OURS) + sorted(ORACLES))
def ck(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param in OURS:
        import writers

        return open_checkpoint(OURS[request.param](writers, root / "ck"))
    module, write = ORACLES[request.param]
    pytest.importorskip(module, reason=f"{module} writes this checkpoint (pip install -e .[dev])")
    import oracles

    return open_checkpoint(write(oracles, root / "ck").path)


def _batches(ck, limit: int) -> list[list]:
    """The grid records in the batches the pipeline forms with ``limit`` elements a stack."""
    recs = [r for r in ck.expert_records() if grid_codec(ck, r)]
    assert recs
    sizes = [r.shape[0] * r.shape[1] for r in recs]
    return [[recs[i] for i in b] for b in
            plan_batches([signature(ck, r) for r in recs], sizes, limit)]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _same_grid(a, b) -> bool:
    return (a.fmt, a.profile, tuple(a.shape)) == (b.fmt, b.profile, tuple(b.shape)) and all(
        _same(getattr(a, f), getattr(b, f))
        for f in ("data", "scale", "global_scale", "library_global"))


@pytest.mark.parametrize("limit", [1 << 30, 3 * 96 * 64, 1], ids=["whole", "threes", "ones"])
def test_stack_equals_stack_grids_of_stored_grid(ck, limit):
    """Same dtypes, shapes and bits as today's per-member path, for the stack and for each
    member's host grid (the compiled CPU pass takes those)."""
    for recs in _batches(ck, limit):
        want = [stored_grid(ck, r) for r in recs]
        got = read_grid_stack(ck, recs, STAGE)
        assert _same_grid(got.grid, stack_grids(want)), [r.key for r in recs]
        assert len(got.host_grids) == len(recs)
        for g, w, r in zip(got.host_grids, want, recs):
            assert _same_grid(g, w), r.key


def test_reads_go_straight_to_the_file_and_count_the_same_bytes(ck, monkeypatch):
    """Every contiguous member read is one preadv (gpt-oss's interleaved gate/up rows are the
    strided exception: read and copied), and the index counts exactly the bytes the
    per-member path counts."""
    calls = []
    real = index_mod._pread_full
    monkeypatch.setattr(index_mod, "_pread_full", lambda *a: calls.append(a) or real(*a))
    batches = _batches(ck, 1 << 30)
    ck.index.stats.reset()
    for recs in batches:
        stack_grids([stored_grid(ck, r) for r in recs])
    old = (ck.index.stats.bytes_read, dict(ck.index.stats.per_tensor))
    assert not calls
    ck.index.stats.reset()
    for recs in batches:
        read_grid_stack(ck, recs, STAGE)
    assert (ck.index.stats.bytes_read, ck.index.stats.per_tensor) == old
    strided = sum(2 for recs in batches for r in recs if r.row_stride != 1)
    members = sum(len(recs) for recs in batches)
    assert len(calls) == 2 * members - strided > 0


def test_load_stack_same_under_every_reader(ck):
    for recs in _batches(ck, 1 << 30):
        old = load_stack(ck, recs, STAGE, "safetensors")
        for reader in ("preadv", "window"):  # the window reader's leftovers go through preadv
            new = load_stack(ck, recs, STAGE, reader)
            assert _same_grid(new.grid, old.grid)
            assert all(_same_grid(a, b)
                       for a, b in zip(new.host_grids, old.host_grids, strict=True))
    with pytest.raises(ValueError, match="reader must be one of"):
        load_stack(ck, recs, STAGE, "mmap")
    with pytest.raises(ValueError, match="reader must be one of"):
        ReadPlan("mmap", 1, 1, 1, 1)


def _windows(ck, window_bytes: int, limit: int = 1 << 30, dense: bool = False):
    recs = [r for r in ck.expert_records() if dense or grid_codec(ck, r)]
    return (recs, *window_plan(ck, recs, [signature(ck, r) for r in recs], limit, window_bytes,
                               dense))


@pytest.mark.parametrize("window_bytes", [1 << 30, 3000, 1], ids=["one", "small", "none"])
def test_window_stacks_equal_stack_grids_of_stored_grid(ck, window_bytes):
    """The window reader's stacks (members cut out of one span read front to back) are the
    per-member path's bit for bit; every record is in exactly one window or left to the
    per-batch readers, and only for a reason: strided rows (gpt-oss's interleaved gate/up),
    codes and scales in two shards, or a record larger than the window."""
    recs, windows, rest, parts = _windows(ck, window_bytes)
    placed = sorted([i for w in windows for i in w.items] + rest)
    assert placed == list(range(len(recs)))
    for w in windows:
        assert sorted(i for b in w.batches for i in b) == sorted(w.items)
        assert w.end - w.begin <= window_bytes and w.begin % WINDOW_ALIGN == 0
        buf, glob = load_window(ck, w, recs, parts, STAGE)
        for b in w.batches:
            got = window_stack(ck, w, buf, glob, b, [recs[i] for i in b], parts, STAGE)
            want = [stored_grid(ck, recs[i]) for i in b]
            assert _same_grid(got.grid, stack_grids(want)), [recs[i].key for i in b]
            assert all(_same_grid(g, x) for g, x in zip(got.host_grids, want, strict=True))
    for i in rest:
        r, spec = recs[i], ck.spec(recs[i].name)
        got = window_parts(ck, r)
        if got is None:
            files = {ck.index.entry(spec.part(k)).file for k in ("data", "scale")}
            assert r.row_stride != 1 or len(files) == 2, r.key
        else:
            lo = min(p.begin for p in got[1])
            hi = max(p.begin + p.nbytes for p in got[1])
            assert hi - (lo - lo % WINDOW_ALIGN) > window_bytes, r.key
    if window_bytes == 1 << 30 and ck.index.files and len(ck.index.files) == 1:
        assert windows  # one shard: every contiguous record is windowed


def test_window_reads_count_the_asked_bytes_and_the_gaps(ck):
    """A window counts each member part as read_into counts it; what lies between is counted
    as gap bytes, so asked + gaps is exactly the span read."""
    recs, windows, _, parts = _windows(ck, 1 << 30)
    ck.index.stats.reset()
    for w in windows:
        load_window(ck, w, recs, parts, STAGE)
    asked = sum(p.nbytes for w in windows for i in w.items for p in parts[i])
    nvfp4_globals = sum(ck.index.stats.per_tensor.get(ck.spec(recs[i].name).part(
        "global_scale"), 0) for w in windows for i in w.items
        if FMT_OF_CODEC[ck.spec(recs[i].name).codec] == "nvfp4")
    assert ck.index.stats.bytes_read - nvfp4_globals == asked
    assert asked + ck.index.stats.gap_bytes == sum(w.end - w.begin for w in windows)


@pytest.mark.parametrize("reader", ["safetensors", "preadv", "window"])
def test_a_truncated_shard_fails_the_stream_naming_the_file(tmp_path, reader):
    """A shard cut after the checkpoint was opened: the error from a read thread reaches the
    caller as CorruptShardError naming the shard (no hang, no stack of garbage)."""
    import writers

    from workbench.checkpoint.errors import CorruptShardError

    ck = open_checkpoint(writers.write_ct(tmp_path / "ck", "mxfp4", shards=1))
    shard = ck.index.files[0]
    os.truncate(shard, min(e.begin for e in ck.index.entries.values()
                           if e.name.endswith("weight_packed")) + 1)
    recs = [r for r in ck.expert_records() if grid_codec(ck, r)]
    plan = ReadPlan(reader, 1 << 20, 2, 2, 16 << 20)
    with pytest.raises(CorruptShardError) as ei:
        for _ in stream_stacks([Source(ck, recs)], [signature(ck, r) for r in recs], plan, CPU):
            pass
    assert ei.value.path == str(shard)


@pytest.mark.parametrize("reader", ["safetensors", "preadv", "window"])
@pytest.mark.parametrize("limit", [1 << 30, 3 * 96 * 64], ids=["whole", "threes"])
def test_stream_gives_every_record_once_in_stacks_of_one_key(ck, reader, limit, monkeypatch):
    """``stream_stacks``: each position in exactly one stack, the stacks of one key, each the
    per-member path's stack bit for bit, under every reader; and the plan's reader is the one
    that read: no preadv under safetensors, one per member part under preadv (strided rows are
    copied from a read), one per span under the window reader (where windows form)."""
    reads = []
    real = index_mod._pread_full
    monkeypatch.setattr(index_mod, "_pread_full", lambda *a: reads.append(a) or real(*a))
    recs = [r for r in ck.expert_records() if grid_codec(ck, r)]
    keys = [signature(ck, r) for r in recs]
    seen = []
    for batch, (got,) in stream_stacks([Source(ck, recs)], keys,
                                       ReadPlan(reader, limit, 2, 2, 1 << 30), CPU):
        assert len({keys[i] for i in batch}) == 1
        assert _same_grid(got.grid, stack_grids([stored_grid(ck, recs[i]) for i in batch]))
        seen += batch
    assert sorted(seen) == list(range(len(recs)))
    strided = sum(2 for r in recs if r.row_stride != 1)
    windows, rest, _ = window_plan(ck, recs, keys, limit, 1 << 30)
    want = {"safetensors": 0, "preadv": 2 * len(recs) - strided,
            "window": len(windows) + 2 * len(rest) - sum(2 for i in rest
                                                         if recs[i].row_stride != 1)}[reader]
    assert len(reads) == want, (reader, len(reads), want)


@pytest.mark.gpu
def test_cuda_stack_equals_stack_grids_of_stored_grid(ck):
    """On CUDA: pinned buffers, one async copy per buffer on the reader's stream; the device
    stack is the host path's bit for bit, and the host grids stay views of pinned memory."""
    dev = torch.device("cuda")
    for recs in _batches(ck, 1 << 30):
        want = stack_grids([stored_grid(ck, r) for r in recs])
        got = read_grid_stack(ck, recs, Stager(dev))
        stack, host = got.grid, got.host_grids
        assert stack.data.is_cuda and stack.scale.is_cuda
        assert all(g.data.is_pinned() and g.scale.is_pinned() for g in host)
        torch.cuda.synchronize()

        def cpu(t):
            return None if t is None else t.cpu()

        got = dataclasses.replace(stack, data=cpu(stack.data), scale=cpu(stack.scale),
                                  global_scale=cpu(stack.global_scale),
                                  library_global=cpu(stack.library_global))
        assert _same_grid(got, want), [r.key for r in recs]


def test_plan_windows_file_order_span_and_gap_rules():
    """Windows follow the files in the index's order, then offsets (not the items' order); a
    window ends at the span limit, at a gap larger than ``gap``, and at a file change; an item
    without a span or larger than a window is left over, in item order; inside a window, stacks
    are cut by key and element limit."""
    A, B = Path("a"), Path("b")
    spans = [(B, 0, 64), (A, 512, 576), (A, 0, 64), None, (A, 64, 128), (A, 128, 1200),
             (A, 1200, 1264), (A, 4000, 4064), (B, 64, 128)]
    keys = ["g", "g", "g", None, "d", "g", "g", "g", "d"]
    sizes = [10] * len(spans)
    wins, rest = plan_windows(spans, keys, sizes, limit=20, window_bytes=1024, gap=1000,
                                   file_rank={A: 0, B: 1})
    assert rest == [3, 5]  # no span; 1072 bytes > 1024
    got = [(w.file, w.begin, w.end, w.items) for w in wins]
    # 512 -> 1200 is within the gap but 0..1264 is over 1024 bytes; 1264 -> 4000 is a gap
    assert got == [(A, 0, 576, [2, 4, 1]), (A, 1152, 1264, [6]), (A, 3968, 4064, [7]),
                   (B, 0, 128, [0, 8])]
    assert [w.batches for w in wins] == [[[2, 1], [4]], [[6]], [[7]], [[0], [8]]]
    assert [len(w) for w in wins] == [3, 1, 1, 2]
    # a smaller gap cuts 64 -> 512
    wins, _ = plan_windows(spans, keys, sizes, 20, 1024, gap=100, file_rank={A: 0, B: 1})
    assert [w.items for w in wins][:2] == [[2, 4], [1]]
    # the element limit cuts a key's run inside a window
    wins, _ = plan_windows(spans, keys, [15] * len(spans), 20, 1024, 1000, {A: 0, B: 1})
    assert wins[0].batches == [[2], [1], [4]]


@pytest.mark.gpu
def test_cuda_window_stacks_equal_stack_grids_of_stored_grid(ck):
    """On CUDA the span goes to the device in one copy and the stacks are cut there: the same
    bits as the host path, no host grids (nothing on the GPU path uses them)."""
    dev = torch.device("cuda")
    recs, windows, _, parts = _windows(ck, 1 << 30)
    stager = Stager(dev)
    for w in windows:
        buf, glob = load_window(ck, w, recs, parts, stager)
        assert buf.is_cuda
        for b in w.batches:
            got = window_stack(ck, w, buf, glob, b, [recs[i] for i in b], parts, stager)
            assert got.grid.data.is_cuda and got.host_grids is None

            def cpu(t):
                return None if t is None else t.cpu()

            g = dataclasses.replace(got.grid, data=cpu(got.grid.data), scale=cpu(got.grid.scale),
                                    global_scale=cpu(got.grid.global_scale),
                                    library_global=cpu(got.grid.library_global))
            want = stack_grids([stored_grid(ck, recs[i]) for i in b])
            assert _same_grid(g, want), [recs[i].key for i in b]


def test_dense_window_stacks_equal_materialize(tmp_path):
    """BF16 weights (the reference of question 2, a BF16 checkpoint under candidate recipes) cut
    out of windows equal ``view_of(r).materialize()`` stacked; grids and BF16 never share a
    stack; a dense weight stored in another dtype is left to the per-batch readers (it is cast
    on read)."""
    from analysis_ckpts import moe_weights, write_dense, write_mxfp4

    sd = moe_weights(layers=3, experts=4, hidden=96, ffn=64)
    sd["model.layers.2.mlp.experts.3.up_proj.weight"] = \
        sd["model.layers.2.mlp.experts.3.up_proj.weight"].float()  # stored F32
    for ck in (open_checkpoint(write_dense(tmp_path / "bf16", sd)),
               open_checkpoint(write_mxfp4(tmp_path / "mx", sd))):  # packed: every proj a grid
        recs, windows, rest, parts = _windows(ck, 20000, dense=True)
        assert windows and sorted([i for w in windows for i in w.items] + rest) == \
            list(range(len(recs)))
        for w in windows:
            buf, glob = load_window(ck, w, recs, parts, STAGE)
            for b in w.batches:
                got = window_stack(ck, w, buf, glob, b, [recs[i] for i in b], parts, STAGE)
                if got.grid is None:
                    want = torch.stack([ck.view_of(recs[i]).materialize() for i in b])
                    assert _same(got.dense, want), [recs[i].key for i in b]
                else:
                    want = stack_grids([stored_grid(ck, recs[i]) for i in b])
                    assert _same_grid(got.grid, want)
        f32 = [i for i, r in enumerate(recs)
               if (r.layer, r.expert, r.proj, r.kind) == (2, 3, "up", "routed")]
        assert len(f32) == 1 and (f32[0] in rest) == (ck.spec(recs[f32[0]].name).codec is None)
        kinds = {(ck.spec(recs[i].name).codec is None) for w in windows for i in w.items}
        assert kinds == {ck.spec(recs[0].name).codec is None}


@pytest.mark.parametrize("limit", [1 << 30, 3 * 96 * 64], ids=["whole", "threes"])
def test_side_stacks_equal_load_stack(ck, limit, monkeypatch):
    """Question 2's stored side next to a reference window: one span when the batches' parts
    lie close together (one read of a small span), per batch otherwise; the stacks are
    load_stack's either way."""
    reads = []
    real = index_mod._pread_full
    monkeypatch.setattr(index_mod, "_pread_full", lambda *a: reads.append(a) or real(*a))
    recs = [r for r in ck.expert_records() if grid_codec(ck, r)]
    sizes = [r.shape[0] * r.shape[1] for r in recs]
    batches = plan_batches([signature(ck, r) for r in recs], sizes, limit)
    got = side_stacks(ck, recs, batches, STAGE, 1 << 30, "preadv")
    spans = len(reads)
    for b, g in zip(batches, got, strict=True):
        want = load_stack(ck, [recs[i] for i in b], STAGE, "preadv")
        assert _same_grid(g.grid, want.grid), [recs[i].key for i in b]
    one_shard = all(window_parts(ck, r) is not None for r in recs) and \
        len(ck.index.files) == 1
    assert (spans == 1) == one_shard, spans  # the test checkpoints are far below SPAN_CHUNK
    # two records far apart (first and last) with everything between left out: per batch
    far = [[0], [len(recs) - 1]]
    reads.clear()
    for b, g in zip(far, side_stacks(ck, recs, far, STAGE, 1 << 30, "preadv"), strict=True):
        assert _same_grid(g.grid, load_stack(ck, [recs[i] for i in b], STAGE, "preadv").grid)
    assert len(reads) > 1 or len(recs) <= 3
    # a span is never larger than the window limit: per batch, as load_stack reads them
    for b, g in zip(batches, side_stacks(ck, recs, batches, STAGE, 64, "preadv"), strict=True):
        assert _same_grid(g.grid, load_stack(ck, [recs[i] for i in b], STAGE, "preadv").grid)
