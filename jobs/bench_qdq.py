"""Benchmark: fake quantization (quantize-dequantize, bf16 in, bf16 out) against the copy limit.

    python jobs/bench_qdq.py                       # GPU: every row below, printed as one table
    python jobs/bench_qdq.py --shapes 8x4096x6144 --formats mxfp4

Rows per (shape, format): device copy (read + write the tensor once: the memory-bound floor of
a one-pass fake quant), torchao 0.18 QDQ eager and under torch.compile, the workbench reference
codec under torch.compile, and the Triton kernel (workbench.kernels). Columns: median ms
(triton.testing.do_bench), GB/s counting one bf16 read and one bf16 write, fraction of the copy
rate, speedup over torchao compiled. NVFP4 rows include the global-amax pass (one more read),
except "amax given"; the "per-expert" row takes one global per leading index (the QAT weight
path, ``kernels.fake_quantize_experts``: an amax pass, then the quantize pass).
"""

from __future__ import annotations

import argparse
import functools
import os

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import torch

FORMATS = ("mxfp4", "mxfp8_e4m3", "nvfp4")


def _torchao_qdq(fmt: str):
    """torchao's own QDQ for a format (None when torchao is missing)."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    except ImportError:
        return None
    if fmt == "nvfp4":
        def qdq(x):
            pts = per_tensor_amax_to_scale(x.abs().amax().float())
            scale, data = nvfp4_quantize(x, 16, pts)
            t = NVFP4Tensor(data, scale, 16, x.dtype, per_tensor_scale=pts)
            return t.dequantize(x.dtype)
        return qdq
    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn}[fmt]

    def qdq(x):
        scale, data = to_mx(x, elem, 32, ScaleCalculationMode.RCEIL)
        return to_dtype(data, scale, elem, 32, x.dtype)
    return qdq


def _bench(fn, x) -> float | None:
    import triton.testing

    try:
        fn(x)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, not fatal
        print(f"    ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None
    return triton.testing.do_bench(lambda: fn(x), warmup=25, rep=100, return_mode="median")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 8 large experts (48 MB each); Qwen3-30B-A3B's 128 experts (3 MB each); K3-like layer experts (22 MB);
    # 16 DeepSeek-V3-sized experts (29 MB)
    ap.add_argument("--shapes", default="8x4096x6144,128x768x2048,8x3072x3584,16x2048x7168")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--all-rows", action="store_true",
                    help="torchao eager and the compiled rows on every shape (default: the first "
                         "shape only; each compile costs tens of seconds)")
    ap.add_argument("--sweep", action="store_true",
                    help="first shape: NVFP4 (amax given) tiles x warps, to tune the launch")
    ap.add_argument("--ncu-target", action="store_true",
                    help="run each Triton fake quant of the first shape 3 times, untimed (for "
                         "ncu --kernel-name ... to profile)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_qdq needs a CUDA GPU (the kernels' CPU mode is the interpreter)")
    import triton

    try:
        import torchao
        ao_ver = torchao.__version__
    except ImportError:
        ao_ver = "missing"
    if args.ncu_target:
        return _ncu_target(args.shapes.split(",")[0], args.formats.split(","))
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} "
          f"triton={triton.__version__} torchao={ao_ver}")
    print(f"{'shape':<16}{'format':<12}{'impl':<22}{'ms':>9}{'GB/s':>9}{'of copy':>9}"
          f"{'vs ao.c':>9}")
    for si, text in enumerate(args.shapes.split(",")):
        _shape_rows(text, args.formats.split(","), full=si == 0 or args.all_rows,
                    compile_rows=not args.no_compile, sweep=args.sweep and si == 0)
        torch.cuda.empty_cache()


def _shape_rows(text: str, formats: list[str], *, full: bool, compile_rows: bool,
                sweep: bool) -> None:
    """Every row of one shape; ``full`` adds torchao eager and the compiled rows."""
    from workbench import formats as F
    from workbench import kernels as K

    shape = tuple(int(s) for s in text.split("x"))
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * x.numel() * x.element_size()
    out = torch.empty_like(x)
    copy_ms = _bench(out.copy_, x)

    def row(fmt, name, ms, ao_c=None):
        if ms is None:
            print(f"{text:<16}{fmt:<12}{name:<22}{'n/a':>9}")
            return
        gbs = nbytes / ms / 1e6
        rel = f"{copy_ms / ms:.0%}"
        sp = f"{ao_c / ms:.2f}x" if ao_c else "-"
        print(f"{text:<16}{fmt:<12}{name:<22}{ms:>9.3f}{gbs:>9.0f}{rel:>9}{sp:>9}", flush=True)

    row("-", "copy", copy_ms)
    for fmt in formats:
        ao = _torchao_qdq(fmt)
        ao_c_ms = None
        if ao is not None and full:
            row(fmt, "torchao eager", _bench(ao, x))
            if compile_rows:
                ao_c_ms = _bench(torch.compile(ao), x)
                row(fmt, "torchao compiled", ao_c_ms)
        if compile_rows and full:
            ref = torch.compile(functools.partial(F.fake_quantize, fmt=fmt))
            row(fmt, "reference compiled", _bench(ref, x), ao_c_ms)
        row(fmt, "triton (workbench)",
            _bench(functools.partial(K.fake_quantize, fmt=fmt), x), ao_c_ms)
        if fmt == "nvfp4":
            amax = x.abs().amax().float()
            fq = functools.partial(K.fake_quantize, fmt="nvfp4", global_amax=amax)
            row(fmt, "triton, amax given", _bench(fq, x), ao_c_ms)
            # the QAT weight path: one global per expert (leading index)
            fqe = functools.partial(K.fake_quantize_experts, fmt="nvfp4")
            row(fmt, "per-expert", _bench(fqe, x), ao_c_ms)
            if sweep:
                _sweep_rows(x, amax, row, ao_c_ms)


def _sweep_rows(x, amax, row, ao_c_ms) -> None:
    """The one-pass NVFP4 kernel (amax given) over tile sizes and warps per program."""
    from workbench import kernels as K
    from workbench.formats import parse_recipe

    recipe = parse_recipe("nvfp4")
    for nb in (64, 128, 256):
        for warps in (2, 4, 8):
            handle = []

            def fq(t, nb=nb, warps=warps, handle=handle):
                out = torch.empty_like(t)
                # the library's private launcher: the same kernel with another tile
                handle[:] = [K.api._launch_nvfp4(t, out, t, amax.reshape(1), recipe, True,
                                                 nb=nb, num_warps=warps)]
                return out
            ms = _bench(fq, x)
            regs = f" r{handle[0].n_regs}s{handle[0].n_spills}" if handle else ""
            row("nvfp4", f"NB{nb} w{warps}{regs}", ms, ao_c_ms)


def _ncu_target(text: str, formats: list[str]) -> None:
    """Each kernel launch of the timed rows, a few times, for a profiler to pick up."""
    from workbench import kernels as K

    x = torch.randn(tuple(int(s) for s in text.split("x")), device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        for fmt in formats:
            K.fake_quantize(x, fmt)
            if fmt == "nvfp4":
                K.fake_quantize(x, fmt, global_amax=x.abs().amax().float())
                K.fake_quantize_experts(x, fmt)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
