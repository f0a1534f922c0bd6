"""NVFP4 quantize / fake_quantize under ``torch.compile(fullgraph=True)``: no graph break (QAT
compiles its fake-quant), and the same bytes as eager, NaN/inf/-0.0 specials included."""

from __future__ import annotations

import pytest
import torch
from nvfp4_cases import gaussian, same_bits

from workbench.formats import fake_quantize, quantize
from workbench.formats.constants import NVFP4_PROFILES


def _compiled(fn):
    torch._dynamo.reset()  # each case traces afresh: a cached graph would hide a break
    return torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=False)


def _with_specials(dtype: torch.dtype) -> torch.Tensor:
    x = gaussian((4, 64), dtype, seed=5, scale=3.0)
    x[0, 3], x[1, 17], x[2, 40] = float("nan"), float("inf"), -0.0
    x[3, :16] = 0.0
    return x


@pytest.mark.parametrize("profile", NVFP4_PROFILES)
def test_fullgraph_compile_gives_the_eager_bytes(profile):
    # ordinary bf16 weights, and fp32 with specials (the NaN-code selection is traced too)
    for x in (gaussian((8, 64), torch.bfloat16, seed=11, scale=0.7), _with_specials(torch.float32)):
        q_c = _compiled(lambda t: quantize(t, "nvfp4", profile))(x)
        q_e = quantize(x, "nvfp4", profile)
        assert torch.equal(q_c.data, q_e.data), profile
        assert same_bits(q_c.scale, q_e.scale) and same_bits(q_c.global_scale, q_e.global_scale)
        assert same_bits(q_c.library_global, q_e.library_global)
        y_c = _compiled(lambda t: fake_quantize(t, "nvfp4", profile))(x)
        assert same_bits(y_c, fake_quantize(x, "nvfp4", profile)), profile


def test_fullgraph_compile_of_per_expert_globals():
    x = gaussian((2, 16, 32), seed=12)
    amax_E11 = x.abs().amax(dim=(1, 2), keepdim=True)
    fn = _compiled(lambda t, a: fake_quantize(t, "nvfp4", "te", global_amax=a))
    assert same_bits(fn(x, amax_E11), fake_quantize(x, "nvfp4", "te", global_amax=amax_E11))
