"""The NVFP4 reference is device-independent: on a CUDA GPU every profile gives the same bytes and
decoded bits as on CPU (the libraries' own torch expressions are reused, so this also holds for
them). Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from workbench.formats.nvfp4 import PROFILES, dequantize_nvfp4, quantize_nvfp4_parts

pytestmark = pytest.mark.gpu


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, 256, generator=g) * torch.logspace(-3, 3, 4).reshape(4, 1, 1)
    x[0, 0, :16] = 0.0
    x[1, 1, 3] = float("nan")
    x[2, 2, 5] = float("inf")
    x[3, 3, 7] = -0.0
    x[3, 4, :] = 1e-40
    return [x, x.bfloat16(), x[1:2].clone()]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cuda_matches_cpu_bit_for_bit(profile):
    for x in _inputs():
        amax_E11 = x.float().abs().nan_to_num(0.0).amax(dim=(1, 2), keepdim=True)
        for amax in (None, amax_E11):
            tiles = [1, 16] if profile == "te" else [1]
            for tile_rows in tiles:
                cpu = quantize_nvfp4_parts(x, profile, amax, tile_rows=tile_rows)
                gpu = quantize_nvfp4_parts(x.cuda(), profile,
                                           None if amax is None else amax.cuda(),
                                           tile_rows=tile_rows)
                assert torch.equal(cpu.data, gpu.data.cpu())
                assert torch.equal(cpu.scale.view(torch.uint8), gpu.scale.view(torch.uint8).cpu())
                assert torch.equal(cpu.library_global.view(torch.int32),
                                   gpu.library_global.cpu().view(torch.int32))
                for dtype in (torch.float32, torch.bfloat16):
                    a = dequantize_nvfp4(cpu.data, cpu.scale, cpu.global_scale, profile, dtype,
                                         library_global=cpu.library_global)
                    b = dequantize_nvfp4(gpu.data, gpu.scale, gpu.global_scale, profile, dtype,
                                         library_global=gpu.library_global).cpu()
                    nan = torch.isnan(a.float())
                    assert torch.equal(nan, torch.isnan(b.float()))
                    assert torch.equal(a[~nan], b[~nan]) and torch.equal(
                        torch.signbit(a[~nan]), torch.signbit(b[~nan]))
