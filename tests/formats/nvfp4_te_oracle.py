"""An independent numpy transcription of Transformer Engine's NVFP4 kernels (the te oracle).

Written from TE's CUDA source, not from workbench code: ``core_nvfp4.cuh``
(``compute_global_encode_scaling_factor_FP4``, ``quantization_and_transposition_SF::
compute_decoding_scaling_factor``, ``compute_scaling_coefficient<float>``), the amax reductions of
``quantize_transpose_nvfp4.cuh`` (``fmaxf`` from 0, which skips NaN) and ``dequantize_nvfp4.cuh``.
Element and e4m3 casts come from ml_dtypes; NaN elements give 0x7 as NVIDIA's cuda_fp4.h does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)


def _fmax_abs(a: np.ndarray, axes) -> np.ndarray:
    # CUDA fmaxf(acc, fabsf(v)) starting at 0: NaN operands are ignored.
    return np.fmax.reduce(np.abs(a), axis=axes, initial=F32(0.0)).astype(F32)


def te_reference(x: np.ndarray, amax: np.float32 | None = None, tile_rows: int = 1):
    """Codes [R, K], e4m3 scale bytes [R, K/16], decoded fp32 [R, K] for a 2-D fp32 array."""
    rows, k = x.shape
    if amax is None:
        amax = _fmax_abs(x, None)
    amax = F32(amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = np.fmin(F32(448.0) * F32(6.0) / amax, FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F32(1.0)
        s_dec = F32(F32(1.0) / s_enc)
        blocks = x.reshape(rows, k // 16, 16)
        if tile_rows == 1:
            bamax = _fmax_abs(blocks, 2)
        else:
            tiles = x.reshape(rows // 16, 16, k // 16, 16)
            bamax = np.repeat(_fmax_abs(tiles, (1, 3)), 16, axis=0)
        s_dec_b = np.fmin(bamax * (s_enc * F32(F32(1.0) / F32(6.0))), FLT_MAX)
        scale = np.clip(s_dec_b, -448.0, 448.0).astype(F32).astype(ml_dtypes.float8_e4m3fn)
        scale_f = scale.astype(F32)
        rcp = np.fmin(F32(1.0) / (scale_f * s_dec), FLT_MAX)
        v = (blocks * rcp[..., None]).astype(F32).reshape(rows, k)
        codes = np.clip(v, -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        codes = np.where(np.isnan(v), np.uint8(7), codes)
        factor_inv = F32(1.0 / (6.0 * 448.0))
        final_scale = (scale_f * amax) * factor_inv
        values = codes.view(ml_dtypes.float4_e2m1fn).astype(F32).reshape(rows, k // 16, 16)
        decoded = (values * final_scale[..., None]).astype(F32).reshape(rows, k)
    return codes, scale.view(np.uint8), decoded
