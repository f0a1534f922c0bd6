"""Throughput of the MX reference codecs against torchao's eager functions, same tensors, one run.

Measures encode (``quantize`` vs torchao ``to_mx``), decode (``dequantize`` vs ``to_dtype``) and
fake quantization (both chained) in GB/s of input (bf16 bytes read), on CPU and on a GPU when
one is present, and checks on the way that both produce the same bytes. Exits non-zero when the
reference is slower than torchao eager on CPU for [8, 1024, 2048] bf16 (the codecs' speed goal)
unless ``--no-check``.

    python jobs/bench_formats.py                      # default shapes, CPU (+ GPU if present)
    python jobs/bench_formats.py --shapes 8x1024x2048 --repeats 5 --no-check
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch

from workbench.formats import dequantize, quantize

GOAL_SHAPE = (8, 1024, 2048)
# our profile -> torchao ScaleCalculationMode with the same bytes on bf16 inputs
PROFILE_MODE = {"rceil": "RCEIL", "floor": "FLOOR"}
TORCHAO_ELEM = {"mxfp4": "float4_e2m1fn_x2", "mxfp8_e4m3": "float8_e4m3fn", "mxfp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class BenchConfig:
    shapes: tuple[tuple[int, ...], ...]
    formats: tuple[str, ...]
    profiles: tuple[str, ...]
    repeats: int
    devices: tuple[str, ...]
    check: bool

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        for p in self.profiles:
            if p not in PROFILE_MODE:
                raise ValueError(f"profile {p!r} has no torchao twin; choose from {sorted(PROFILE_MODE)}")
        for f in self.formats:
            if f not in TORCHAO_ELEM:
                raise ValueError(f"format {f!r} is not an MX format; choose from {sorted(TORCHAO_ELEM)}")


@dataclass(frozen=True)
class Row:
    device: str
    shape: tuple[int, ...]
    fmt: str
    profile: str
    op: str
    ours_ms: float
    torchao_ms: float
    gbytes: float
    same_bytes: bool

    @property
    def speedup(self) -> float:
        return self.torchao_ms / self.ours_ms


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _best_ms(fn, device: str, repeats: int) -> float:
    """Fastest of ``repeats`` runs: on a shared machine, interference only ever adds time."""
    fn()  # warm-up (allocator, lazy imports)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def bench_one(x: torch.Tensor, fmt: str, profile: str, repeats: int) -> list[Row]:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    device = str(x.device)
    elem = getattr(torch, TORCHAO_ELEM[fmt])
    mode = getattr(ScaleCalculationMode, PROFILE_MODE[profile])
    gb = x.numel() * x.element_size() / 1e9

    def ao_enc():
        return to_mx(x, elem, 32, mode)

    def ao_dec(s, d):
        return to_dtype(d, s, elem, 32, x.dtype)

    q = quantize(x, fmt, profile)
    s_ao, d_ao = ao_enc()
    same_enc = torch.equal(q.scale, s_ao.view(torch.uint8)) and torch.equal(
        q.data.view(torch.uint8), d_ao.view(torch.uint8)
    )
    same_dec = torch.equal(dequantize(q, x.dtype), ao_dec(s_ao, d_ao))
    rows = []
    for op, ours, theirs, same in (
        ("encode", lambda: quantize(x, fmt, profile), ao_enc, same_enc),
        ("decode", lambda: dequantize(q, x.dtype), lambda: ao_dec(s_ao, d_ao), same_dec),
        ("fake-quant", lambda: dequantize(quantize(x, fmt, profile), x.dtype),
         lambda: ao_dec(*ao_enc()), same_enc and same_dec),
    ):
        rows.append(Row(device, tuple(x.shape), fmt, profile, op,
                        _best_ms(ours, device, repeats), _best_ms(theirs, device, repeats), gb, same))
    return rows


def format_table(rows: list[Row]) -> str:
    head = (f"{'device':6} {'shape':>14} {'format':10} {'profile':7} {'op':10} {'ours ms':>9} "
            f"{'torchao ms':>10} {'ours GB/s':>9} {'ao GB/s':>8} {'speedup':>7} {'bytes':>5}")
    lines = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(map(str, r.shape))
        lines.append(
            f"{r.device[:6]:6} {shape:>14} {r.fmt:10} {r.profile:7} {r.op:10} {r.ours_ms:9.1f} "
            f"{r.torchao_ms:10.1f} {r.gbytes / r.ours_ms * 1e3:9.2f} {r.gbytes / r.torchao_ms * 1e3:8.2f} "
            f"{r.speedup:6.2f}x {'same' if r.same_bytes else 'DIFF':>5}"
        )
    return "\n".join(lines)


def run(cfg: BenchConfig) -> tuple[list[Row], list[str]]:
    from tqdm import tqdm

    jobs = [(d, s, f, p) for d in cfg.devices for s in cfg.shapes for f in cfg.formats for p in cfg.profiles]
    rows: list[Row] = []
    g = torch.Generator().manual_seed(0)
    for device, shape, fmt, profile in tqdm(jobs, desc="bench_formats", unit="case"):
        x = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
        rows += bench_one(x, fmt, profile, cfg.repeats)
    failures = [
        f"{r.fmt}:{r.profile} {r.op} on {r.shape}: reference {r.ours_ms:.1f} ms > torchao {r.torchao_ms:.1f} ms"
        for r in rows
        if r.device == "cpu" and r.shape == GOAL_SHAPE and r.ours_ms > r.torchao_ms
    ]
    failures += [f"{r.fmt}:{r.profile} {r.op} on {r.device} {r.shape}: bytes differ from torchao"
                 for r in rows if not r.same_bytes]
    return rows, failures


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not like 8x1024x2048") from None
    if shape[-1] % 32:
        raise argparse.ArgumentTypeError(f"shape {text!r}: last dim must be a multiple of 32")
    return shape


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", type=_parse_shape,
                    default=[(4096, 4096), GOAL_SHAPE])
    ap.add_argument("--formats", nargs="+", default=list(TORCHAO_ELEM))
    ap.add_argument("--profiles", nargs="+", default=["rceil", "floor"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="'all': CPU, plus the GPU when one is visible")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--no-check", action="store_true",
                    help="always exit 0, even if the reference is slower than torchao on the goal shape")
    a = ap.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    devices = ["cpu"] if a.device in ("cpu", "all") else []
    if a.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append("cuda")
    elif a.device == "cuda":
        ap.error("--device cuda asked for, but no CUDA GPU is visible")
    cfg = BenchConfig(tuple(a.shapes), tuple(a.formats), tuple(a.profiles), a.repeats,
                      tuple(devices), not a.no_check)
    import torchao

    print(f"torch {torch.__version__}, torchao {torchao.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} CPU threads"
          + (f", {torch.cuda.get_device_name()}" if "cuda" in devices else ""))
    rows, failures = run(cfg)
    print(format_table(rows))
    print("speedup = torchao eager time / reference time (>1: reference faster)")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures and cfg.check else 0


if __name__ == "__main__":
    sys.exit(main())
