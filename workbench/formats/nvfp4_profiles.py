"""The NVFP4 arithmetic of each library, transcribed step by step from its source.

One row of ``PROFILES`` per library (see ``nvfp4.py`` for the sources and docs/formats.md for the
table). ``g`` is always the global in the library's own stored form. Shape legend: ``x_RBS``
blocked input (R leading dims, B blocks, S = 16), ``bamax``/``s`` per block ``_RB``.

Special values as each library handles them (tests/formats checks every row against the library;
``te`` against a transcription of its kernels). tiny<0: a negative that rounds to zero.

| profile            | NaN in x        | amax 0     | zero block | -0.0 | tiny<0 | NaN elem | 0x8 |
|--------------------|-----------------|------------|------------|------|--------|----------|-----|
| torchao            | scales NaN      | scales NaN | 2^-6       | 0x8  | 0x8    | 2..4,sgn*| -0  |
| te                 | skipped by amax | S_enc = 1  | 0          | 0x8  | 0x8    | 0x7      | -0  |
| modelopt-export    | scales NaN      | scales NaN | 1.0        | 0x0  | 0x8    | 0x7      | +0  |
| compressed-tensors | global 1        | global 1   | 0.125      | 0x0  | 0x8    | undefined| -0  |

(*) by NaN payload: 0x3 for +qNaN, 0xB for the -qNaN that x86 produces for 0*inf.
torchao itself rejects fp16 input; every profile here accepts it (the fp32 upcast is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .constants import E2M1_MAX, E2M1_SIGN_BIT, E4M3_MAX, NVFP4_GLOBAL_DIVISOR, div_const

Tensor = torch.Tensor
_FLT_MAX = torch.finfo(torch.float32).max
_E4M3_TINY = torch.finfo(torch.float8_e4m3fn).tiny  # 2^-6, torchao's floor
_E4M3_MIN_SUBNORMAL = 2.0**-9  # ModelOpt's floor
# Rounded to fp32 exactly as the C++ constants are: `1.0f / 6.0f` and `(float)(1.0 / 2688.0)`.
_F32_RCP_6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)
_F32_RCP_2688 = torch.tensor(1.0 / NVFP4_GLOBAL_DIVISOR, dtype=torch.float32)


def _f32(v: float) -> Tensor:
    return torch.tensor(v, dtype=torch.float32)


# --- amax ------------------------------------------------------------------------------------


def _amax_propagating(x: Tensor, dim=None) -> Tensor:
    """torch's amax: a NaN anywhere makes the amax NaN (torchao, ModelOpt, compressed-tensors)."""
    a = x.abs()
    return a.amax() if dim is None else a.amax(dim)


def _amax_ignoring_nan(x: Tensor, dim=None) -> Tensor:
    """CUDA ``fmaxf``/``__hmax`` reductions from 0: NaN elements are skipped (TE)."""
    a = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())
    return a.amax() if dim is None else a.amax(dim)


# --- torchao ---------------------------------------------------------------------------------


def _torchao_global(amax: Tensor) -> Tensor:
    return div_const(amax, NVFP4_GLOBAL_DIVISOR)  # per_tensor_amax_to_scale


def _torchao_block_scale(bamax: Tensor, pts: Tensor) -> Tensor:
    return (div_const(bamax, E2M1_MAX) / pts).clamp(_E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)


def _torchao_scaled(x_RBS: Tensor, s: Tensor, pts: Tensor) -> Tensor:
    # torchao multiplies by a reciprocal "to match MSLK triton kernel numerics".
    return x_RBS * ((1.0 / pts) / s.float()).unsqueeze(-1)


def _torchao_nan_codes(v: Tensor) -> Tensor:
    """The code torchao's bit-twiddling cast (``_f32_to_floatx_unpacked``) gives a NaN.

    A NaN takes its "normal" branch: (bits + bias_adjust + rounding) >> 22, truncated to a byte,
    which leaves 2 + carry(mantissa) in the nibble, i.e. 1.0, 1.5 or 2.0 by payload, plus the sign.
    """
    bits = v.view(torch.int32)
    mant = bits & 0x7FFFFF
    carry = (mant + 0x1FFFFF + ((mant >> 22) & 1)) >> 22
    sign = (bits < 0).to(torch.int32) * E2M1_SIGN_BIT
    return ((2 + carry) | sign).to(torch.uint8)


def _torchao_decode(c: Tensor, s: Tensor, pts: Tensor) -> Tensor:
    return c * (pts * s.float()).unsqueeze(-1)


# --- Transformer Engine ----------------------------------------------------------------------


def _te_global(amax: Tensor) -> Tensor:
    return amax  # TE keeps the fp32 amax and derives S_enc in every kernel


def _te_s_enc(amax: Tensor) -> Tensor:
    # compute_global_encode_scaling_factor_FP4: fminf(2688/amax, FLT_MAX); 1 for amax 0 or inf.
    # A true fp32 division: torch's `scalar / tensor` is reciprocal(tensor) * scalar instead.
    s_enc = torch.fmin(_f32(NVFP4_GLOBAL_DIVISOR) / amax, _f32(_FLT_MAX))
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def _te_block_scale(bamax: Tensor, amax: Tensor) -> Tensor:
    s_dec_b = torch.fmin(bamax * (_te_s_enc(amax) * _F32_RCP_6), _f32(_FLT_MAX))
    # static_cast<fp8e4m3> is __NV_SATFINITE: saturate to +-448 instead of overflowing to NaN.
    return s_dec_b.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _te_scaled(x_RBS: Tensor, s: Tensor, amax: Tensor) -> Tensor:
    s_dec = 1.0 / _te_s_enc(amax)
    rcp = torch.fmin(1.0 / (s.float() * s_dec), _f32(_FLT_MAX))
    return x_RBS * rcp.unsqueeze(-1)


def _te_decode(c: Tensor, s: Tensor, amax: Tensor) -> Tensor:
    return c * ((s.float() * amax) * _F32_RCP_2688).unsqueeze(-1)


# --- ModelOpt export -------------------------------------------------------------------------


def _modelopt_global(amax: Tensor) -> Tensor:
    return div_const(amax, E2M1_MAX * E4M3_MAX)  # weights_scaling_factor_2


def _modelopt_block_scale(bamax: Tensor, wsf2: Tensor) -> Tensor:
    s = bamax / (E2M1_MAX * wsf2)
    s = torch.where(s == 0, torch.ones_like(s), s)  # "Set all zero values in scale to 1.0"
    return s.clamp(_E4M3_MIN_SUBNORMAL, E4M3_MAX).to(torch.float8_e4m3fn)


def _modelopt_scaled(x_RBS: Tensor, s: Tensor, wsf2: Tensor) -> Tensor:
    return x_RBS / (s.float() * wsf2).unsqueeze(-1)


def _modelopt_decode(c: Tensor, s: Tensor, wsf2: Tensor) -> Tensor:
    return c * (s.float() * wsf2).unsqueeze(-1)


# --- compressed-tensors ----------------------------------------------------------------------


def _ct_global(amax: Tensor) -> Tensor:
    # generate_gparam: 2688 / max(amax, tiny), NaN and +-inf replaced by 1 (an amax of inf gives
    # 0), in amax's dtype, then fp32. `2688.0 / tensor` is what the library writes; torch
    # evaluates it as reciprocal(amax) * 2688, which differs from a true division in the last bit
    # for some amax. Keep the same expression.
    g = NVFP4_GLOBAL_DIVISOR / amax.clamp(min=torch.finfo(amax.dtype).tiny)
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).float()


def _ct_block_scale(bamax: Tensor, g: Tensor) -> Tensor:
    # calculate_qparams: global * (amax / 6) (the division in bamax's dtype, the product in fp32),
    # rounded to e4m3 after a +-448 clamp, then zeros (including scales that underflow e4m3)
    # replaced by the e4m3 "eps" 0.125.
    s = (g * div_const(bamax, E2M1_MAX).float()).clamp(-E4M3_MAX, E4M3_MAX)
    s = s.to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, torch.full_like(s, 0.125), s).to(torch.float8_e4m3fn)


def _ct_scaled(x_RBS: Tensor, s: Tensor, g: Tensor) -> Tensor:
    return x_RBS / (s.float() / g).unsqueeze(-1)


def _ct_decode(c: Tensor, s: Tensor, g: Tensor) -> Tensor:
    return c * (s.float() / g).unsqueeze(-1)


# --- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class NVFP4Profile:
    """One library's NVFP4 arithmetic, step by step; ``g`` is the library's own global form."""

    name: str
    global_form: str  # what the library stores: "decode" (amax/2688), "amax", "encode" (2688/amax)
    amax: Callable[..., Tensor]
    global_from_amax: Callable[[Tensor], Tensor]
    block_scale: Callable[[Tensor, Tensor], Tensor]  # (bamax, g) -> float8_e4m3fn
    scaled: Callable[[Tensor, Tensor, Tensor], Tensor]  # (x_RBS, scale, g) -> values to round
    decode: Callable[[Tensor, Tensor, Tensor], Tensor]  # (codes as fp32 _RBS, scale, g) -> fp32
    zero_sign: str  # "signbit": -0.0 and tiny negatives get 0x8; "negative": only x < 0 does
    nan_code: Callable[[Tensor], Tensor] | None  # code for a NaN element; None: see restrictions
    decode_neg_zero: bool = True  # False: code 0x8 decodes to +0.0 (ModelOpt's table)
    # True: amax-derived scales are computed in the input's dtype, as a library does that is fed
    # the weight's own min/max (compressed-tensors: bf16 weights give bf16 `2688 / amax` and
    # `amax / 6`). Passing x.float() gives the fp32-statistics result; exact upcast, same codes.
    stats_in_input_dtype: bool = False

    def __post_init__(self) -> None:
        if self.global_form not in ("decode", "amax", "encode"):
            raise ValueError(f"global_form must be decode/amax/encode, got {self.global_form!r}")
        if self.zero_sign not in ("signbit", "negative"):
            raise ValueError(f"zero_sign must be 'signbit' or 'negative', got {self.zero_sign!r}")


def _const_code(code: int) -> Callable[[Tensor], Tensor]:
    return lambda v: torch.full(v.shape, code, dtype=torch.uint8, device=v.device)


PROFILES: dict[str, NVFP4Profile] = {
    "torchao": NVFP4Profile(
        name="torchao", global_form="decode", amax=_amax_propagating,
        global_from_amax=_torchao_global, block_scale=_torchao_block_scale,
        scaled=_torchao_scaled, decode=_torchao_decode,
        zero_sign="signbit", nan_code=_torchao_nan_codes,
    ),
    # NaN elements: e2m1 has no NaN; NVIDIA's conversion gives +MAXNORM (0x7) for any NaN, as
    # cuda_fp4.h documents and its host code confirms (tests/formats/te_probe). TE's CPU
    # reference (NVFP4QuantizerRef) would give 0x0 and drop the sign of -0.0: it is not the kernel.
    "te": NVFP4Profile(
        name="te", global_form="amax", amax=_amax_ignoring_nan,
        global_from_amax=_te_global, block_scale=_te_block_scale,
        scaled=_te_scaled, decode=_te_decode,
        zero_sign="signbit", nan_code=_const_code(0x7),
    ),
    # searchsorted puts NaN past every bound (code 7) and the sign comes from `x < 0` (False).
    "modelopt-export": NVFP4Profile(
        name="modelopt-export", global_form="decode", amax=_amax_propagating,
        global_from_amax=_modelopt_global, block_scale=_modelopt_block_scale,
        scaled=_modelopt_scaled, decode=_modelopt_decode,
        zero_sign="negative", nan_code=_const_code(0x7), decode_neg_zero=False,
    ),
    # compressed-tensors packs with `(x * 2).to(int8)`, undefined for NaN in C++: no claim made
    # (such blocks have a NaN scale and decode to NaN anyway). Its cast multiplies by
    # torch.sign(x), which is 0 for -0.0, so -0.0 loses its sign and tiny negatives keep it.
    "compressed-tensors": NVFP4Profile(
        name="compressed-tensors", global_form="encode", amax=_amax_propagating,
        global_from_amax=_ct_global, block_scale=_ct_block_scale,
        scaled=_ct_scaled, decode=_ct_decode,
        zero_sign="negative", nan_code=None, stats_in_input_dtype=True,
    ),
}


def get_profile(name: str) -> NVFP4Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown NVFP4 profile {name!r}; choose one of {sorted(PROFILES)}"
        ) from None
