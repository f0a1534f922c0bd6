"""Analysis benchmark: the three table questions on MXFP4, NVFP4 and MXFP8 checkpoints, each
against the plain sequential read of the same files, measured in the same run.

For each format a packed checkpoint of Qwen3-30B-A3B expert shapes (hidden 2048, moe FFN 768,
128 experts per layer; ``--size-gb 15`` is the real model: 48 layers for MXFP4) is written with
random codes and realistic scale bytes (large random pools sliced per tensor, so 15 GB take
seconds to write), in the layout each format ships in: compressed-tensors MXFP4 and NVFP4
(``weight_packed``/``weight_scale``/``weight_global_scale``), ModelOpt MXFP8 (float8 ``weight`` +
E8M0 ``weight_scale``). Question 2 needs a BF16 reference, 2-4x the packed size, so it runs on a
smaller pair (the first layers, packed + BF16, ``--ref-gb`` of BF16). Each pass runs with a cold
page cache (pages evicted):

- ``read``: plain sequential read of the shard files (16 MiB ``readinto``), the I/O ceiling;
- per question, the default path (``path="auto"``: batched on CUDA, batched or fused on CPU) in
  a fresh process: the first call (imports, any compile included) and a second call;
- with ``--reference``, the reference path once, and the fast table compared with it (counts and
  histograms equal? largest relative difference of the float-sum metrics);
- with ``--readers preadv,window`` (or any of safetensors, preadv, window), each question's
  default path once per stack reader (the plan's ``reader``, in a fresh process each), so the
  old reader is the new one's baseline in the same run, and the tables are compared.

Each fresh process holds one ``analysis.Session`` for its calls, as a notebook does: the second
call finds the graphs the first compiled.

Throughput is GB/s of the files the question reads; ``vs read`` is the read time over the pass
time; memory is peak anonymous RSS growth during the pass (and peak CUDA memory), also as a
multiple of one expert projection's BF16 size.

    python jobs/bench_analysis.py --size-gb 0.1 --reference     # CPU, a minute or two
    python jobs/bench_analysis.py --size-gb 15 --cleanup         # GPU host (see docs/analysis.md)
    python jobs/bench_analysis.py --size-gb 15 --cleanup --formats mxfp4 \
        --questions stored_vs_recipes,candidate_errors --readers preadv,window
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# the repository's workbench, for this process and its spawned children (which run this file
# again as their main module), whether or not it is installed
sys.path.insert(0, str(HERE.parent))
GB = 1e9
PROJS = ("gate", "up", "down")
FORMATS = ("mxfp4", "nvfp4", "mxfp8_e4m3")
QUESTIONS = ("stored_vs_recipes", "candidate_errors", "reference_errors")
RECIPES = {"mxfp4": ["mxfp4:rceil"], "nvfp4": ["nvfp4:torchao"], "mxfp8_e4m3": ["mxfp8_e4m3:rceil"]}


def _bench_checkpoint():
    spec = importlib.util.spec_from_file_location("bench_checkpoint", HERE / "bench_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_checkpoint"] = mod
    spec.loader.exec_module(mod)
    return mod


# -- checkpoints ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    inter: int = 768
    experts: int = 128
    shard_gb: float = 1.0


def _bytes_per_expert(fmt: str, s: Shape) -> int:
    n = 3 * s.hidden * s.inter
    return {"mxfp4": n // 2 + n // 32, "nvfp4": n // 2 + n // 16 + 12,
            "mxfp8_e4m3": n + n // 32, "bf16": 2 * n}[fmt]


def layers_for(fmt: str, size_gb: float, s: Shape) -> int:
    return max(1, round(size_gb * GB / (s.experts * _bytes_per_expert(fmt, s))))


class _Pool:
    """Random bytes to slice tensors from: one large draw, a random offset per tensor (copied,
    since safetensors refuses tensors that share memory)."""

    def __init__(self, n: int, gen: torch.Generator, make):
        self.buf, self.gen = make(n, gen), gen

    def take(self, shape) -> torch.Tensor:
        """A view (no copy): ``_write_safetensors`` streams views straight to the file."""
        n = math.prod(shape)
        off = int(torch.randint(0, self.buf.numel() - n + 1, (1,), generator=self.gen))
        return self.buf[off:off + n].reshape(shape)


_ST_DTYPE = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16",
             torch.float32: "F32"}


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format written directly (8-byte header length, JSON header, raw bytes),
    so tensors may be views of one random pool (``save_file`` refuses shared storage and would
    copy); atomic via a temporary name."""
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for t in tensors.values():
            fh.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
    os.replace(tmp, path)


def _pools(fmt: str, gen: torch.Generator, n: int) -> dict:
    u8 = {"dtype": torch.uint8}
    pools = {}
    if fmt in ("mxfp4", "nvfp4"):
        pools["data"] = _Pool(n, gen, lambda k, g: torch.randint(0, 256, (k,), generator=g, **u8))
    if fmt == "mxfp8_e4m3":
        def fp8(k, g):  # every finite E4M3 byte (0x7F / 0xFF are NaN)
            b = torch.randint(0, 256, (k,), generator=g, **u8)
            return torch.where((b & 0x7F) == 0x7F, b - 1, b).view(torch.float8_e4m3fn)
        pools["data"] = _Pool(n, gen, fp8)
    if fmt in ("mxfp4", "mxfp8_e4m3"):  # E8M0 bytes 2^-9 .. 2^-1, where real weights land
        pools["scale"] = _Pool(n // 16, gen, lambda k, g: torch.randint(118, 127, (k,),
                                                                         generator=g, **u8))
    if fmt == "nvfp4":  # positive E4M3 scales 2^-3 .. 2^3
        pools["scale"] = _Pool(n // 8, gen, lambda k, g: torch.randint(
            0x28, 0x48, (k,), generator=g, **u8).view(torch.float8_e4m3fn))
    if fmt == "bf16":
        pools["data"] = _Pool(n, gen, lambda k, g: (torch.randn(k, generator=g) * 0.02).bfloat16())
    return pools


def _tensors(fmt: str, pools: dict, base: str, out: int, inp: int, gen) -> dict:
    if fmt == "mxfp4":
        return {f"{base}.weight_packed": pools["data"].take((out, inp // 2)),
                f"{base}.weight_scale": pools["scale"].take((out, inp // 32))}
    if fmt == "nvfp4":
        # compressed-tensors stores 2688/amax; amax ~ 0.1
        return {f"{base}.weight_packed": pools["data"].take((out, inp // 2)),
                f"{base}.weight_scale": pools["scale"].take((out, inp // 16)),
                f"{base}.weight_global_scale": 2688 / (0.05 + 0.1 * torch.rand(1, generator=gen))}
    if fmt == "mxfp8_e4m3":
        return {f"{base}.weight": pools["data"].take((out, inp)),
                f"{base}.weight_scale": pools["scale"].take((out, inp // 32))}
    return {f"{base}.weight": pools["data"].take((out, inp))}


def _quant_config(fmt: str) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json) of the format's layout."""
    ignore = ["lm_head", "re:.*mlp\\.gate$"]
    if fmt in ("mxfp4", "nvfp4"):
        ct = "mxfp4-pack-quantized" if fmt == "mxfp4" else "nvfp4-pack-quantized"
        w = {"num_bits": 4, "type": "float", "symmetric": True, "dynamic": False}
        w.update({"strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}
                 if fmt == "mxfp4" else {"strategy": "tensor_group", "group_size": 16,
                                         "scale_dtype": "torch.float8_e4m3fn"})
        return {"quant_method": "compressed-tensors", "format": ct,
                "quantization_status": "compressed", "ignore": ignore,
                "config_groups": {"group_0": {"format": ct, "targets": ["Linear"],
                                              "input_activations": None,
                                              "output_activations": None, "weights": w}}}, None
    if fmt == "mxfp8_e4m3":
        excl = ["lm_head", "model.layers.*.mlp.gate"]
        return ({"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": excl},
                {"producer": {"name": "modelopt", "version": "0.47.0"},
                 "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                                  "group_size": 32, "exclude_modules": excl}})
    return None, None


def build(fmt: str, path: Path, layers: int, s: Shape, seed: int = 0) -> Path:
    """Write (once; reused when its marker matches) a ``layers``-layer checkpoint of ``fmt``."""
    from tqdm import tqdm

    marker = {"fmt": fmt, "layers": layers, **asdict(s), "seed": seed, "v": 1}
    if (path / "bench.json").exists() and json.loads((path / "bench.json").read_text()) == marker:
        return path
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    pools = _pools(fmt, gen, 1 << 26)
    shard, size, files, wmap = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        _write_safetensors(path / name, shard)
        files.append(name)
        wmap.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    shapes = {"gate": (s.inter, s.hidden), "up": (s.inter, s.hidden), "down": (s.hidden, s.inter)}
    with tqdm(total=layers * s.experts, desc=f"writing {fmt} ({layers} layers)", unit="expert") as bar:
        for L in range(layers):
            shard[f"model.layers.{L}.mlp.gate.weight"] = torch.zeros(s.experts, s.hidden,
                                                                     dtype=torch.bfloat16)
            for e in range(s.experts):
                for p in PROJS:
                    ts = _tensors(fmt, pools, f"model.layers.{L}.mlp.experts.{e}.{p}_proj",
                                  *shapes[p], gen)
                    shard.update(ts)
                    size += sum(t.numel() * t.element_size() for t in ts.values())
                if size >= s.shard_gb * GB:
                    flush()
                bar.update()
    if shard:
        flush()
    index = {"metadata": {"total_size": sum((path / f).stat().st_size for f in files)},
             "weight_map": dict(sorted(wmap.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    qc, hfq = _quant_config(fmt)
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "hidden_size": s.hidden, "moe_intermediate_size": s.inter,
           "num_hidden_layers": layers, "num_experts": s.experts, "vocab_size": 256}
    if qc is not None:
        cfg["quantization_config"] = qc
    (path / "config.json").write_text(json.dumps(cfg))
    if hfq is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hfq))
    (path / "bench.json").write_text(json.dumps(marker))
    return path


def shard_files(*paths: Path) -> list[Path]:
    return [f for p in paths for f in sorted(p.glob("*.safetensors"))]


# -- measuring --------------------------------------------------------------------------------


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


def _call(question: str, ck, ref, fmt: str, path: str, device: str | None,
          reader: str | None = None, session=None):
    """One table call: the plan of ``path`` (and ``reader``, default "auto") built as the table
    function builds it, then run with the caller's ``session``."""
    from workbench import analysis

    other = ref if question == "reference_errors" else RECIPES[fmt]
    kinds = {"kinds": ("routed",)} if question == "reference_errors" else {}
    plan = analysis.plan(question, ck, other, path=path, device=device, reader=reader or "auto",
                         session=session, **kinds)
    return getattr(analysis, question)(ck, other, plan=plan, session=session, progress=False,
                                       **kinds)


def _child(conn, question: str, fmt: str, ck_path: str, ref_path: str | None, path: str,
           calls: int, device: str | None, reader: str | None = None) -> None:
    """``calls`` calls of one question in this fresh process, each with a cold page cache, all
    in one analysis session."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    import logging

    from workbench.analysis import Session
    from workbench.checkpoint import open_checkpoint

    session = Session()
    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    bc = _bench_checkpoint()
    files = shard_files(Path(ck_path), *([Path(ref_path)] if ref_path else []))
    cuda = torch.cuda.is_available() and device != "cpu"
    out = {"passes": []}
    ck = ref = t = None
    for _ in range(calls):
        # the last call's checkpoints go first: their safetensors handles map the shards, and
        # mapped pages survive drop_caches and fadvise (a second call then reads from memory)
        if ck is not None:
            for c in (ck, ref):
                if c is not None:
                    c.index.close()
            ck = ref = None
            gc.collect()
        bc.evict(files)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with PeakAnon() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            ck = open_checkpoint(ck_path)
            ref = open_checkpoint(ref_path) if ref_path else None
            t = _call(question, ck, ref, fmt, path, device, reader, session)
            if cuda:
                torch.cuda.synchronize()
            secs, cpu = time.perf_counter() - t0, time.process_time() - c0
        out["passes"].append({"seconds": secs, "cpu_s": cpu, "growth": mem.peak - mem.base,
                              "cuda_peak": torch.cuda.max_memory_allocated() if cuda else 0})
    out.update(rows=len(t.experts), experts=t.experts, scales=t.scales)
    conn.send(out)


def _in_child(*args) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, *args))
    p.start()
    # the child's end closed here, so a child that dies before sending (an import error, a
    # crash, the OOM killer) makes recv raise EOFError instead of waiting for ever
    child.close()
    try:
        out = parent.recv()
    except EOFError:
        out = None
    p.join()
    if p.exitcode or out is None:
        raise RuntimeError(f"benchmark child {args[:2]} failed with exit code {p.exitcode}")
    return out


def compare(a, b) -> str:
    """How table ``b`` differs from the reference table ``a``: 'equal' (counts, maxima,
    histograms) plus the largest relative difference of the float-sum metrics."""
    if list(a.columns) != list(b.columns) or len(a) != len(b):
        return "DIFFER (shape)"
    exact = [c for c in a.columns if c not in ("rel_err", "sqnr_db", "cosine")]
    same = all(a[c].fillna(-1).tolist() == b[c].fillna(-1).tolist() for c in exact)
    worst = 0.0
    for c in ("rel_err", "sqnr_db", "cosine"):
        for x, y in zip(a[c], b[c]):
            if x != y:
                worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
    return f"{'equal' if same else 'DIFFER'} (sums {worst:.0e})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wb-bench-analysis"))
    ap.add_argument("--size-gb", type=float, default=1.0, help="packed GB per format")
    ap.add_argument("--ref-gb", type=float, default=None,
                    help="BF16 GB of question 2's reference (default: min(size, 4))")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--questions", default=",".join(QUESTIONS))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    ap.add_argument("--reference", action="store_true", help="also time the reference path "
                    "and compare tables (slow: ~30 ns per element on CPU)")
    ap.add_argument("--small-shape", action="store_true",
                    help="hidden 512, FFN 256, 16 experts (quick CPU runs)")
    ap.add_argument("--experts", type=int, default=None,
                    help="experts per layer (default 128; fewer for quick CPU runs)")
    ap.add_argument("--cleanup", action="store_true", help="delete each format's files after it")
    ap.add_argument("--readers", default=None,
                    help="comma-separated stack readers to time side by side (safetensors, "
                    "preadv, window); default: the library's default only")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT")
                    else None, help="also write the table here (default: $OUT when set)")
    args = ap.parse_args(argv)
    shape = Shape(512, 256, 16, 0.25) if args.small_shape else Shape()
    if args.experts:
        shape = Shape(shape.hidden, shape.inter, args.experts, shape.shard_gb)
    fmts = [f for f in args.formats.split(",") if f]
    qs = [q for q in args.questions.split(",") if q]
    bad = [f for f in fmts if f not in FORMATS] + [q for q in qs if q not in QUESTIONS]
    if bad:
        ap.error(f"unknown formats/questions {bad}; choose from {FORMATS} and {QUESTIONS}")
    readers = [r for r in (args.readers or "").split(",") if r] or [None]
    if any(r not in (None, "safetensors", "preadv", "window") for r in readers):
        ap.error(f"unknown readers {readers}; choose from safetensors, preadv, window")
    bc = _bench_checkpoint()
    load0 = os.getloadavg()
    ref_gb = args.ref_gb if args.ref_gb is not None else min(args.size_gb, 4.0)
    proj_bf16 = shape.inter * shape.hidden * 2
    rows, notes = [], []
    summary = {}  # the goal's view: (question [reader], format) -> (second call vs read, growth)
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def emit(final: bool) -> None:
        """The table so far (after every format, so a time limit still leaves a table)."""
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        lines = [(f"machine: {platform.machine()}, {os.cpu_count()} cores, {gpu}, analysis on "
                  f"{dev_name}; load avg {load0[0]:.1f} before / {os.getloadavg()[0]:.1f} after; "
                  f"torch {torch.__version__}, python {platform.python_version()}"),
                 (f"shape: hidden {shape.hidden}, moe FFN {shape.inter}, {shape.experts} "
                  f"experts/layer; command: {' '.join(sys.argv)}"), *notes,
                 ("| format | question | path | wall s | cpu s | GB/s | vs read | host mem MB "
                  "(x proj) | GPU peak MB | vs reference |"), "|" + "---|" * 10]
        for fmt, q, path, secs, cpu, size, read_s, grow, cuda, cmp in rows:
            mem = "-" if grow is None else f"{grow / 1e6:.0f} ({grow / proj_bf16:.1f})"
            lines.append(f"| {fmt} | {q} | {path} | {secs:.1f} | "
                         f"{'-' if cpu is None else f'{cpu:.1f}'} | {size / secs / GB:.2f} | "
                         f"{read_s / secs:.2f} | {mem} | "
                         f"{'-' if not cuda else f'{cuda / 1e6:.0f}'} | {cmp} |")
        if summary:  # question x format, the second call (warm process) against the read
            sq = [q + ("" if r is None else f" [{r}]") for q in qs for r in readers]
            sf = [f for f in fmts if any((q, f) in summary for q in sq)]
            lines += ["", "second call vs the plain read (host memory growth, MB):",
                      "| question | " + " | ".join(sf) + " |", "|---" * (len(sf) + 1) + "|"]
            for q in sq:
                cells = [f"{summary[q, f][0]:.2f}x ({summary[q, f][1] / 1e6:.0f} MB)"
                         if (q, f) in summary else "-" for f in sf]
                lines.append(f"| {q} | " + " | ".join(cells) + " |")
        text = "\n".join(lines)
        if final:
            print(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "bench_analysis.md").write_text(text + "\n")

    for fmt in fmts:
        runs = []
        if any(q != "reference_errors" for q in qs):
            L = layers_for(fmt, args.size_gb, shape)
            runs.append(("main", build(fmt, args.dir / f"{fmt}-{L}L", L, shape), None,
                         [q for q in qs if q != "reference_errors"]))
        if "reference_errors" in qs:
            L2 = layers_for("bf16", ref_gb, shape)
            runs.append(("ref", build(fmt, args.dir / f"{fmt}-{L2}L", L2, shape),
                         build("bf16", args.dir / f"bf16-{L2}L", L2, shape),
                         ["reference_errors"]))
        for _, ck_path, ref_path, questions in runs:
            files = shard_files(ck_path, *([ref_path] if ref_path else []))
            size = sum(f.stat().st_size for f in files)
            method = bc.evict(files)
            _, read_s = bc.sequential_read(files, f"read {fmt}")
            rows.append((fmt, "plain sequential read", "", read_s, None, size, read_s, None, None,
                         ""))
            for q in questions:
                first = None
                for reader in readers:
                    fast = _in_child(q, fmt, str(ck_path), str(ref_path) if ref_path else None,
                                     "auto", 2, args.device, reader)
                    cmp = ""
                    if first is None:
                        first = fast
                    else:  # another reader: the same table?
                        cmp = compare(first["experts"], fast["experts"]) + (
                            "" if first["scales"].equals(fast["scales"]) else " HIST DIFFER") + \
                            f" vs {readers[0]}"
                    if args.reference and first is fast:
                        ref = _in_child(q, fmt, str(ck_path), str(ref_path) if ref_path else None,
                                        "reference", 1, args.device)
                        cmp = compare(ref["experts"], fast["experts"])
                        cmp += "" if ref["scales"].equals(fast["scales"]) else " HIST DIFFER"
                        r = ref["passes"][0]
                        rows.append((fmt, q, "reference", r["seconds"], r["cpu_s"], size, read_s,
                                     r["growth"], r["cuda_peak"], ""))
                    label = "auto" if reader is None else f"auto [{reader}]"
                    for i, p in enumerate(fast["passes"]):
                        rows.append((fmt, q, f"{label}, call {i + 1}", p["seconds"], p["cpu_s"],
                                     size, read_s, p["growth"], p["cuda_peak"], cmp if i else ""))
                    if len(fast["passes"]) > 1:
                        key = q + ("" if reader is None else f" [{reader}]")
                        summary[key, fmt] = (read_s / fast["passes"][1]["seconds"],
                                             fast["passes"][1]["growth"])
            notes.append(f"{fmt}: {ck_path.name}{' + ' + ref_path.name if ref_path else ''}: "
                         f"{len(files)} shards, {size / GB:.2f} GB; eviction {method}")
        if args.cleanup:
            for _, ck_path, ref_path, _ in runs:
                shutil.rmtree(ck_path, ignore_errors=True)
                if ref_path:
                    shutil.rmtree(ref_path, ignore_errors=True)
        emit(final=False)
    emit(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
