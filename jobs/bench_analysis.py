"""Analysis benchmark: per-expert error of a multi-GB packed checkpoint, against the I/O ceiling.

Uses the checkpoint of ``jobs/bench_checkpoint.py`` (compressed-tensors MXFP4, Qwen3-30B-A3B
expert shapes; built once) and reports in one table, each pass with a cold page cache:

- plain sequential read of the shard files (the I/O ceiling);
- ``workbench.analysis.stored_vs_recipes(ck, ["mxfp4:rceil"])`` (question 3: every stored expert
  re-quantized, every metric and the scale histogram), in a fresh process: first the call a new
  notebook kernel makes (imports of torch.compile's machinery and the compile, or its load from
  Inductor's disk cache, included), then a second call in the same process (compiled); with
  ``WORKBENCH_ANALYSIS_FUSED=1``, since --small is below the size where "auto" compiles;
- the same call on the reference path (``WORKBENCH_ANALYSIS_FUSED=0``), in a fresh process;
- the naive path: ``safetensors.load_file`` of every shard (the whole checkpoint in memory),
  decode all experts at once, then the same metrics. (transformers is not used for it: the
  synthetic checkpoint holds experts only, so there is no model to instantiate.)
The fused and reference tables are compared (counts equal, float metrics' largest relative
difference). Throughput is GB/s of packed bytes on disk; memory is peak anonymous RSS growth
during the pass, also as a multiple of one expert projection's BF16 size.

    python jobs/bench_analysis.py               # 2 GB checkpoint in /tmp/wb-bench-ckpt
    python jobs/bench_analysis.py --small       # seconds
    python jobs/bench_analysis.py --cold-compile  # empty Inductor cache: first-ever compile
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _bench_checkpoint():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", HERE / "bench_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_checkpoint"] = mod
    spec.loader.exec_module(mod)
    return mod


class PeakAnon:
    """Samples RssAnon every 20 ms on a thread (work runs in torch ops that release the GIL)."""

    def __init__(self):
        self.base = self.peak = self._read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._read())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._read())


def _workbench_pass(path: str, conn, env: dict) -> None:
    """Two calls in one fresh process, each with a cold page cache: what a new notebook kernel
    pays on its first call (imports, compile) and what every later call costs."""
    os.environ.update(env)
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    import logging

    from workbench.analysis import fused, stored_vs_recipes
    from workbench.checkpoint import open_checkpoint

    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    bc = _bench_checkpoint()
    files = sorted(Path(path).glob("*.safetensors"))
    out = {"passes": []}
    for _ in range(1 if env.get("WORKBENCH_ANALYSIS_FUSED") == "0" else 2):
        bc.evict(files)
        with PeakAnon() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            ck = open_checkpoint(path)
            t = stored_vs_recipes(ck, ["mxfp4:rceil"], progress=True)
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        out["passes"].append({"seconds": secs, "cpu_s": cpu, "growth": mem.peak - mem.base})
    rec = ck.experts()[0]
    out.update(rows=len(t.experts), proj_bf16=rec.shape[0] * rec.shape[1] * 2,
               compile_s=dict(fused.COMPILE_SECONDS), experts=t.experts, scales=t.scales)
    conn.send(out)


def _compare(a, b) -> str:
    """How the fused table ``b`` differs from the reference table ``a``."""

    exact = [c for c in a.columns if c not in ("rel_err", "sqnr_db", "cosine")]
    same = all(a[c].fillna(-1).tolist() == b[c].fillna(-1).tolist() for c in exact)
    worst = 0.0
    for c in ("rel_err", "sqnr_db", "cosine"):
        for x, y in zip(a[c], b[c]):
            if x != y:  # equal infinities (lossless rows) compare equal here
                worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
    return (f"fused vs reference table: counts, maxima and histograms "
            f"{'equal' if same else 'DIFFER'}; rel_err/sqnr_db/cosine differ by at most "
            f"{worst:.1e} (relative)")


def _naive_pass(path: str, conn) -> None:
    """Everything in memory first, then the same metrics."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from safetensors.torch import load_file

    from workbench.analysis import error_metrics
    from workbench.formats import QuantizedTensor, dequantize, quantize

    with PeakAnon() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        sd = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            sd.update(load_file(str(f)))
        names = sorted(n[: -len("_packed")] for n in sd if n.endswith("weight_packed"))
        decoded = {}
        for n in names:
            d, s = sd[n + "_packed"], sd[n + "_scale"]
            q = QuantizedTensor("mxfp4", "compressed-tensors", d, s, None, (d.shape[0], d.shape[1] * 2))
            decoded[n] = dequantize(q, torch.bfloat16)
        rows = []
        for n, w in decoded.items():
            q = quantize(w, "mxfp4:rceil")
            rows.append(error_metrics(w, dequantize(q, torch.float32), q))
        secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    conn.send({"seconds": secs, "cpu_s": cpu, "rows": len(rows), "growth": mem.peak - mem.base})


def _in_child(target, path: str, *args) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(path, child, *args))
    p.start()
    out = parent.recv()
    p.join()
    if p.exitcode:
        raise RuntimeError(f"{target.__name__} failed with exit code {p.exitcode}")
    return out


def main(argv: list[str] | None = None) -> int:
    bc = _bench_checkpoint()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wb-bench-ckpt"))
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--skip-naive", action="store_true", help="the naive pass holds everything")
    ap.add_argument("--skip-reference", action="store_true", help="the reference pass is slow")
    ap.add_argument("--cold-compile", action="store_true",
                    help="compile into an empty Inductor cache (what a first-ever run pays)")
    args = ap.parse_args(argv)
    if args.small:
        cfg = bc.BenchConfig(args.dir / "small", size_gb=0.06, hidden=1024, inter=512, experts=16,
                             shard_gb=0.02)
    else:
        cfg = bc.BenchConfig(args.dir / f"{args.size_gb:g}gb", size_gb=args.size_gb)
    path = bc.build_checkpoint(cfg)
    files = sorted(path.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    load0 = os.getloadavg()

    method = bc.evict(files)
    _, read_s = bc.sequential_read(files, "read cold")
    rows = [("sequential read (I/O ceiling)", read_s, None, None, None)]
    env = {"WORKBENCH_ANALYSIS_FUSED": "1"}  # also below fused.MIN_ELEMENTS (--small)
    if args.cold_compile:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="wb-inductor-") as cache:
            wb = _in_child(_workbench_pass, str(path), {**env, "TORCHINDUCTOR_CACHE_DIR": cache})
    else:
        wb = _in_child(_workbench_pass, str(path), env)
    first, second = wb["passes"]
    compiled = sum(wb["compile_s"].values())
    rows.append((f"stored_vs_recipes, 1st call in process [{compiled:.1f} s compile]",
                 first["seconds"], first["cpu_s"], first["growth"], wb["rows"]))
    rows.append(("stored_vs_recipes, 2nd call (compiled)", second["seconds"], second["cpu_s"],
                 second["growth"], wb["rows"]))
    if not args.skip_reference:
        ref = _in_child(_workbench_pass, str(path), {"WORKBENCH_ANALYSIS_FUSED": "0"})
        r = ref["passes"][0]
        rows.append(("stored_vs_recipes, reference path", r["seconds"], r["cpu_s"], r["growth"],
                     ref["rows"]))
    if not args.skip_naive:
        bc.evict(files)
        nv = _in_child(_naive_pass, str(path))
        rows.append(("naive: load all, decode all, compute", nv["seconds"], nv["cpu_s"],
                     nv["growth"], nv["rows"]))
    print(f"checkpoint: {path} ({len(files)} shards, {size / 1e9:.2f} GB), "
          f"{cfg.layers} layers x {cfg.experts} experts x 3 projections, MXFP4 compressed-tensors")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load avg {load0[0]:.1f} before"
          f" / {os.getloadavg()[0]:.1f} after, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}; cache "
          f"eviction: {method}; Inductor cache: {'empty (--cold-compile)' if args.cold_compile else 'as left by earlier runs'}")
    print(f"{'pass':<52}{'wall s':>8}{'cpu s':>8}{'GB/s':>7}{'vs read':>8}{'mem growth MB':>15}"
          f"{'x proj':>8}{'rows':>7}")
    for what, secs, cpu, grow, nrows in rows:
        cpu_s = f"{cpu:.1f}" if cpu is not None else "-"
        g = f"{grow / 1e6:.0f}" if grow is not None else "-"
        xp = f"{grow / wb['proj_bf16']:.1f}" if grow is not None else "-"
        print(f"{what:<52}{secs:>8.1f}{cpu_s:>8}{size / secs / 1e9:>7.2f}"
              f"{read_s / secs:>8.2f}{g:>15}{xp:>8}{nrows if nrows is not None else '-':>7}")
    if not args.skip_reference:
        print(_compare(ref["experts"], wb["experts"]))
        print(f"scale histograms {'equal' if ref['scales'].equals(wb['scales']) else 'DIFFER'}")
    for label, p in (("compiled (2nd call)", second), ("1st call in a fresh process", first)):
        ok = read_s / p["seconds"] >= 0.5
        print(f"goal: analysis >= 0.5x the plain read rate, {label}: "
              f"{'met' if ok else 'NOT met'} ({read_s / p['seconds']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
