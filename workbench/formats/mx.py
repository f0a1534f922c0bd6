"""MX block formats (OCP Microscaling v1.0): one E8M0 scale per 32 elements along the last dim.

One encode path and one decode path for every profile; what differs between libraries is data
in ``mx_profiles.PROFILES`` (scale rule, multipliers per byte, tie rule, sign rule, specials).

Shape legend: ``x_BK`` is the input viewed as ``[..., nblocks, 32]``; ``amax_B`` / ``byte_B``
have one entry per block; ``codes_BK`` the E2M1 codes; ``data`` / ``scale`` are what
``QuantizedTensor`` stores.

Speed: bf16 inputs are scaled and rounded in bf16 (a power-of-two multiple of a bf16 value is
a bf16 value unless it falls below 2^-126, far under the smallest E2M1/FP8 step, where only its
sign survives, and bf16 keeps the sign), so the element pass never makes an fp32 copy of the
tensor; ModelOpt's profile is the exception (it tests ``v > 0`` on an fp32 quotient). Blocks
with a non-finite amax go through a separate fp32 path that repeats each library's arithmetic,
NaN payloads included. Under torch.compile the same results come from a branch-free path
(``_dense``), so ``fullgraph=True`` works.
"""

from __future__ import annotations

import torch

from .constants import FormatSpec
from .elements import e2m1_decode_packed, e2m1_magnitude_code, pack_fp4
from .mx_profiles import MXProfile, cached_lut, mx_profile, scale_byte

# torchao's _f32_to_floatx_unpacked on a NaN: its "normal" branch adds these to the bits.
_TORCHAO_NAN_ADD = ((1 - 127) << 23) + ((1 << 21) - 1)
# triton_kernels' E2M1 rounding loses the 2 lowest mantissa bits of values in [0.25, 0.5).
_STICKY_EDGE = 0.25 + 3 * 2.0**-25


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _work_dtype(x: torch.Tensor, prof: MXProfile) -> torch.dtype:
    # ModelOpt tests v > 0 on its fp32 quotient: a bf16 product would flush tiny positives to +0
    if x.dtype == torch.bfloat16 and prof.sign != "not-positive":
        return torch.bfloat16
    return torch.float32


def _dense() -> bool:
    """Under torch.compile, take the branch-free path: data-dependent ``if``s and boolean-mask
    shapes would break the graph, so special blocks are computed everywhere and selected."""
    return torch.compiler.is_compiling()


def _lut(kind: str, prof: MXProfile, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if _dense():  # dynamo traces through lru_cache anyway (and warns): build it in the graph
        return cached_lut.__wrapped__(kind, prof.name, str(device), dtype)
    return cached_lut(kind, prof.name, str(device), dtype)


def _maxnum(x_BK: torch.Tensor) -> torch.Tensor:
    # max.f32 / maxnum skip NaN operands; an all-NaN block still reduces to NaN
    a = x_BK.float().abs()
    m = torch.where(torch.isnan(a), float("-inf"), a).amax(-1)
    return torch.where(m == float("-inf"), float("nan"), m)


def block_amax(x_BK: torch.Tensor, prof: MXProfile) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 amax per block as the profile's library reduces it, and the non-finite-block mask."""
    amax_B = x_BK.abs().amax(-1).float()
    bad_B = ~torch.isfinite(amax_B)
    if prof.nan_amax == "ignore":
        if _dense():
            amax_B = torch.where(bad_B, _maxnum(x_BK), amax_B)
        elif bad_B.any():
            amax_B[bad_B] = _maxnum(x_BK[bad_B])
    return amax_B, bad_B


def _negative(v: torch.Tensor, prof: MXProfile) -> torch.Tensor:
    """Which elements get the FP4 sign bit (bool)."""
    if prof.sign == "bits":
        return torch.signbit(v)
    if prof.sign == "negative":
        return v < 0
    return ~(v > 0)  # "not-positive": (2 - sign(v)) // 2 is 1 for +-0.0 too


def _fp4_codes(v: torch.Tensor, prof: MXProfile) -> torch.Tensor:
    mag = v.abs()
    code = e2m1_magnitude_code(mag, prof.ties)
    if prof.truncated_sticky and v.dtype == torch.float32:
        # only fp32 values have mantissa bits that low; bf16 never reaches this window
        lost = (mag > 0.25) & (mag <= _STICKY_EDGE)
        code = torch.where(lost, 0, code).to(torch.uint8)
    code.add_(_negative(v, prof).to(torch.uint8), alpha=8)
    return code


def _fp4_special_codes(v: torch.Tensor, prof: MXProfile) -> torch.Tensor:
    """E2M1 codes of fp32 values that may be NaN, as each library's rounding code treats them."""
    code = _fp4_codes(v, prof)
    nan = torch.isnan(v)
    if not _dense() and not nan.any():
        return code
    if prof.sign == "bits" and prof.scale_rule != "round-up-bits":
        # torchao: NaN falls into the "normal" branch of _f32_to_floatx_unpacked; the code is
        # what its integer rounding makes of the NaN's bits (3 for the canonical quiet NaN).
        bits = v.view(torch.int32) & 0x7FFFFFFF
        mag = ((bits + _TORCHAO_NAN_ADD + ((bits >> 22) & 1)) >> 22) & 0x7
        nan_code = mag.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    elif prof.scale_rule == "round-up-bits":
        # triton_kernels runs on NVIDIA GPUs, whose arithmetic returns the canonical NaN
        # 0x7FFFFFFF (sign clear) for any NaN result: exponent field 255 saturates to code 7.
        # Seen on an H200 running the kernel source under Triton 3.6 (an off-repo check).
        nan_code = torch.full_like(code, 7)
    else:
        # compressed-tensors and ModelOpt cast NaN to an integer (undefined in C); x86 gives 0.
        nan_code = torch.zeros_like(code)
    return torch.where(nan, nan_code, code)


def quantize_mx(x: torch.Tensor, spec: FormatSpec, profile: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` ([..., K], K a multiple of 32) -> (data, E8M0 bytes [..., K/32])."""
    prof = mx_profile(profile, spec)
    x_BK = _blocks(x, spec.block)
    amax_B, bad_B = block_amax(x_BK, prof)
    byte_B = scale_byte(amax_B, spec, prof)
    mult_B = _lut("encode", prof, x.device, torch.float32)[byte_B.long()]
    wdt = _work_dtype(x, prof)
    # powers of two, 0, 1, NaN: exact in bf16 too
    v_BK = x_BK.to(wdt) * mult_B.to(wdt).unsqueeze(-1)
    dense = _dense()
    any_bad = dense or bool(bad_B.any())
    if any_bad:
        # the libraries run these blocks in fp32 (torchao, ModelOpt, triton_kernels)
        x_bad, m_bad = (x_BK, mult_B) if dense else (x_BK[bad_B], mult_B[bad_B])
        v_bad = x_bad.float() * m_bad.unsqueeze(-1)
    if spec.element == "e2m1":
        codes_BK = _fp4_codes(v_BK, prof)
        if dense:
            codes_BK = torch.where(bad_B.unsqueeze(-1), _fp4_special_codes(v_bad, prof), codes_BK)
        elif any_bad:
            codes_BK[bad_B] = _fp4_special_codes(v_bad, prof)
        data = pack_fp4(codes_BK.reshape(x.shape))
    else:
        # clamp then cast: torchao's eager path, ModelOpt and compressed-tensors clamp first;
        # Triton's satfinite cast gives the same bytes. NaN survives the clamp.
        v_BK = v_BK.clamp_(-spec.elem_max, spec.elem_max)
        if prof.sign == "negative":
            # compressed-tensors adds its (all-zero) zero point after dividing: -0.0 + 0.0 is
            # +0.0, so a -0.0 quotient is stored as 0x00, not 0x80 (any other value is unchanged)
            v_BK = v_BK.add_(0.0)
        data_BK = v_BK.to(spec.elem_dtype)
        if any_bad:
            special = v_bad.clamp(-spec.elem_max, spec.elem_max)
            special = (special + 0.0 if prof.sign == "negative" else special).to(spec.elem_dtype)
            if dense:  # where() has no float8 kernel: select the bytes
                picked = torch.where(bad_B.unsqueeze(-1), special.view(torch.uint8),
                                     data_BK.view(torch.uint8))
                data_BK = picked.view(spec.elem_dtype)
            else:
                data_BK[bad_B] = special
        data = data_BK.reshape(x.shape)
    return data, byte_B


def dequantize_mx(
    data: torch.Tensor, scale: torch.Tensor, spec: FormatSpec, profile: str, dtype: torch.dtype
) -> torch.Tensor:
    """Decode to ``dtype`` with the profile's reading of E8M0 bytes 0x00 and 0xFF.

    Element * scale is exact in fp32 (both are short powers-of-two multiples), so computing it in
    bf16 (for a bf16 output) or in fp32 and casting once gives the bytes every library gives.
    """
    prof = mx_profile(profile, spec)
    if scale.dtype != torch.uint8:
        raise TypeError(f"MX scales must be uint8 E8M0 bytes, got {scale.dtype}")
    # fp16 cannot hold most E8M0 scales: multiply in fp32 and round once, unless the library
    # itself rounds the scale to fp16 first (dec_fp16_scale)
    if dtype == torch.bfloat16 or (dtype == torch.float16 and prof.dec_fp16_scale):
        wdt = dtype
    else:
        wdt = torch.float32
    s_B = _lut("decode", prof, scale.device, wdt)[scale.long()]
    if spec.element == "e2m1":
        if data.dtype != torch.uint8:
            raise TypeError(f"packed FP4 data must be uint8, got {data.dtype}")
        vals = e2m1_decode_packed(data, wdt)
    else:
        if data.dtype != spec.elem_dtype:
            raise TypeError(f"{spec.name} data must be {spec.elem_dtype}, got {data.dtype}")
        vals = data.to(wdt)
    k = vals.shape[-1]
    if s_B.shape != (*vals.shape[:-1], k // spec.block):
        raise ValueError(
            f"{spec.name}: scale shape {tuple(scale.shape)} does not match data shape "
            f"{tuple(data.shape)} (expected {(*vals.shape[:-1], k // spec.block)})"
        )
    # vals is a fresh tensor: scale it in place (one allocation less than torchao's to_dtype)
    out_BK = _blocks(vals, spec.block).mul_(s_B.unsqueeze(-1))
    if prof.dec_byte255 == "ldexp" and (_dense() or bool((scale == 0xFF).any())):
        # the table holds 2^127 for byte 0xFF; times 2 is exact or overflows to +-inf, as
        # ldexp(code, 128) does, and zero codes stay zero (a single x * inf would be NaN)
        out_BK = torch.where((scale == 0xFF).unsqueeze(-1), out_BK * 2, out_BK)
    if prof.dec_saturate:
        fmax = torch.finfo(dtype).max
        out_BK = torch.where(torch.isnan(out_BK), out_BK, out_BK.clamp(-fmax, fmax))
    return out_BK.reshape(vals.shape).to(dtype)
