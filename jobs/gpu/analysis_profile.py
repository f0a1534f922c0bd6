"""Where the batched analysis path's time goes on a GPU host: one process, one checkpoint, each
pass from a cold page cache, every variant against the plain sequential read of the same files.

Rows (``stored_vs_recipes`` with an MXFP4 recipe on the MXFP4 checkpoint of jobs/bench_analysis.py):
- ``plain read``: the shard files front to back (16 MiB ``readinto``), the I/O ceiling;
- ``loads only``: the path's own batches read into (pinned) stacks and copied to the GPU, no
  metric computed: what the reader alone reaches, per reader, read-thread count and batch order;
- ``full``: the whole question, with the main thread's time split into waiting for the next
  batch's load and computing the batch (GPU work plus the host's launches and the per-row
  results it reads back);
- ``compute only``: one batch loaded once, its metrics computed again and again: the GPU side's
  own rate, as GB/s of checkpoint bytes the batch stands for.

With ``--question reference`` (reference errors: the MXFP4 checkpoint against its BF16
reference, a pair of ``--size-gb`` in all, the window reader): ``plain read`` of both; ``full``
split as above, call 1 and call 2; ``loads only`` of the path's units (each BF16 reference span
and, per span, the packed grids of its experts), of the reference spans alone and of the packed
side alone: whether the reads or the math set the pace, and what alternating between the two
checkpoints' files costs.

Batch order: ``signature`` is the path's grouping (same-shape weights of the whole checkpoint
together: all gate+up stacks of every layer, then all down stacks); ``layer`` groups per layer
first, so reads move through the files front to back.

    python3 jobs/gpu/analysis_profile.py --size-gb 15 --out "$OUT"
    python3 jobs/gpu/analysis_profile.py --question reference --size-gb 15 --out "$OUT"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=15.0)
    ap.add_argument("--dir", default="/tmp/wb-analysis-profile")
    ap.add_argument("--out", default=".")
    ap.add_argument("--threads", default="8,16", help="read-thread counts for the loads-only rows")
    ap.add_argument("--question", choices=("stored", "reference"), default="stored")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    if args.question == "reference":
        return reference_profile(args)

    ba = _load("bench_analysis", HERE.parent / "bench_analysis.py")
    bc = ba._bench_checkpoint()
    from workbench.analysis import Session, fast, plans, tables
    from workbench.checkpoint import open_checkpoint
    from workbench.checkpoint.stacks import Stager, load_stack
    from workbench.checkpoint.stream import Source, stream_stacks

    shape = ba.Shape()
    path = ba.build("mxfp4", Path(args.dir) / "mxfp4", ba.layers_for("mxfp4", args.size_gb, shape),
                    shape)
    files = ba.shard_files(path)
    nbytes = sum(f.stat().st_size for f in files)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []

    def row(what, secs, **extra):
        r = {"what": what, "seconds": round(secs, 2), "GB/s": round(nbytes / secs / 1e9, 3),
             **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)
        return r

    bc.evict(files)
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    read_s = time.perf_counter() - t0
    row("plain read", read_s, vs_read=1.0)

    recipes = ["mxfp4:rceil"]

    def job_in(ck, order: str):
        """Question 3's job on ``ck``, its stacks grouped as the path groups them
        (``signature``) or layer by layer first (``layer``)."""
        j = plans.job("stored_vs_recipes", ck, recipes)
        if order == "layer":
            j = replace(j, keys=[(r.layer, k) for r, k in zip(j.items, j.keys)])
        return j

    def plan_of(ck, j, reader: str, threads: int):
        p = plans.plan_job(j, ck, recipes, device=dev, path="batched", reader=reader)
        return replace(p, reads=replace(p.reads, read_threads=threads))

    def loads_only(ck, order, reader, threads):
        j = job_in(ck, order)
        p = plan_of(ck, j, reader, threads)
        n = 0
        for _ in stream_stacks([Source(ck, j.items, dense=False)], j.keys, p.reads, dev):
            n += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return n

    threads = [int(t) for t in args.threads.split(",")]
    for reader in ("safetensors", "preadv"):
        for order in ("signature", "layer"):
            for th in (threads if reader == "preadv" else threads[:1]):
                bc.evict(files)
                ck = open_checkpoint(path)
                t0 = time.perf_counter()
                nb = loads_only(ck, order, reader, th)
                s = time.perf_counter() - t0
                row(f"loads only [{reader}, {th} threads, order {order}]", s,
                    vs_read=round(read_s / s, 2), batches=nb)

    # the full question, the main thread's time split into waiting for the next stack (inside
    # stream_stacks) and computing it
    real_stream = fast.stream_stacks

    def timed_stream(*a, **k):
        it = real_stream(*a, **k)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    got = next(it)
                finally:
                    timed_stream.acc["waiting"] += time.perf_counter() - t0
                yield got
        except StopIteration:
            return
        finally:
            it.close()

    variants = [(r, o) for r in ("safetensors", "preadv") for o in ("signature", "layer")] + \
        [("window", "signature")]  # the window reader orders by file itself
    session = Session()
    fast.stream_stacks = timed_stream
    try:
        # the first pass also starts CUDA and the codecs' first launches: run it twice
        for k, (reader, order) in enumerate(variants):
            for call in ((1, 2) if k == 0 else (2,)):
                timed_stream.acc = {"waiting": 0.0}
                bc.evict(files)
                ck = open_checkpoint(path)
                t0 = time.perf_counter()
                j = job_in(ck, order)
                p = plan_of(ck, j, reader, threads[0])
                t = tables._collect(fast.stored_results(p, session, ck, j, False),
                                    tables._pd(), p)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                s = time.perf_counter() - t0
                waiting = timed_stream.acc["waiting"]
                row(f"full [{reader}, order {order}], call {call}", s,
                    vs_read=round(read_s / s, 2), compute_s=round(s - waiting, 2),
                    waiting_s=round(waiting, 2), rows=len(t.experts))
    finally:
        fast.stream_stacks = real_stream

    # compute only: one stack loaded once, its metrics computed again and again
    ck = open_checkpoint(path)
    j = plans.job("stored_vs_recipes", ck, recipes, kinds=("routed",))
    p = plan_of(ck, j, "preadv", threads[0])
    first = next(iter(stream_stacks([Source(ck, j.items, dense=False)], j.keys, p.reads, dev)))
    b = [j.items[i] for i in first[0]]
    loaded = load_stack(ck, b, Stager(dev), "preadv", dense=False)
    stand_for = sum(ck.index.entry(ck.spec(r.name).part(q)).nbytes for r in b
                    for q in ("data", "scale"))
    one = replace(j, items=b, refs=None, keys=[j.keys[i] for i in first[0]],
                  stored=[j.stored[i] for i in first[0]])
    p_one = plans.plan_job(one, ck, recipes, device=dev, path="batched")

    def loaded_once(*a, **k):  # the stream's one stack: the loaded one, nothing is read
        yield list(range(len(b))), (loaded,)

    def compute():  # stored_results on the loaded stack
        fast.stream_stacks = loaded_once
        try:
            fast.stored_results(p_one, session, ck, one, False)
        finally:
            fast.stream_stacks = real_stream

    for _ in range(2):
        compute()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    n = 5
    t0 = time.perf_counter()
    for _ in range(n):
        compute()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    s = (time.perf_counter() - t0) / n
    rows.append({"what": f"compute only (one batch of {len(b)} weights, warm)",
                 "seconds": round(s, 4), "GB/s": round(stand_for / s / 1e9, 2)})
    print(json.dumps(rows[-1]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    head = (f"machine: {os.cpu_count()} cores, {gpu}; torch {torch.__version__}; "
            f"checkpoint {nbytes / 1e9:.2f} GB, {len(files)} shards")
    lines = [head,
             "| pass | s | GB/s | vs read | compute s | waiting s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['seconds']} | {r['GB/s']} | {r.get('vs_read', '')} | "
                     f"{r.get('compute_s', '')} | {r.get('waiting_s', '')} |")
    (out / "analysis_profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _write(rows: list, head: str, out: Path, name: str) -> None:
    lines = [head,
             "| pass | s | GB/s | vs read | compute s | waiting s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['seconds']} | {r.get('GB/s', '')} | "
                     f"{r.get('vs_read', '')} | {r.get('compute_s', '')} | "
                     f"{r.get('waiting_s', '')} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def reference_profile(args) -> int:
    """The ``--question reference`` rows (see the module docstring)."""
    ba = _load("bench_analysis", HERE.parent / "bench_analysis.py")
    bc = ba._bench_checkpoint()
    from workbench import analysis
    from workbench.analysis import Session, fast, plans
    from workbench.checkpoint import open_checkpoint
    from workbench.checkpoint.stacks import Stager
    from workbench.checkpoint.windows import load_window, side_stacks, window_plan

    shape = ba.Shape()
    # a pair of size_gb: BF16 is 2 bytes an element, MXFP4 0.53
    L = ba.layers_for("bf16", args.size_gb * 2 / 2.53, shape)
    mine_path = ba.build("mxfp4", Path(args.dir) / f"mxfp4-{L}L", L, shape)
    ref_path = ba.build("bf16", Path(args.dir) / f"bf16-{L}L", L, shape)
    files = ba.shard_files(mine_path, ref_path)
    nbytes = sum(f.stat().st_size for f in files)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []

    def row(what, secs, read_s=None, **extra):
        r = {"what": what, "seconds": round(secs, 2), "GB/s": round(nbytes / secs / 1e9, 3),
             **({} if read_s is None else {"vs_read": round(read_s / secs, 2)}), **extra}
        rows.append(r)
        print(json.dumps(r), flush=True)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    bc.evict(files)
    _, read_s = bc.sequential_read(files, "read pair")
    row("plain read (both checkpoints)", read_s, read_s)

    real_stream = fast.stream_stacks
    acc = {}

    def timed_stream(*a, **k):
        it = real_stream(*a, **k)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    got = next(it)
                finally:
                    acc["waiting"] += time.perf_counter() - t0
                yield got
        except StopIteration:
            return
        finally:
            it.close()

    session = Session()
    fast.stream_stacks = timed_stream
    try:
        for call in (1, 2):
            acc.update(waiting=0.0)
            bc.evict(files)
            ck, ref = open_checkpoint(mine_path), open_checkpoint(ref_path)
            t0 = time.perf_counter()
            p = analysis.plan("reference_errors", ck, ref, kinds=("routed",), device=dev,
                              reader="window", session=session)
            t = analysis.reference_errors(ck, ref, kinds=("routed",), progress=False, plan=p,
                                          session=session)
            sync()
            s = time.perf_counter() - t0
            row(f"full [window], call {call}", s, read_s, compute_s=round(s - acc["waiting"], 2),
                waiting_s=round(acc["waiting"], 2), rows=len(t.experts))
            ck.index.close()
            ref.index.close()
    finally:
        fast.stream_stacks = real_stream

    def loads(which: str) -> None:
        bc.evict(files)
        ck, ref = open_checkpoint(mine_path), open_checkpoint(ref_path)
        j = plans.job("reference_errors", ck, ref, kinds=("routed",))
        reads, _ = plans.read_plan(dev, "window")
        stager = Stager(dev)
        if which == "packed side":  # the packed grids alone, in the path's own spans
            windows, _, parts = window_plan(ck, j.items, j.keys, reads.batch_elements,
                                            reads.window_bytes)
        else:
            windows, _, parts = window_plan(ref, j.refs, j.keys, reads.batch_elements,
                                            reads.window_bytes, dense=True)
        t0 = time.perf_counter()
        for w in windows:
            if which == "packed side":
                load_window(ck, w, j.items, parts, stager)
            else:
                load_window(ref, w, j.refs, parts, stager)
                if which == "both":
                    side_stacks(ck, j.items, w.batches, stager, reads.window_bytes, "window")
        sync()
        row(f"loads only [{which}], {len(windows)} spans", time.perf_counter() - t0, read_s)

    for which in ("both", "reference spans", "packed side"):
        loads(which)
    gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    _write(rows, f"machine: {os.cpu_count()} cores, {gpu}; torch {torch.__version__}; pair "
           f"{nbytes / 1e9:.2f} GB ({L} layers MXFP4 + BF16), {len(files)} shards; reference "
           "errors, window reader", Path(args.out), "analysis_profile_reference.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
