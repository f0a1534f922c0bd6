"""Block-scale rules, exhaustively: every positive finite bf16 value as a block amax.

Each row is one block ``[a, -a/3, a/7, 0, ...]`` for ``a`` over all 32639 positive finite bf16
numbers, quantized with a fixed global amax (calibrated below, at, and above the data) by each
library and by the matching profile; block scales, codes and decoded values must agree bit for
bit. This sweeps e4m3 rounding ties, the subnormal e4m3 range, every library's floor and clamp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvfp4_cases import first_difference, same_bits

from workbench.formats.elements import unpack_fp4
from workbench.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_parts

GLOBAL_AMAXES = [1.0, 2688.0, 3.0e5, 1.0e-30]


@pytest.fixture(scope="module")
def every_bf16_amax() -> torch.Tensor:
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(a.numel(), 16, dtype=torch.bfloat16)
    x[:, 0] = a
    x[:, 1] = -a / 3
    x[:, 2] = a / 7
    return x


def ours(x: torch.Tensor, profile: str, amax: float):
    p = quantize_nvfp4_parts(x, profile, torch.tensor(amax))
    return p, dequantize_nvfp4(p.data, p.scale, p.global_scale, profile, torch.float32,
                               library_global=p.library_global)


@pytest.mark.parametrize("amax", GLOBAL_AMAXES)
def test_torchao(every_bf16_amax, amax):
    nvt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    x = every_bf16_amax
    pts = nvt.per_tensor_amax_to_scale(torch.tensor(amax))
    t = nvt.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
    p, deq = ours(x, "torchao", amax)
    assert same_bits(p.scale, t.scale), first_difference(p.scale.float(), t.scale.float())
    assert torch.equal(p.data, t.qdata)
    assert same_bits(deq, t.dequantize(torch.float32))


@pytest.mark.parametrize("amax", GLOBAL_AMAXES)
def test_modelopt(every_bf16_amax, amax):
    q = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    x = every_bf16_amax
    wsf2 = torch.tensor(amax) / 2688.0
    qt, wsf, wsf2 = q.NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=wsf2)
    p, _ = ours(x, "modelopt-export", amax)
    assert same_bits(p.scale, wsf), first_difference(p.scale.float(), wsf.float())
    assert torch.equal(p.data, qt._quantized_data)
    deq = qt.dequantize(torch.float32, scale=wsf, double_scale=wsf2, block_sizes={-1: 16})
    mine = dequantize_nvfp4(p.data, p.scale, p.global_scale, "modelopt-export", torch.float32)
    assert same_bits(mine, deq)


@pytest.mark.parametrize("amax", GLOBAL_AMAXES)
def test_compressed_tensors(every_bf16_amax, amax):
    ctq = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = ctq.preset_name_to_scheme("NVFP4A16", ["Linear"])
    x = every_bf16_amax
    xb = x.reshape(x.shape[0], 1, 16)  # the weight's own (bf16) statistics
    g = generate_gparam(torch.tensor(-amax), torch.tensor(amax))
    scale, _ = calculate_qparams(xb.amin(-1), xb.amax(-1), scheme.weights, global_scale=g)
    sd = NVFP4PackedCompressor.compress({"weight": x, "weight_scale": scale,
                                         "weight_global_scale": g}, scheme)
    p, _ = ours(x, "compressed-tensors", amax)
    assert same_bits(p.library_global, g.reshape(()))
    assert same_bits(p.scale, sd["weight_scale"]), \
        first_difference(p.scale.float(), sd["weight_scale"].float())
    assert torch.equal(p.data, sd["weight_packed"])
    deq = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
    mine = dequantize_nvfp4(p.data, p.scale, p.global_scale, "compressed-tensors",
                            torch.bfloat16, library_global=g)
    assert same_bits(mine, deq)


@pytest.mark.parametrize("amax", GLOBAL_AMAXES)
def test_te_transcription(every_bf16_amax, amax):
    pytest.importorskip("ml_dtypes")
    from nvfp4_te_oracle import te_reference

    x = every_bf16_amax
    codes, scale, decoded = te_reference(x.float().numpy(), np.float32(amax))
    p, deq = ours(x, "te", amax)
    assert torch.equal(p.scale.view(torch.uint8), torch.from_numpy(scale))
    assert torch.equal(unpack_fp4(p.data), torch.from_numpy(codes))
    assert same_bits(deq, torch.from_numpy(decoded))
