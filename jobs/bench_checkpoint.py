"""Checkpoint I/O benchmark: decode every routed expert of a multi-GB packed MXFP4 checkpoint.

Builds (once; reused when present) a compressed-tensors `mxfp4-pack-quantized` checkpoint with
synthetic bytes in the real layout -- per-expert `weight_packed` uint8 [out, in/2] and
`weight_scale` uint8 [out, in/32], Qwen3-30B-A3B expert shapes, several shards with a
`model.safetensors.index.json` -- and reports in one table:

- plain sequential read of the shard files (the I/O ceiling), cold and warm page cache;
- `workbench.checkpoint` decode of all experts to BF16 (`expert_weight(...).materialize()`),
  cold and warm, in GB/s of packed input bytes and of BF16 output bytes;
- resident memory while iterating experts (sampled after every expert, in a fresh process):
  peak minus the after-open baseline, as a multiple of one expert projection's BF16 size and of
  one shard. RssAnon is memory the process holds; RssFile is mmap'd page cache (reclaimable).

"Cold" = pages evicted with posix_fadvise(DONTNEED) (and /proc/sys/vm/drop_caches when
writable); the resident fraction is measured with mincore(2) and printed, so the claim is checked.

    python jobs/bench_checkpoint.py                 # ~2 GB in /tmp/wb-bench-ckpt
    python jobs/bench_checkpoint.py --small         # ~60 MB, seconds
    python jobs/bench_checkpoint.py --size-gb 8 --dir /data/bench
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

GB = 1e9
PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class BenchConfig:
    out_dir: Path
    size_gb: float = 2.0
    hidden: int = 2048  # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, 128 experts
    inter: int = 768
    experts: int = 128
    shard_gb: float = 0.5
    seed: int = 0

    def __post_init__(self):
        if self.size_gb <= 0 or self.shard_gb <= 0:
            raise ValueError("size_gb and shard_gb must be positive")
        if self.hidden % 32 or self.inter % 32:
            raise ValueError("hidden and inter must be multiples of the MX block (32)")
        if self.experts < 1:
            raise ValueError("experts must be >= 1")

    @property
    def expert_packed_bytes(self) -> int:
        """weight_packed + weight_scale of gate, up and down for one expert."""
        n = 3 * self.hidden * self.inter
        return n // 2 + n // 32

    @property
    def layers(self) -> int:
        return max(1, round(self.size_gb * GB / (self.experts * self.expert_packed_bytes)))


# -- building the checkpoint -------------------------------------------------------------
def _expert_tensors(cfg: BenchConfig, layer: int, expert: int, gen: torch.Generator):
    shapes = {"gate": (cfg.inter, cfg.hidden), "up": (cfg.inter, cfg.hidden),
              "down": (cfg.hidden, cfg.inter)}
    for proj, (out, inp) in shapes.items():
        base = f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj"
        yield f"{base}.weight_packed", torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8,
                                                     generator=gen)
        # scale bytes 2^-9 .. 2^-1: the range real expert weights land in
        yield f"{base}.weight_scale", torch.randint(118, 127, (out, inp // 32), dtype=torch.uint8,
                                                    generator=gen)


def _config(cfg: BenchConfig) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": cfg.hidden, "moe_intermediate_size": cfg.inter,
        "num_hidden_layers": cfg.layers, "num_experts": cfg.experts, "vocab_size": 256,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp\\.gate$"],
            "config_groups": {"group_0": {
                "format": "mxfp4-pack-quantized", "targets": ["Linear"],
                "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                            "group_size": 32, "symmetric": True, "dynamic": False,
                            "scale_dtype": "torch.uint8"}}},
        },
    }


def build_checkpoint(cfg: BenchConfig) -> Path:
    from safetensors.torch import save_file

    path = cfg.out_dir
    marker = path / "bench.json"
    if marker.exists() and json.loads(marker.read_text()) == _marker(cfg):
        return path
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.safetensors"):
        old.unlink()
    gen = torch.Generator().manual_seed(cfg.seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files = 0, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(shard_files) + 1:05d}.safetensors"
        tmp = path / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / name)  # atomic: a crash never leaves a half shard under its name
        shard_files.append(name)
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    shard["model.embed_tokens.weight"] = torch.zeros(256, cfg.hidden, dtype=torch.bfloat16)
    shard["model.norm.weight"] = torch.ones(cfg.hidden, dtype=torch.bfloat16)
    total = cfg.layers * cfg.experts
    with tqdm(total=total, desc="writing experts", unit="expert") as bar:
        for layer in range(cfg.layers):
            shard[f"model.layers.{layer}.mlp.gate.weight"] = torch.zeros(
                cfg.experts, cfg.hidden, dtype=torch.bfloat16)
            for e in range(cfg.experts):
                for name, t in _expert_tensors(cfg, layer, e, gen):
                    shard[name] = t
                    shard_bytes += t.numel()
                if shard_bytes >= cfg.shard_gb * GB:
                    flush()
                bar.update()
    if shard:
        flush()
    # rename to the HF "-of-N" names only now that N is known
    final = {}
    for i, name in enumerate(shard_files):
        new = f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors"
        os.replace(path / name, path / new)
        final[name] = new
    index = {"metadata": {"total_size": sum((path / n).stat().st_size for n in final.values())},
             "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    _atomic_json(path / "model.safetensors.index.json", index)
    _atomic_json(path / "config.json", _config(cfg))
    _atomic_json(marker, _marker(cfg))
    return path


def _marker(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["out_dir"] = str(d["out_dir"])
    return d


def _atomic_json(path: Path, obj) -> None:
    from workbench._io import atomic_write_json  # the repo's one atomic writer

    atomic_write_json(path, obj, indent=2)


# -- page cache control and measurement ---------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def resident_fraction(files: list[Path]) -> float:
    """Fraction of the files' pages in the page cache: mincore(2) on a fresh read-only mapping
    (mapping does not fault pages in, so measuring does not warm the cache)."""
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for f in files:
        size = f.stat().st_size
        if size == 0:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                if _libc.mincore(addr, size, vec) != 0:
                    return float("nan")
                resident += sum(b & 1 for b in bytes(vec))
                total += n
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else float("nan")


def evict(files: list[Path]) -> str:
    methods = []
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        methods.append("drop_caches")
    except OSError:
        pass
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a freshly written shard) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    methods.append("fadvise")
    return "+".join(methods)


def sequential_read(files: list[Path], desc: str) -> tuple[int, float]:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = sum(f.stat().st_size for f in files)
    done = 0
    t0 = time.perf_counter()
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True) as bar:
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(view):
                    done += n
                    bar.update(n)
    return done, time.perf_counter() - t0


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


PASSES = (("raw", "cold"), ("raw", "warm"), ("decode", "cold"), ("decode", "warm"))


def _decode_child(path: str, files: list[str], conn) -> None:
    """Runs in a fresh process so its memory numbers are about reading/decoding only.

    "raw" passes read every expert's packed bytes and scales through the workbench index
    (`view.raw()`, no decode); "decode" passes materialize BF16. The difference is the codec.
    """
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    from workbench.checkpoint import open_checkpoint

    result = {}
    for kind, cache in PASSES:
        if cache == "cold":
            result[f"evict-{kind}"] = evict([Path(f) for f in files])
            result[f"resident-{kind}"] = resident_fraction([Path(f) for f in files])
        t0 = time.perf_counter()
        ck = open_checkpoint(path)
        t_open = time.perf_counter() - t0
        records = list(ck.experts())
        base = _status()
        peak = dict(base)
        out_bytes = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for r in tqdm(records, desc=f"{kind} {cache}", unit="proj"):
            view = ck.expert_weight(r.layer, r.expert, r.proj)
            if kind == "raw":
                parts = view.raw()
                out_bytes += sum(t.numel() * t.element_size() for t in parts.values())
                del parts
            else:
                w = view.materialize()
                out_bytes += w.numel() * w.element_size()
                del w
            now = _status()
            for k in ("VmRSS", "RssAnon", "RssFile"):
                peak[k] = max(peak[k], now[k])
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = getattr(getattr(ck, "index", None), "stats", None)
        result[f"{kind}-{cache}"] = {
            "open_s": t_open, "seconds": dt, "cpu_s": cpu, "records": len(records),
            "out_bytes": out_bytes,
            "in_bytes": stats.bytes_read if stats is not None else float("nan"),
            "base": base, "peak": peak,
            "max_proj_bf16": max(2 * r.shape[0] * r.shape[1] for r in records),
            "expert_bf16": sum(2 * r.shape[0] * r.shape[1] for r in records
                               if (r.layer, r.expert) == (records[0].layer, records[0].expert)),
        }
        if hasattr(ck, "close"):
            ck.close()
        del ck
    conn.send(result)
    conn.close()


def run(cfg: BenchConfig) -> str:
    path = build_checkpoint(cfg)
    files = sorted(path.glob("*.safetensors"))
    on_disk = sum(f.stat().st_size for f in files)

    method = evict(files)
    cold_res = resident_fraction(files)
    c0 = time.process_time()
    cold_b, cold_s = sequential_read(files, "read cold")
    c1 = time.process_time()
    warm_res = resident_fraction(files)
    warm_b, warm_s = sequential_read(files, "read warm")
    cold_cpu, warm_cpu = c1 - c0, time.process_time() - c1

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_decode_child, args=(str(path), [str(f) for f in files], child))
    proc.start()
    dec = parent.recv()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"decode process failed with exit code {proc.exitcode}")

    shard = max(f.stat().st_size for f in files)
    head = (f"checkpoint: {path}  {len(files)} shards, {on_disk / GB:.2f} GB on disk, "
            f"{cfg.layers} layers x {cfg.experts} experts x 3 proj (hidden {cfg.hidden}, "
            f"moe_inter {cfg.inter}), MXFP4 compressed-tensors layout")
    machine = (f"machine: {platform.machine()}, {os.cpu_count()} cores, load avg "
               f"{os.getloadavg()[0]:.1f}, torch {torch.__version__} "
               f"({torch.get_num_threads()} threads), python {platform.python_version()}; "
               f"eviction: {method}")
    seq_cpu = {"cold": cold_cpu, "warm": warm_cpu}
    rows = [("sequential read (16 MiB readinto)", "cold", f"{cold_res:.0%}", cold_s,
             seq_cpu["cold"], cold_b, None),
            ("sequential read (16 MiB readinto)", "warm", f"{warm_res:.0%}", warm_s,
             seq_cpu["warm"], warm_b, None)]
    labels = {"raw": "workbench raw() packed+scales", "decode": "workbench decode -> BF16"}
    for kind, cache in PASSES:
        d = dec[f"{kind}-{cache}"]
        res = f"{dec[f'resident-{kind}']:.0%}" if cache == "cold" else "-"
        rows.append((labels[kind], cache, res, d["seconds"], d["cpu_s"], d["in_bytes"],
                     d["out_bytes"] if kind == "decode" else None))
    lines = [head, machine, "",
             (f"{'what':<34}{'cache':>6}{'resident':>9}{'wall s':>8}{'cpu s':>7}"
             f"{'in MB/s':>9}{'out MB/s':>9}{'in MB/cpu-s':>12}")]
    for what, cache, res, sec, cpu, nin, nout in rows:
        out = "" if nout is None else f"{nout / sec / 1e6:.1f}"
        lines.append(f"{what:<34}{cache:>6}{res:>9}{sec:>8.2f}{cpu:>7.2f}"
                     f"{nin / sec / 1e6:>9.1f}{out:>9}{nin / max(cpu, 1e-9) / 1e6:>12.1f}")
    unit = dec["decode-warm"]["expert_bf16"]
    proj = dec["decode-warm"]["max_proj_bf16"]
    lines += ["", (f"memory while iterating {dec['decode-warm']['records']} expert projections "
                   f"(one expert = 3 projections = {unit / 1e6:.1f} MB BF16, largest projection "
                   f"{proj / 1e6:.1f} MB, one shard = {shard / 1e6:.0f} MB):"),
              (f"{'pass':<13}{'':<9}{'after open MB':>14}{'peak MB':>9}{'growth MB':>11}"
              f"{'x expert':>9}{'x shard':>9}")]
    for kind, cache in PASSES:
        d, phase = dec[f"{kind}-{cache}"], f"{kind} {cache}"
        for key in ("RssAnon", "RssFile", "VmRSS"):
            grow = d["peak"][key] - d["base"][key]
            lines.append(f"{phase:<13}{key:<9}{d['base'][key] / 1e6:>14.0f}"
                         f"{d['peak'][key] / 1e6:>9.0f}{grow / 1e6:>11.1f}"
                         f"{grow / unit:>9.2f}{grow / shard:>9.3f}")
    lines.append(f"open (headers + validation): cold {dec['raw-cold']['open_s']:.2f} s, "
                 f"warm {dec['decode-warm']['open_s']:.2f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/wb-bench-ckpt"))
    ap.add_argument("--size-gb", type=float, default=2.0, help="packed expert bytes to write")
    ap.add_argument("--shard-gb", type=float, default=0.5)
    ap.add_argument("--small", action="store_true", help="about 60 MB, for a quick check")
    args = ap.parse_args(argv)
    if args.small:
        cfg = BenchConfig(args.dir / "small", size_gb=0.06, hidden=1024, inter=512, experts=16,
                          shard_gb=0.02)
    else:
        cfg = BenchConfig(args.dir / f"{args.size_gb:g}gb", size_gb=args.size_gb,
                          shard_gb=args.shard_gb)
    print(run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
