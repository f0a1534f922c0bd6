"""Host side of the Triton codecs: which recipes they serve, launches, ``QuantizedTensor`` output.

``quantize`` / ``fake_quantize`` here take the same arguments as ``workbench.formats`` and return
the same bits (tests/kernels compares them with ``rtol=0, atol=0``) for the recipes in
``SUPPORTED``; anything else raises ``NotImplementedError`` so callers fall back to the reference.
Inputs: contiguous or not (copied), bf16 / fp16 / fp32, any shape whose last dim is a multiple
of the block (NVFP4 ``global_amax`` scalar or one per leading index, as the reference).
"""

from __future__ import annotations

import functools
import os
import struct

import torch

from workbench.formats import QuantizedTensor, format_spec, parse_recipe
from workbench.formats.mx_profiles import PROFILES as MX_PROFILES
from workbench.formats.mx_profiles import cached_lut
from workbench.formats.nvfp4 import from_library_global
from workbench.formats.nvfp4_profiles import get_profile

_MX_RULES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}
SUPPORTED: dict[str, tuple[str, ...]] = {
    "mxfp4": tuple(_MX_RULES),
    "mxfp8_e4m3": tuple(_MX_RULES),
    "mxfp8_e5m2": tuple(_MX_RULES),
    "nvfp4": ("torchao", "te"),
}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class TritonUnavailable(ImportError):
    pass


@functools.lru_cache(maxsize=1)
def _triton():
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TritonUnavailable(
            "workbench.kernels needs Triton: pip install 'workbench[gpu]'") from exc
    from . import _mx_kernel, _nvfp4_kernel

    return _mx_kernel, _nvfp4_kernel


def available() -> bool:
    """Triton imports (the kernels also need CUDA tensors unless TRITON_INTERPRET=1)."""
    try:
        _triton()
    except TritonUnavailable:
        return False
    return True


def supports(fmt, profile=None) -> bool:
    r = parse_recipe(fmt, profile)
    return r.profile in SUPPORTED.get(r.fmt, ())


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _require_device(t: torch.Tensor) -> None:
    """The one rule of where a kernel runs: CUDA tensors, or any under the interpreter."""
    if not (t.is_cuda or _interpret()):
        raise ValueError("Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")


# The interpreter costs ~5 ms per program: few, big programs (tests lower this to get tiles
# of both kinds, short path and exact path, in one call).
_INTERPRET_MAX_NB = 4096


def _blocks_per_program(n_blocks: int, block: int) -> int:
    if _interpret():
        return max(16, min(_INTERPRET_MAX_NB, triton_next_pow2(n_blocks)))
    # Elements per program, from the H200 sweep (jobs/bench_qdq.py --sweep): MX 4096
    # (8 KiB of bf16); NVFP4 2048, whose longer scale chain needs more registers per element,
    # so smaller tiles keep more warps resident.
    return (4096 if block == 32 else 2048) // block


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check(x: torch.Tensor, fmt: str, profile: str | None):
    recipe = parse_recipe(fmt, profile)
    if recipe.profile not in SUPPORTED.get(recipe.fmt, ()):
        raise NotImplementedError(
            f"no Triton kernel for {recipe}; kernels cover {SUPPORTED} (use workbench.formats)")
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"quantize expects a bf16/fp16/fp32 tensor, got {getattr(x, 'dtype', x)}")
    spec = format_spec(recipe.fmt)
    if x.dim() == 0 or x.shape[-1] % spec.block:
        raise ValueError(f"{recipe.fmt} blocks are {spec.block} wide along the last dim; shape "
                         f"{tuple(x.shape)} cannot be blocked (workbench.formats pads with pad=True)")
    _require_device(x)
    return recipe, spec


def _out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None:
        return x.dtype
    if out_dtype not in _FLOATS:
        raise TypeError(f"fake quantization writes bf16/fp16/fp32, not {out_dtype}")
    return out_dtype


def _mx_args(recipe, spec, device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The encode / decode tables and the format's constexprs, as the MX kernels take them."""
    prof = MX_PROFILES[recipe.profile]
    dev = str(device)
    enc = cached_lut("encode", prof.name, dev, torch.float32)
    dec = cached_lut("decode", prof.name, dev, torch.float32)
    max_mant = struct.unpack("<I", struct.pack("<f", spec.elem_max))[0] & 0x7FFFFF
    consts = dict(ELEM={"e2m1": 0, "e4m3": 1, "e5m2": 2}[spec.element],
                  RULE=_MX_RULES[prof.scale_rule], EMAX=spec.elem_emax,
                  MANT_BITS=spec.elem_mantissa_bits, MAX_MANT=max_mant, ELEM_MAX=spec.elem_max,
                  INF_BYTE=-1 if prof.inf_byte is None else prof.inf_byte, HW=not _interpret())
    return enc, dec, consts


def _run_mx(x, recipe, spec, fake: bool, out_dtype: torch.dtype | None = None):
    mxk, _ = _triton()
    x = x.contiguous()
    n_blocks = x.numel() // 32
    enc, dec, consts = _mx_args(recipe, spec, x.device)
    if fake:
        out, scale = torch.empty_like(x, dtype=_out_dtype(x, out_dtype)), x  # scale_ptr unused
    else:
        shape = (*x.shape[:-1], x.shape[-1] // 2) if spec.packed else tuple(x.shape)
        out = torch.empty(shape, dtype=spec.elem_dtype, device=x.device)
        scale = torch.empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.uint8, device=x.device)
    if n_blocks == 0:
        return out, scale
    nb = _blocks_per_program(n_blocks, 32)
    mxk.mx_kernel[(triton_cdiv(n_blocks, nb),)](
        _bits(x), _bits(out), scale, enc, dec, n_blocks, NB=nb, FAKE=fake,
        BF16_BITS=x.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16, num_warps=4,
        **consts)
    return out, scale


def _swiglu_operands(name: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t0 = ts[0]
    for t in ts:
        if t.dtype != torch.bfloat16 or t.shape != t0.shape or t.device != t0.device:
            raise ValueError(f"{name} takes bf16 tensors of one shape and device, got "
                             + ", ".join(f"{t.dtype} {list(t.shape)} on {t.device}" for t in ts))
    _require_device(t0)
    return tuple(t.contiguous() for t in ts)


def silu_mul_fake_quantize(g: torch.Tensor, u: torch.Tensor, fmt,
                           profile: str | None = None) -> torch.Tensor:
    """``fake_quantize(F.silu(g) * u, fmt, profile)`` for bf16 ``g`` and ``u`` of one shape, in
    one pass (MX formats; NVFP4's tensor amax would need a pass over the product first). On a
    GPU the same bits as those torch ops and then this module's ``fake_quantize``
    (tests/kernels/test_swiglu.py checks the silu on every bf16 input). The SwiGLU of an expert
    layer fused with the down projection's activation fake quantization: neither ``silu(g)``
    nor the product is written (the QAT seam's ``down``, ``workbench.qat.grouped``)."""
    recipe, spec = _check(g, fmt, profile)
    if spec.scale != "e8m0":
        raise NotImplementedError(f"silu_mul_fake_quantize serves MX formats, not {recipe}")
    g, u = _swiglu_operands("silu_mul_fake_quantize", g, u)
    mxk, _ = _triton()
    q = torch.empty_like(g)
    n_blocks = g.numel() // 32
    if n_blocks:
        enc, dec, consts = _mx_args(recipe, spec, g.device)
        nb = _blocks_per_program(n_blocks, 32)
        mxk.swiglu_mx_kernel[(triton_cdiv(n_blocks, nb),)](
            _bits(g), _bits(u), _bits(q), enc, dec, n_blocks, NB=nb, num_warps=4, **consts)
    return q


# Whether torch's CUDA silu_backward contracts ``x * (1 - sig) + 1`` into an fma (nvcc does by
# default): the GPU test of silu_mul_backward checks the choice against torch.
SILU_BACKWARD_CONTRACT = True


def silu_mul_backward(dq: torch.Tensor, g: torch.Tensor, u: torch.Tensor, *,
                      contract: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dg, du)``: the gradients of ``silu(g) * u`` for the incoming ``dq`` (bf16, one shape),
    as torch's autograd computes them on CUDA, ``silu_backward(dq * u, g)`` and
    ``dq * silu(g)``, in one pass that recomputes ``silu(g)``. ``contract``: see
    ``_mx_kernel.swiglu_backward_kernel`` (default ``SILU_BACKWARD_CONTRACT``)."""
    dq, g, u = _swiglu_operands("silu_mul_backward", dq, g, u)
    mxk, _ = _triton()
    contract = SILU_BACKWARD_CONTRACT if contract is None else contract
    dg, du = torch.empty_like(g), torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1 << 20 if _interpret() else 4096
        extra = {} if contract else {"enable_fp_fusion": False}
        mxk.swiglu_backward_kernel[(triton_cdiv(n, block),)](
            _bits(dq), _bits(g), _bits(u), _bits(dg), _bits(du), n, BLOCK=block,
            HW=not _interpret(), CONTRACT=contract, num_warps=4, **extra)
    return dg, du


def _bits(x: torch.Tensor) -> torch.Tensor:
    # bf16 travels as its int16 bits (see _common.load_f32)
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def global_amax(x: torch.Tensor, *, per_leading: bool, ignore_nan: bool) -> torch.Tensor:
    """fp32 abs-max of ``x`` (0-dim), or one per leading index (``[E, 1, ...]``), in one pass
    (an atomic integer max per chunk). NaN propagates unless ``ignore_nan``."""
    nvk = _triton()[1]
    x = x.contiguous()
    n_exp = x.shape[0] if per_leading else 1
    bits = torch.zeros(n_exp, dtype=torch.int32, device=x.device)
    n_per = x.numel() // n_exp
    if n_per:
        chunk = 1 << 20 if _interpret() else 16384
        nvk.amax_kernel[(n_exp, triton_cdiv(n_per, chunk))](
            _bits(x), bits, n_per, BLOCK=chunk, IGNORE_NAN=ignore_nan,
            BF16_BITS=x.dtype == torch.bfloat16, num_warps=8)
    amax = bits.view(torch.float32)
    if per_leading:
        return amax.reshape((n_exp,) + (1,) * (x.dim() - 1))
    return amax.reshape(())


def _launch_nvfp4(x, out, scale, amax_flat, recipe, fake: bool, nb: int | None = None,
                  num_warps: int = 4):
    """Contiguous ``x``; ``amax_flat`` holds one fp32 amax per expert (leading index).
    ``nb`` / ``num_warps`` override the tile (jobs/bench_qdq.py --sweep tunes them). Returns
    Triton's launch handle (its ``n_regs`` / ``n_spills`` go into the benchmark's profile)."""
    _, nvk = _triton()
    n_blocks = x.numel() // 16
    bpe = n_blocks // amax_flat.numel()
    nb = nb or _blocks_per_program(n_blocks, 16)
    # one expert per program (the global scalars computed once per program) when program
    # tiles never straddle an expert boundary
    uniform = amax_flat.numel() == 1 or bpe % nb == 0
    return nvk.nvfp4_kernel[(triton_cdiv(n_blocks, nb),)](
        _bits(x), _bits(out), scale, amax_flat, n_blocks, bpe, NB=nb,
        PROFILE={"torchao": 0, "te": 1}[recipe.profile], FAKE=fake,
        BF16_BITS=x.dtype == torch.bfloat16, HW=not _interpret(), UNIFORM=uniform,
        OUT_BF16=out.dtype == torch.bfloat16, num_warps=num_warps)


def _run_nvfp4(x, recipe, global_amax_arg, fake: bool, out_dtype: torch.dtype | None = None):
    x = x.contiguous()
    if x.numel() == 0:
        raise ValueError(f"cannot quantize an empty tensor of shape {list(x.shape)}")
    if global_amax_arg is None:
        amax = global_amax(x, per_leading=False, ignore_nan=recipe.profile == "te")
    else:
        amax = torch.as_tensor(global_amax_arg, dtype=torch.float32, device=x.device)
        per_expert = (x.shape[0],) + (1,) * (x.dim() - 1)
        if not ((x.dim() >= 2 and tuple(amax.shape) == per_expert) or amax.numel() == 1):
            raise ValueError(f"global_amax must be a scalar or shape {list(per_expert)} for an "
                             f"input of shape {list(x.shape)}, got shape {list(amax.shape)}")
    if fake:
        out, scale = torch.empty_like(x, dtype=_out_dtype(x, out_dtype)), x  # scale_ptr unused
    else:
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8, device=x.device)
        scale = torch.empty((*x.shape[:-1], x.shape[-1] // 16), dtype=torch.float8_e4m3fn,
                            device=x.device)
    _launch_nvfp4(x, out, scale, amax.reshape(-1).contiguous(), recipe, fake)
    return out, scale, amax


def fake_quantize_experts(x: torch.Tensor, fmt, profile: str | None = None, *,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake quantization of an expert stack ``[E, ...]`` with NVFP4's global scale taken per
    expert (``global_amax = x.abs().amax(dim=(-2, -1))``, NaN propagating): the QAT weight
    path. Other formats have no global scale and equal ``fake_quantize``.

    Two launches (amax, then quantize) whatever E is. Measured slower and dropped
    (docs/kernels.md): per-expert launches (bound by the host's launch rate), the quantize pass in
    reverse tile order (no gain), and one launch interleaving expert e+1's amax with expert e's
    tiles (slower: tiles wait on amax chunks in flight, and 50 MB experts miss L2 anyway)."""
    recipe, spec = _check(x, fmt, profile)
    if spec.scale == "e8m0":
        return _run_mx(x, recipe, spec, fake=True, out_dtype=out_dtype)[0]
    if x.dim() < 2 or x.numel() == 0:
        raise ValueError(f"fake_quantize_experts expects a non-empty [E, ...] stack, got shape "
                         f"{list(x.shape)}")
    amax = global_amax(x, per_leading=True, ignore_nan=False)
    return _run_nvfp4(x, recipe, amax, fake=True, out_dtype=out_dtype)[0]


def quantize(x: torch.Tensor, fmt, profile: str | None = None, *,
             global_amax: torch.Tensor | None = None) -> QuantizedTensor:
    """``workbench.formats.quantize`` (without ``pad``) on the GPU."""
    recipe, spec = _check(x, fmt, profile)
    if spec.scale == "e8m0":
        data, scale = _run_mx(x, recipe, spec, fake=False)
        gs = lib = None
    else:

        data, scale, amax = _run_nvfp4(x, recipe, global_amax, fake=False)
        # The stored global: the reference's own scalar arithmetic on the amax, on the CPU.
        # On CUDA, torch evaluates ``amax / 2688`` as ``amax * fl(1/2688)``, one ulp off the
        # true division that the kernel's block scales were computed with.
        g = get_profile(recipe.profile).global_from_amax(amax.cpu())
        gs = from_library_global(g, recipe.profile).to(x.device)
        lib = g.to(x.device)  # what TE decodes with (the amax): no lossy round trip
    return QuantizedTensor(recipe.fmt, recipe.profile, data, scale, gs, tuple(x.shape),
                           library_global=lib)


def fake_quantize(x: torch.Tensor, fmt, profile: str | None = None, *,
                  global_amax: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``workbench.formats.fake_quantize`` in one pass (plus an amax pass for NVFP4 without
    ``global_amax``): same shape, dtype and bits.

    ``out_dtype``: write the result in this dtype instead of ``x``'s: the fp32 fake quantization
    of ``x`` rounded once to it, so for an fp32 ``x`` bit-equal to ``fake_quantize(x, ...)
    .to(out_dtype)``. An fp32 master fake-quantized straight into the bf16 operand of an
    autocast GEMM: one pass instead of a fake quantization and a cast (8 of 14 bytes of traffic
    per element less)."""
    recipe, spec = _check(x, fmt, profile)
    if spec.scale == "e8m0":
        return _run_mx(x, recipe, spec, fake=True, out_dtype=out_dtype)[0]
    return _run_nvfp4(x, recipe, global_amax, fake=True, out_dtype=out_dtype)[0]
