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
    from workbench import analysis
    from workbench.analysis import fast, tables
    from workbench.checkpoint import open_checkpoint
    from workbench.recipe import parse_recipe

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

    orig_sig = fast._signature

    def set_order(order):
        fast._signature = orig_sig if order == "signature" else \
            (lambda ck, r: (r.layer, orig_sig(ck, r)))

    def set_reader(reader, threads):
        fast.READER = reader
        fast.READ_THREADS = threads
        fast._POOL.clear()

    def loads_only(ck, order):
        set_order(order)
        items = tables._records(ck, ("routed", "shared", "dense"))
        plan = fast.Plan.default(dev)
        sizes = [r.shape[0] * r.shape[1] for r in items]
        batches = fast.plan_batches([fast._signature(ck, r) for r in items], sizes,
                                    plan.batch_elements)

        def compute(b, loaded):
            return ()

        for _ in fast.pipeline(batches, lambda b: fast.load_stack(ck, [items[i] for i in b], dev,
                                                                   want_grid_only=True),
                               compute, workers=plan.workers, ahead=plan.ahead, desc="",
                               total=len(items), progress=False):
            pass
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return len(batches)

    threads = [int(t) for t in args.threads.split(",")]
    for reader in ("safetensors", "preadv"):
        for order in ("signature", "layer"):
            for th in (threads if reader == "preadv" else threads[:1]):
                set_reader(reader, th)
                bc.evict(files)
                ck = open_checkpoint(path)
                t0 = time.perf_counter()
                nb = loads_only(ck, order)
                s = time.perf_counter() - t0
                row(f"loads only [{reader}, {th} threads, order {order}]", s,
                    vs_read=round(read_s / s, 2), batches=nb)

    # the full question, the main thread's time split into waiting and computing
    orig_pipeline = fast.pipeline

    def timed_pipeline(batches, load, compute, **kw):
        acc = timed_pipeline.acc

        def timed_compute(b, loaded):
            t = time.perf_counter()
            out = list(compute(b, loaded))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            acc["compute"] += time.perf_counter() - t
            return out

        t0 = time.perf_counter()
        # the whole pipeline less its compute steps: waiting for loads (fut.result) and the pool
        yield from orig_pipeline(batches, load, timed_compute, **kw)
        acc["total"] += time.perf_counter() - t0

    variants = [(r, o) for r in ("safetensors", "preadv") for o in ("signature", "layer")] + \
        [("window", "signature")]  # the window reader orders by file itself
    # the first pass also starts CUDA and the codecs' first launches: run it twice
    for k, (reader, order) in enumerate(variants):
        set_reader(reader, threads[0])
        set_order(order)
        fast.pipeline = timed_pipeline
        for call in ((1, 2) if k == 0 else (2,)):
            timed_pipeline.acc = {"compute": 0.0, "total": 0.0}
            bc.evict(files)
            ck = open_checkpoint(path)
            t0 = time.perf_counter()
            t = analysis.stored_vs_recipes(ck, ["mxfp4:rceil"], progress=False)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            s = time.perf_counter() - t0
            acc = timed_pipeline.acc
            row(f"full [{reader}, order {order}], call {call}", s, vs_read=round(read_s / s, 2),
                compute_s=round(acc["compute"], 2),
                waiting_s=round(acc["total"] - acc["compute"], 2), rows=len(t.experts))
        fast.pipeline = orig_pipeline
    set_order("signature")

    # compute only: one batch, warm, its metrics again and again
    set_reader("preadv", threads[0])
    ck = open_checkpoint(path)
    items = tables._records(ck, ("routed",))
    plan = fast.Plan.default(dev)
    sizes = [r.shape[0] * r.shape[1] for r in items]
    batches = fast.plan_batches([fast._signature(ck, r) for r in items], sizes, plan.batch_elements)
    b = [items[i] for i in batches[0]]
    loaded = fast.load_stack(ck, b, dev, want_grid_only=True)
    stand_for = sum(ck.index.entry(ck.spec(r.name).part(p)).nbytes for r in b
                    for p in ("data", "scale"))
    captured = {}

    class Captured(Exception):
        pass

    def grab(batches_, load, compute, **kw):  # stored_results' compute step, kept, nothing run
        captured["compute"] = compute
        raise Captured

    fast.pipeline = grab
    try:
        fast.stored_results(ck, b, [parse_recipe("mxfp4:rceil")], dev, plan, False, False)
    except Captured:
        pass
    finally:
        fast.pipeline = orig_pipeline
    if "compute" in captured:
        for _ in range(2):
            list(captured["compute"](list(range(len(b))), loaded))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        n = 5
        t0 = time.perf_counter()
        for _ in range(n):
            list(captured["compute"](list(range(len(b))), loaded))
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
    from workbench.analysis import fast, tables
    from workbench.checkpoint import open_checkpoint

    fast.READER = "window"
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

    orig_pipeline = fast.pipeline
    acc = {}

    def timed_pipeline(batches, load, compute, **kw):
        def timed_compute(b, loaded):
            t = time.perf_counter()
            out = list(compute(b, loaded))
            sync()
            acc["compute"] += time.perf_counter() - t
            return out

        t0 = time.perf_counter()
        yield from orig_pipeline(batches, load, timed_compute, **kw)
        acc["total"] += time.perf_counter() - t0

    fast.pipeline = timed_pipeline
    try:
        for call in (1, 2):
            acc.update(compute=0.0, total=0.0)
            bc.evict(files)
            ck, ref = open_checkpoint(mine_path), open_checkpoint(ref_path)
            t0 = time.perf_counter()
            t = analysis.reference_errors(ck, ref, kinds=("routed",), progress=False)
            sync()
            s = time.perf_counter() - t0
            row(f"full [window], call {call}", s, read_s, compute_s=round(acc["compute"], 2),
                waiting_s=round(acc["total"] - acc["compute"], 2), rows=len(t.experts))
            ck.index.close()
            ref.index.close()
    finally:
        fast.pipeline = orig_pipeline

    def loads(which: str) -> None:
        bc.evict(files)
        ck, ref = open_checkpoint(mine_path), open_checkpoint(ref_path)
        items = tables._records(ck, ("routed",))
        refs = [ref.record(r.layer, r.expert, r.proj, r.kind) for r in items]
        plan = fast.Plan.default(dev)
        keys = [(*fast._signature(ck, r), fast._signature(ref, q)) for r, q in zip(items, refs)]
        if which == "packed side":  # the packed grids alone, in the path's own spans
            windows, _, parts = fast.window_plan(ck, items, keys, plan)
        else:
            windows, _, parts = fast.window_plan(ref, refs, keys, plan, dense=True)
        t0 = time.perf_counter()
        for w in windows:
            if which == "packed side":
                fast._load_window(ck, w, items, parts, dev)
            else:
                fast._load_window(ref, w, refs, parts, dev)
                if which == "both":
                    fast._side_stacks(ck, items, w.batches, dev, plan.window_bytes)
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
