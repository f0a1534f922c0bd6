"""The ``transformers`` MX profile: what a gpt-oss checkpoint means to transformers.

Oracles: transformers' own ``convert_moe_packed_tensors`` (its gpt-oss MXFP4 loader, torch.ldexp
per block) for the decode, over every scale byte x every packed byte, and the independent
transcription of the triton_kernels generation gpt-oss shipped with (``mx_cases``) for the
encode (transformers' ``quantize_to_mxfp4`` calls that kernel, which needs a GPU).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mx_cases import (
    SPECIALS,
    first_difference,
    same_values,
    special_tensor,
    triton_kernels_reference,
)

from workbench.formats import QuantizedTensor, dequantize, quantize
from workbench.formats.constants import FORMATS
from workbench.formats.elements import unpack_fp4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


def _every_byte_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss-style ``_blocks`` [1, 256, 16, 16] (all 256 packed bytes under each scale byte)
    and ``_scales`` [1, 256, 16] (row r has scale byte r)."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(1, 256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16)
    return blocks.contiguous(), scales.contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_matches_transformers_for_every_scale_and_code(dtype):
    blocks, scales = _every_byte_pair()
    # transformers returns [E, K, N] (transposed for its matmul): turn it back to rows
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)[0]
    q = QuantizedTensor("mxfp4", "transformers", blocks.reshape(256, 256), scales[0], None,
                        (256, 512))
    got = dequantize(q, dtype)
    assert same_values(got, want), first_difference(got, want)
    # byte 0xFF: zero codes stay zero, code 0.5 is 2^127, the rest overflow; no NaN anywhere
    assert not torch.isnan(got).any()
    row, mag = got[255].float(), unpack_fp4(q.data[255]) & 7
    assert (row[mag == 0] == 0).all() and torch.isinf(row[mag >= 2]).all()
    assert (row[mag == 1].abs() == 2.0**127).all() == (dtype != torch.float16)


def test_byte_255_is_where_transformers_differs_from_other_decoders():
    blocks, scales = _every_byte_pair()
    q = QuantizedTensor("mxfp4", "transformers", blocks.reshape(256, 256), scales[0], None,
                        (256, 512))
    for other in ("compressed-tensors", "triton-kernels", "rceil"):
        theirs = dequantize(QuantizedTensor("mxfp4", other, q.data, q.scale, None, q.shape))
        assert torch.isnan(theirs[255]).any(), other  # 0 * inf, or a NaN scale


SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), nb=st.integers(1, 3),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       sp=st.frozensets(st.sampled_from(SPECIALS), max_size=4))
def test_encode_is_the_gpt_oss_triton_kernels_transcription(seed, nb, dtype, sp):
    x = special_tensor(seed, (5, 32 * nb), dtype, sp)
    data, scale = triton_kernels_reference(x, "mxfp4", "gpt-oss")
    q = quantize(x, "mxfp4", "transformers")
    assert torch.equal(q.scale, scale), first_difference(q.scale, scale)
    assert torch.equal(q.data, data), first_difference(q.data, data, x)


def test_transformers_writes_only_mxfp4():
    assert "transformers" in FORMATS["mxfp4"].profiles
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2"):
        with pytest.raises(ValueError, match="transformers"):
            quantize(torch.ones(2, 32), fmt, "transformers")
