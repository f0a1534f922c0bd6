"""Format facts in one place: element grids, scale encodings, block sizes.

Every number here is from the OCP Microscaling (MX) v1.0 spec, NVIDIA's NVFP4 description, or
the IEEE-like float8 definitions that PyTorch's ``float8_e4m3fn`` / ``float8_e5m2`` implement.
docs/formats.md records which library does what with them; tests check the tables against
ml_dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def div_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` as one correctly rounded division on every device. ``tensor / python_scalar``
    is not that on CUDA: ATen computes ``x * (1 / c)`` there when the divisor is a CPU scalar
    (div_true_kernel_cuda), which misses the quotient by an ulp for some x, so a CUDA quantize
    (an NVFP4 global ``amax / 2688``, a block scale ``amax / 6``) could differ from the CPU one in
    the last bit. A divisor tensor on x's device takes the true division kernel everywhere; every
    constant divided by here (6, 448, 2688, 57344) is exact in bf16, so bf16 inputs divide by
    the same number as before."""
    return x / torch.full((), c, dtype=x.dtype, device=x.device)


# E2M1 (FP4): low 3 bits index the magnitude, bit 3 is the sign. No Inf, no NaN.
E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest normal (6 = 1.5 * 2^2)
E2M1_MANTISSA_BITS = 1
E2M1_SIGN_BIT = 0x8

# float8 element formats (PyTorch dtypes carry the bit layout).
E4M3_MAX = 448.0
E4M3_EMAX = 8
E4M3_MANTISSA_BITS = 3
E5M2_MAX = 57344.0
E5M2_EMAX = 15
E5M2_MANTISSA_BITS = 2

# E8M0 scale: unsigned byte b, value 2^(b - 127); 0xFF is NaN; 0x00 is 2^-127 (an fp32 subnormal).
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_NORMAL = 0xFE

# Block sizes along the last (reduction / contiguous) dimension.
MX_BLOCK = 32
NVFP4_BLOCK = 16
# NVFP4's two-level scale: tensor amax maps to E4M3_MAX * E2M1_MAX.
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688


@dataclass(frozen=True)
class FormatSpec:
    """What a block-scaled format is, independent of any library's rounding choices."""

    name: str
    element: str  # "e2m1" | "e4m3" | "e5m2"
    block: int
    scale: str  # "e8m0" (MX) | "e4m3" (NVFP4, plus an fp32 per-tensor scale)
    elem_max: float
    elem_emax: int
    elem_mantissa_bits: int
    profiles: tuple[str, ...]
    default_profile: str

    @property
    def packed(self) -> bool:
        """FP4 codes are stored two per byte."""
        return self.element == "e2m1"

    @property
    def elem_dtype(self) -> torch.dtype:
        """Storage dtype of ``QuantizedTensor.data``."""
        return {
            "e2m1": torch.uint8,
            "e4m3": torch.float8_e4m3fn,
            "e5m2": torch.float8_e5m2,
        }[self.element]


# The profile names live in the torch-free recipe grammar (workbench.recipe), so launchers parse
# recipes without torch; mx_profiles.PROFILES says who writes what.
from workbench.recipe import (
    MX_E4M3_PROFILES,
    MX_E5M2_PROFILES,
    MX_PROFILES,
    NVFP4_PROFILES,
)

FORMATS: dict[str, FormatSpec] = {
    "mxfp4": FormatSpec("mxfp4", "e2m1", MX_BLOCK, "e8m0", E2M1_MAX, E2M1_EMAX,
                        E2M1_MANTISSA_BITS, MX_PROFILES, "rceil"),
    "mxfp8_e4m3": FormatSpec("mxfp8_e4m3", "e4m3", MX_BLOCK, "e8m0", E4M3_MAX, E4M3_EMAX,
                             E4M3_MANTISSA_BITS, MX_E4M3_PROFILES, "rceil"),
    "mxfp8_e5m2": FormatSpec("mxfp8_e5m2", "e5m2", MX_BLOCK, "e8m0", E5M2_MAX, E5M2_EMAX,
                             E5M2_MANTISSA_BITS, MX_E5M2_PROFILES, "rceil"),
    "nvfp4": FormatSpec("nvfp4", "e2m1", NVFP4_BLOCK, "e4m3", E2M1_MAX, E2M1_EMAX,
                        E2M1_MANTISSA_BITS, NVFP4_PROFILES, "torchao"),
}


def format_spec(fmt: str) -> FormatSpec:
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown format {fmt!r}; choose one of {sorted(FORMATS)}") from None
