"""Where a warm CPU process spends an analysis table's time: each question x format of
jobs/bench_analysis.py (its checkpoints, built by its own ``build``), in one process, the second
call timed and split into stages, against the plain sequential read of the same files and the
time that the goal of 0.5x of that read (docs/performance.md) leaves per element.

Per cell: call 1 (``path="auto"``, warms the session: imports, any compile), then call 2 with
the stage timers on, each call from a cold page cache (the checkpoints closed in between: their
mapped pages survive eviction), as the benchmark does. All calls share one ``analysis.Session``,
as a notebook's would. ``path`` is what "auto" chose (the plan the tables come back with);
unless ``--no-fused``, cells that "auto" ran batched get a second row, ``fused (asked)``: the
same job with ``path="fused"`` (a call that compiles, then the timed one): what the compiled
passes reach once compiled, as "auto" runs them in a session that has compiled the job's
graphs. ``read s`` is the median of three cold plain reads (a single one varied 2x on the
2-core host).

How stages are attributed. Explicit timers (``time.perf_counter``) wrap functions at the seams
between stages, as module attributes looked up at call time; nothing inside a compiled graph is
wrapped (a timer there would break the graph), only the Python that calls graphs. Each timer is
exclusive: time inside a nested timed call goes to the inner stage only. Times are summed over
the threads that ran them, so ``read`` (on the reader pool, overlapping the main thread's
compute) can add with the rest to more than the wall time; every other stage runs on the main
thread (``fast`` computes the stacks ``stream_stacks`` yields there), and ``waited`` + the
main-thread stages + ``rest`` is the wall time of call 2. The timers are installed for the run
and removed after it.
- ``read``: ``checkpoint.stacks.load_stack`` (and the window reader's span and side reads, as
  ``checkpoint.stream`` calls them): the stored grid's (or the BF16 weights') bytes read from
  the safetensors mmap (the page faults land here), stacked and staged; reader threads.
- ``decode``: ``batched.decode_stack`` as ``fast`` calls it: a stored grid decoded to BF16
  eagerly (the batched path; also the BF16 weights batched recipes start from).
- ``graph``: the calls of compiled graphs (``Session.run``): Inductor's C++ for the closed
  forms or the traced codecs.
- ``pack``: ``fused_common.pack_blocks``: the closed forms' copy of each stack's codes and
  scale bytes into whole chunks of blocks (one pass over the stored bytes, outside the graph).
- ``outside``: the rest of the per-block and per-expert work around the graphs in their
  drivers: ``fused.stored_vs_recipe`` (per-weight scale tables, the NVFP4 amax pass's
  bookkeeping, assembling rows), ``fused.grid_reason`` (scale-range checks over each grid),
  ``compiled.recipe_rows`` / ``reference_rows`` and ``compiled.finite_reason`` (a finiteness
  pass over the stack), less the graph calls inside them.
- ``requant``: the eager re-quantization per recipe: ``batched.quantize_stack`` and the
  ``dequantize`` of its result, as ``fast`` calls them.
- ``metrics``: eager sums, maxima and counts: ``batched.stack_metrics``, ``stack_mismatch``.
- ``hist``: scale-exponent histograms: ``batched.stack_histograms``, ``FusedResult.histogram``.
- ``waited``: the main thread inside ``stream_stacks``, for the next stack: blocked on its load
  (and, under the window reader, cutting it out of its span).
- ``rest``: call 2's wall time less all main-thread stages and ``waited``: opening the
  checkpoint, records, the plan, rows and the pandas tables.
ns/el is a stage's seconds over the cell's elements (as the plan counts them, ``plan.elements``:
weight elements times recipes). ``budget`` is the wall ns per element that 0.5x of the measured read
leaves (2 x read s / elements); on 2 cores that is twice as many CPU-ns.

    python jobs/analysis_profile_cpu.py --experts 32 --size-gb 0.2 --ref-gb 0.3   # a few minutes
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import platform
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
STAGES = ("read", "decode", "graph", "pack", "outside", "requant", "metrics", "hist", "waited",
          "rest")
MAIN = STAGES[1:-2]  # the stages that run on the main thread, inside the pipeline's compute


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


class Stages:
    """Exclusive wall time per stage, summed over threads (a per-thread stack of open timers:
    a nested timed call's time is taken out of its caller's)."""

    def __init__(self):
        self.acc: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.on = False

    def wrap(self, stage: str, fn):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            stack = self._local.__dict__.setdefault("stack", [])
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter() - t0
                inner = stack.pop()
                with self._lock:
                    self.acc[stage] += spent - inner
                if stack:
                    stack[-1] += spent

        return timed


def instrument(stages: Stages):
    """Install the timers (for the whole process; they time only while ``stages.on``); returns
    the function that removes them."""
    from workbench.analysis import batched, compiled, fast, fused, fused_fp8, fused_nvfp4
    from workbench.analysis.session import Session
    from workbench.checkpoint import stream

    undo = []

    def patch(obj, name, stage):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, stages.wrap(stage, getattr(obj, name)))

    # fast's own view of batched and dequantize: compiled.py's graphs call batched too, and a
    # timer traced into a graph would break it, so the module itself is left alone
    view = SimpleNamespace(**{k: getattr(batched, k) for k in dir(batched) if not k.startswith("__")})
    for name, stage in (("decode_stack", "decode"), ("quantize_stack", "requant"),
                        ("stack_metrics", "metrics"), ("stack_mismatch", "metrics"),
                        ("stack_histograms", "hist")):
        patch(view, name, stage)
    undo.append((fast, "batched", batched))
    fast.batched = view
    patch(fast, "dequantize", "requant")
    for name in ("load_stack", "load_window", "side_stacks"):
        patch(stream, name, "read")
    patch(Session, "run", "graph")
    for mod in (fused, fused_fp8, fused_nvfp4):
        patch(mod, "pack_blocks", "pack")
    for mod, name in ((fused, "stored_vs_recipe"), (fused, "grid_reason"),
                      (compiled, "recipe_rows"), (compiled, "reference_rows"),
                      (compiled, "finite_reason")):
        patch(mod, name, "outside")
    patch(fused.FusedResult, "histogram", "hist")

    real_stream = fast.stream_stacks

    def timed_stream(*a, **k):
        it = real_stream(*a, **k)
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    got = next(it)
                finally:
                    if stages.on:
                        stages.acc["waited"] += time.perf_counter() - t0
                yield got
        except StopIteration:
            return
        finally:
            it.close()

    undo.append((fast, "stream_stacks", real_stream))
    fast.stream_stacks = timed_stream

    def remove():
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)

    return remove


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wb-bench-analysis"),
                    help="checkpoints (the benchmark's default: its files are reused)")
    ap.add_argument("--size-gb", type=float, default=0.2)
    ap.add_argument("--ref-gb", type=float, default=0.3)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--small-shape", action="store_true", help="hidden 512, FFN 256 (tests)")
    ap.add_argument("--formats", default="mxfp4,nvfp4,mxfp8_e4m3")
    ap.add_argument("--questions", default="stored_vs_recipes,candidate_errors,reference_errors")
    ap.add_argument("--no-fused", action="store_true",
                    help="skip the path='fused' comparison of cells auto runs batched")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                    else None, help="also write analysis_profile_cpu.md here (default: $OUT)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")

    ba = _load("bench_analysis", HERE / "bench_analysis.py")
    bc = ba._bench_checkpoint()
    shape = ba.Shape(512, 256, args.experts, 0.25) if args.small_shape else \
        ba.Shape(experts=args.experts)
    stages = Stages()
    remove = instrument(stages)
    try:
        rows, load0 = _profile(args, ba, bc, stages, shape)
    finally:
        remove()
    text = table(rows, load0, shape, argv if argv is not None else sys.argv[1:])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "analysis_profile_cpu.md").write_text(text + "\n")
        # the rows unrounded (the table prints two decimals), for comparing runs and for tests
        (args.out / "analysis_profile_cpu.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _profile(args, ba, bc, stages: Stages, shape) -> tuple[list[dict], tuple]:
    """Every cell's rows (see the module docstring), and the load average before."""
    from workbench.analysis import Session

    session = Session()
    load0 = os.getloadavg()
    rows = []
    for fmt in args.formats.split(","):
        for q in args.questions.split(","):
            if q == "reference_errors":
                L = ba.layers_for("bf16", args.ref_gb, shape)
                ck_path = ba.build(fmt, args.dir / f"{fmt}-{L}L", L, shape)
                ref_path = ba.build("bf16", args.dir / f"bf16-{L}L", L, shape)
            else:
                L = ba.layers_for(fmt, args.size_gb, shape)
                ck_path, ref_path = ba.build(fmt, args.dir / f"{fmt}-{L}L", L, shape), None
            files = ba.shard_files(ck_path, *([ref_path] if ref_path else []))
            reads = []
            for _ in range(3):  # a single cold read varied 2x on this host
                bc.evict(files)
                reads.append(bc.sequential_read(files, f"read {fmt}")[1])
            read_s = sorted(reads)[1]

            cell = SimpleNamespace(q=q, fmt=fmt, ck=ck_path, ref=ref_path, files=files)
            _call_once(ba, bc, stages, cell, "auto", False, session)
            secs, plan = _call_once(ba, bc, stages, cell, "auto", True, session)
            rows.append(_row(cell, plan.elements, read_s, secs, plan.path, plan.why,
                             dict(stages.acc)))
            if plan.path != "fused" and not args.no_fused:  # what the compiled passes reach
                _call_once(ba, bc, stages, cell, "fused", False, session)  # compiles
                secs, fused = _call_once(ba, bc, stages, cell, "fused", True, session)
                rows.append(_row(cell, plan.elements, read_s, secs, "fused (asked)", fused.why,
                                 dict(stages.acc)))
    return rows, load0


def _row(cell, elements: int, read_s: float, secs: float, path: str, why: str, acc: dict):
    split = {s: acc.get(s, 0.0) for s in STAGES[:-1]}
    split["rest"] = secs - split["waited"] - sum(split[s] for s in MAIN)
    print(f"{cell.q} {cell.fmt}: {secs:.2f} s ({read_s / secs:.2f}x of a {read_s:.2f} s read), "
          f"{path}, " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()), flush=True)
    return {"q": cell.q, "fmt": cell.fmt, "elements": elements, "read_s": read_s, "secs": secs,
            "path": path, "why": why, "split": split}


def _call_once(ba, bc, stages: Stages, cell, path: str, timed: bool, session):
    """One table call of ``cell`` (question, format, checkpoints) from a cold page cache in
    ``session``: (its wall seconds, the checkpoints opened inside; the plan it ran)."""
    from workbench.checkpoint import open_checkpoint

    bc.evict(cell.files)
    stages.acc.clear()
    stages.on = timed
    t0 = time.perf_counter()
    ck = open_checkpoint(cell.ck)
    ref = open_checkpoint(cell.ref) if cell.ref else None
    t = ba._call(cell.q, ck, ref, cell.fmt, path, "cpu", session=session)
    secs = time.perf_counter() - t0
    stages.on = False
    for c in (ck, ref):  # mapped pages would survive the next eviction
        if c is not None:
            c.index.close()
    del ck, ref
    gc.collect()
    return secs, t.plan


def table(rows: list[dict], load0, shape, argv) -> str:
    head = [(f"machine: {platform.machine()}, {os.cpu_count()} cores; load avg {load0[0]:.2f} "
             f"before / {os.getloadavg()[0]:.2f} after; torch {torch.__version__}, python "
             f"{platform.python_version()}; shape hidden {shape.hidden}, FFN {shape.inter}, "
             f"{shape.experts} experts/layer"),
            f"command: python jobs/analysis_profile_cpu.py {' '.join(argv)}",
            ("stage cells: seconds of call 2 (ns per element); read on the reader threads, "
             "overlapping the rest"),
            "",
            "| question | format | elements | read s | call 2 s | vs read | path | "
            + " | ".join(STAGES) + " | budget ns/el |",
            "|" + "---|" * (7 + len(STAGES) + 1)]
    for r in rows:
        n = r["elements"]
        cells = [f"{r['split'][s]:.2f} ({r['split'][s] / n * 1e9:.1f})" for s in STAGES]
        head.append(f"| {r['q']} | {r['fmt']} | {n / 1e6:.0f}M | {r['read_s']:.2f} | "
                    f"{r['secs']:.2f} | {r['read_s'] / r['secs']:.2f}x | {r['path']} | "
                    + " | ".join(cells) + f" | {2 * r['read_s'] / n * 1e9:.1f} |")
    head += ["", "auto's reasons:"] + sorted({f"- {r['q']} {r['fmt']}: {r['path']} ({r['why']})"
                                              for r in rows})
    return "\n".join(head)


if __name__ == "__main__":
    sys.exit(main())
