"""What each library does when it writes or reads an MX tensor: one row per profile, one scale rule.

Every row was read from the library's source and checked by running it (tests/formats/); the
docstrings name the exact functions. Shape legend: ``amax_B`` has one entry per 32-element block
(any leading dims), ``byte_B`` the E8M0 byte of each block.

Differences that matter on real data: FLOOR clips every block whose amax lies in (6, 8) * 2^k;
EVEN/compressed-tensors bump the exponent at mantissa >= 1.75; RCEIL never clips. Everything
else (specials, byte-0 blocks, -0.0, ties) only shows on edge inputs, and only there do the rows
below differ.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch

from .constants import E8M0_BIAS, FormatSpec, div_const

# fp32 mantissa field of each element format's max, read once at import: inside a traced
# function a tensor .item() breaks the graph and dynamo's struct polyfill recurses.
_MAX_MANTISSA = {v: struct.unpack("<I", struct.pack("<f", v))[0] & 0x7FFFFF
                 for v in (6.0, 448.0, 57344.0)}

# Scale rules, each a pure function of the block amax (fp32) to an unbiased exponent; see
# ``scale_byte``. "Integer" rules read amax's bits, "float" rules repeat the library's float math.
SCALE_RULES = ("floor", "ceil", "even", "rceil", "rceil-float", "even-fp4", "round-up-bits")
# How elements are rounded to E2M1 and where the FP4 sign bit comes from:
#   "bits":     sign bit of the scaled fp32 value (torchao, ml_dtypes, triton_kernels)
#   "negative": only values < 0 after scaling in the input dtype (compressed-tensors: -0.0 -> 0x0)
#   "not-positive": everything that is not > 0 (ModelOpt export: +0.0 -> 0x8)
# FP8 elements keep the sign of the scaled value through the cast, except under "negative":
# compressed-tensors adds its zero point (+0.0) before the cast, so a -0.0 quotient (a -0.0
# input, or a negative too small for the input dtype after scaling) is written 0x00, not 0x80.
SIGN_MODES = ("bits", "negative", "not-positive")
# How a decoder reads E8M0 byte 0xFF; see ``MXProfile.dec_byte255``.
DEC_BYTE255 = ("nan", "inf", "ldexp")


@dataclass(frozen=True)
class MXProfile:
    """One library's MX behaviour, encode and decode.

    scale_rule:   which ``SCALE_RULES`` entry picks the E8M0 byte from the block amax.
    nan_byte:     byte written for a block whose amax is NaN (None: the rule's own result).
    inf_byte:     byte written for a block whose amax is +inf (None: the rule's own result).
    enc_byte0:    multiplier used to encode a byte-0 block instead of the exact 2^127
                  (torchao FLOOR/CEIL/EVEN divide by 2^-126; torchao RCEIL and TE multiply by 1;
                  triton_kernels multiplies by 0). None: exact.
    enc_byte255:  multiplier for a byte-255 block (0.0 = "divide by inf"; NaN = torchao RCEIL's
                  "multiply by the NaN descale").
    ties:         E2M1 tie rule ("even" or "down"), see ``elements.e2m1_encode``.
    sign:         one of ``SIGN_MODES``.
    nan_amax:     "propagate" (torch.amax) or "ignore" (max.f32 / maxnum in Triton reductions).
    dec_byte0:    decoded value of byte 0 (2^-127 everywhere now; older triton_kernels used 0).
    dec_byte255:  "nan" (torchao, ml_dtypes, triton_kernels), "inf" (2**(b-127) decoders: a zero
                  code times inf is NaN) or "ldexp" (transformers: torch.ldexp(code, 128), the
                  exact product, so zero codes stay +-0, code 0.5 gives 2^127, larger ones +-inf).
    dec_saturate: clamp decoded values to the output dtype's finite range (triton_kernels).
    formats:      formats the library writes with this behaviour.
    truncated_sticky: E2M1 rounding shifts the low mantissa bits of values in [0.25, 0.5) out
                  before looking at them (triton_kernels), so fp32 values in
                  (0.25, 0.25 + 3 * 2^-25] round down to 0 instead of up to 0.5.
    dec_fp16_scale: for fp16 output the decoder rounds the scale to fp16 first (so scales
                  outside fp16's range become 0 or inf) and multiplies in fp16: torchao's
                  to_dtype and both triton_kernels upcasts. Others multiply in fp32. So a block
                  with byte >= 143 (scale >= 2^16, only reached by an inf amax from fp16 data)
                  decodes to fp16 inf/NaN (0 * inf) even for zero codes, as torchao does.
    """

    name: str
    scale_rule: str
    nan_byte: int | None
    inf_byte: int | None
    enc_byte0: float | None
    enc_byte255: float
    ties: str
    sign: str
    nan_amax: str
    dec_byte0: float
    dec_byte255: str
    dec_saturate: bool
    formats: tuple[str, ...]
    source: str
    truncated_sticky: bool = False
    dec_fp16_scale: bool = False

    def __post_init__(self) -> None:
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"profile {self.name}: scale_rule must be one of {SCALE_RULES}")
        if self.sign not in SIGN_MODES:
            raise ValueError(f"profile {self.name}: sign must be one of {SIGN_MODES}")
        if self.dec_byte255 not in DEC_BYTE255:
            raise ValueError(f"profile {self.name}: dec_byte255 must be one of {DEC_BYTE255}")
        if self.nan_amax not in ("propagate", "ignore"):
            raise ValueError(f"profile {self.name}: nan_amax must be 'propagate' or 'ignore'")


_ALL_MX = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
_NAN = float("nan")
_TWO_M127 = 2.0**-127


def _torchao(name: str, rule: str) -> MXProfile:
    # torchao 0.18 to_mx FLOOR/CEIL/EVEN: exponent clamp [-127, 128], NaN -> 0xFF; the fp32 scale
    # is clamped to 2^-126 before dividing (pytorch#125557), so byte-0 blocks encode with 2^-126
    # but decode (get_fp_scale) with 2^-127; an inf amax falls out of the rule (byte 255 - P).
    return MXProfile(name, rule, nan_byte=0xFF, inf_byte=None, enc_byte0=2.0**126,
                     enc_byte255=0.0, ties="even", sign="bits", nan_amax="propagate",
                     dec_byte0=_TWO_M127, dec_byte255="nan", dec_saturate=False, formats=_ALL_MX,
                     source=f"torchao 0.18 to_mx(scaling_mode={rule.upper()}) / to_dtype",
                     dec_fp16_scale=True)


PROFILES: dict[str, MXProfile] = {
    "floor": _torchao("floor", "floor"),
    "ceil": _torchao("ceil", "ceil"),
    "even": _torchao("even", "even"),
    # The exact 2^ceil(log2(amax/max)). TE's formula (cvt.rp.satfinite.ue8m0x2.f32 of
    # amax * fl(1/max), also cuBLAS's and torchao's compiled sm100 path) gives the same byte for
    # every bf16 amax and at fp32 ulp edges (tested against a transcription) except, unverified,
    # where amax/max is an fp32 subnormal. torchao's CPU eager path equals it for every bf16
    # input and differs only for fp32 amax a few ulps above max*2^k ("torchao-rceil").
    # Specials as torchao/TE (exp2f_rcp): NaN -> 0xFF, Inf -> 0xFE, byte-0 blocks encoded with
    # 1.0 (so they quantize to zero).
    "rceil": MXProfile("rceil", "rceil", nan_byte=0xFF, inf_byte=0xFE, enc_byte0=1.0,
                       enc_byte255=_NAN, ties="even", sign="bits", nan_amax="propagate",
                       dec_byte0=_TWO_M127, dec_byte255="nan", dec_saturate=False,
                       formats=_ALL_MX, source="exact RCEIL (TE/cuBLAS); torchao 0.18 RCEIL on bf16",
                       dec_fp16_scale=True),
    # torchao 0.18 _to_mx_rceil eager fallback, bit for bit: ceil(log2(amax / max)) in fp32.
    "torchao-rceil": MXProfile("torchao-rceil", "rceil-float", nan_byte=0xFF, inf_byte=0xFE,
                               enc_byte0=1.0, enc_byte255=_NAN, ties="even", sign="bits",
                               nan_amax="propagate", dec_byte0=_TWO_M127, dec_byte255="nan",
                               dec_saturate=False, formats=_ALL_MX,
                               source="torchao 0.18 to_mx(RCEIL) CPU eager (_to_mx_rceil fallback)",
                               dec_fp16_scale=True),
    # compressed-tensors 0.20.1: generate_mx_scales (round_to_power_2 with the FP4 mantissa width,
    # also for MXFP8) -> 2**(b-127) float scale -> x / scale in the input dtype -> cast_to_fp4
    # (RNE) -> pack_fp4_to_uint8 (sign from signbit after cast_to_fp4 multiplied by sign(x), so
    # -0.0 -> 0x0 but tiny negatives -> 0x8; MXFP8: the zero point it adds turns -0.0 into
    # 0x00, see SIGN_MODES). Non-finite amax, or an amax that rounds up to
    # 2^128: undefined (float->int casts); this row writes 0xFF and zeros there. fp16 inputs are
    # taken as their exact fp32 copy (the library would divide by fp16 scales that underflow).
    "compressed-tensors": MXProfile("compressed-tensors", "even-fp4", nan_byte=0xFF, inf_byte=0xFF,
                                    enc_byte0=None, enc_byte255=0.0, ties="even", sign="negative",
                                    nan_amax="propagate", dec_byte0=_TWO_M127, dec_byte255="inf",
                                    dec_saturate=False, formats=("mxfp4", "mxfp8_e4m3"),
                                    source="compressed-tensors 0.20.1 MXFP4PackedCompressor"),
    # ModelOpt 0.47 MXFP4QTensor.quantize / MXFP8QTensor.quantize: ceil(max(log2(amax/max), -127))
    # in fp32, x / 2^e, E2M1 ties down, exact zeros -> 0x8; MXFP8: NaN amax -> byte 0, Inf -> 254.
    "modelopt-export": MXProfile("modelopt-export", "rceil-float", nan_byte=0x00, inf_byte=0xFE,
                                 enc_byte0=None, enc_byte255=0.0, ties="down", sign="not-positive",
                                 nan_amax="propagate", dec_byte0=_TWO_M127, dec_byte255="inf",
                                 dec_saturate=False, formats=("mxfp4", "mxfp8_e4m3"),
                                 source="nvidia-modelopt 0.47 MXFP4QTensor / MXFP8QTensor"),
    # triton_kernels downcast_to_mxfp (ROUND_UP): bits(fl(amax/max)) + 0x7FFFFF, masked to the
    # exponent; a zero (or NaN) descale gives byte 0 and a zero multiplier; amax via max.f32
    # (NaN ignored); NaN results are the GPU's canonical NaN. Two generations of its E2M1 code:
    # "triton-kernels" is the one gpt-oss shipped with and transformers' MXFP4 writer loads
    # (triton-lang/triton d1c192b7, vendored widely): "+1 >> 1" on the guard bit = ties away;
    # its upcast decodes byte 0 as 0.0. "triton-kernels-main" is triton main since late 2025
    # (0616e645): RNE with a sticky bit that misses bits shifted out below 0.5; its upcast
    # decodes byte 0 as 2^-127. Both upcasts saturate to the dtype's range and give NaN for 0xFF.
    "triton-kernels": MXProfile("triton-kernels", "round-up-bits", nan_byte=0x00, inf_byte=0xFF,
                                enc_byte0=0.0, enc_byte255=0.0, ties="away", sign="bits",
                                nan_amax="ignore", dec_byte0=0.0, dec_byte255="nan",
                                dec_saturate=True, formats=_ALL_MX,
                                source="triton_kernels as shipped for gpt-oss (triton d1c192b7)",
                                dec_fp16_scale=True),
    "triton-kernels-main": MXProfile("triton-kernels-main", "round-up-bits", nan_byte=0x00,
                                     inf_byte=0xFF, enc_byte0=0.0, enc_byte255=0.0, ties="even",
                                     sign="bits", nan_amax="ignore", dec_byte0=_TWO_M127,
                                     dec_byte255="nan", dec_saturate=True, formats=_ALL_MX,
                                     source="triton_kernels on triton main (0616e645, 01757dc2)",
                                     truncated_sticky=True, dec_fp16_scale=True),
    # What a gpt-oss checkpoint means to transformers (the layouts' reference loader): written by
    # the triton_kernels gpt-oss shipped with (quantize_to_mxfp4 -> downcast_to_mxfp, so encode
    # fields are "triton-kernels"), read by convert_moe_packed_tensors: torch.ldexp(code,
    # byte - 127) in the output dtype, no saturation, byte 0 = 2^-127 and 0xFF the exact 2^128.
    "transformers": MXProfile("transformers", "round-up-bits", nan_byte=0x00, inf_byte=0xFF,
                              enc_byte0=0.0, enc_byte255=0.0, ties="away", sign="bits",
                              nan_amax="ignore", dec_byte0=_TWO_M127, dec_byte255="ldexp",
                              dec_saturate=False, formats=("mxfp4",),
                              source="transformers 5.24 integrations.mxfp4 (triton d1c192b7 "
                                     "encode, convert_moe_packed_tensors decode)"),
}


def mx_profile(name: str, spec: FormatSpec) -> MXProfile:
    try:
        prof = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown MX profile {name!r}; choose one of {sorted(PROFILES)}") from None
    if spec.name not in prof.formats:
        raise ValueError(
            f"profile {name!r} ({prof.source}) does not write {spec.name}; "
            f"it covers {list(prof.formats)}"
        )
    return prof


def _fields(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = amax.view(torch.int32)
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def scale_byte(amax_B: torch.Tensor, spec: FormatSpec, prof: MXProfile) -> torch.Tensor:
    """E8M0 byte of each block from its fp32 amax (>= 0, maybe NaN/inf) under a profile's rule."""
    amax_B = raw_B = amax_B.float().contiguous()
    p = spec.elem_emax
    rule = prof.scale_rule
    if rule in ("floor", "ceil", "even", "even-fp4", "rceil"):
        if rule == "even":
            # round amax to the element's mantissa width first (torchao EVEN, OCP "round")
            add = 1 << (22 - spec.elem_mantissa_bits)
            amax_B = ((amax_B.view(torch.int32) + add) & 0x7F800000).view(torch.float32)
        elif rule == "even-fp4":
            # compressed-tensors rounds with the FP4 mantissa width for every element type
            amax_B = ((amax_B.view(torch.int32) + (1 << 21)) & 0x7F800000).view(torch.float32)
        efield, mant = _fields(amax_B)
        k = efield - E8M0_BIAS - p
        if rule == "ceil":
            k = k + (mant > 0).to(torch.int32)
        elif rule == "rceil":
            # smallest k with max * 2^k >= amax, exactly: bump when amax's mantissa exceeds
            # max's (6 = 1.5 * 2^2, 448 = 1.75 * 2^8, 57344 = 1.75 * 2^15)
            max_mant = _MAX_MANTISSA[spec.elem_max]
            k = k + (mant > max_mant).to(torch.int32)
        byte = (k + E8M0_BIAS).clamp(0, 255)
        if rule == "even-fp4":
            # the rounded amax overflowed to inf: log2(inf) = inf, clamped to 255 as a float
            byte = torch.where(efield == 0xFF, 255, byte)
        elif rule == "rceil":
            byte = byte.clamp(max=254)
    elif rule == "rceil-float":
        # torchao's eager fallback and ModelOpt's export: the same fp32 ops, in the same order
        log2 = torch.log2(div_const(amax_B, spec.elem_max))
        byte = torch.ceil(log2).clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32) + E8M0_BIAS
    elif rule == "round-up-bits":
        descale = div_const(amax_B, spec.elem_max).view(torch.int32)
        byte = ((descale + 0x7FFFFF) & 0x7F800000) >> 23
    else:  # pragma: no cover - __post_init__ guards the names
        raise AssertionError(rule)
    if prof.inf_byte is not None:
        byte = torch.where(torch.isinf(raw_B), prof.inf_byte, byte)
    if prof.nan_byte is not None:
        byte = torch.where(torch.isnan(raw_B), prof.nan_byte, byte)
    return byte.to(torch.uint8)


@functools.lru_cache(maxsize=64)
def cached_lut(kind: str, profile: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """``encode_multipliers`` / ``decode_scales`` of a profile, built once per device and dtype
    (read-only: callers only index it)."""
    build = {"encode": encode_multipliers, "decode": decode_scales}[kind]
    return build(PROFILES[profile]).to(device=device, dtype=dtype)


def encode_multipliers(prof: MXProfile) -> torch.Tensor:
    """fp32 [256]: what each library multiplies a block by before rounding, per scale byte.

    x * 2^(127-b) equals x / 2^(b-127) bit for bit (both are one correctly rounded result of
    the same real number, and both powers are fp32 values for b in 0..254).
    """
    lut = torch.ldexp(torch.ones(256, dtype=torch.float64), 127 - torch.arange(256)).float()
    lut[255] = prof.enc_byte255
    if prof.enc_byte0 is not None:
        lut[0] = prof.enc_byte0
    return lut


def decode_scales(prof: MXProfile) -> torch.Tensor:
    """fp32 [256]: the decoded value of each E8M0 byte under a profile (byte 0 is 2^-127;
    byte 0xFF is half the scale under "ldexp")."""
    lut = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256) - 127).float()
    lut[0] = prof.dec_byte0
    # "ldexp": 2^128 is no fp32 value; dequantize_mx multiplies byte-0xFF blocks by 2 once more
    lut[255] = {"nan": float("nan"), "inf": float("inf"), "ldexp": 2.0**127}[prof.dec_byte255]
    return lut
