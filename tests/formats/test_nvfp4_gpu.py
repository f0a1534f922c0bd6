"""The NVFP4 reference is device-independent: on a CUDA GPU every profile gives the same scale
bytes, codes and decoded bits as on CPU. Skips without a GPU.

One exception, inherited from the libraries rather than made here: torchao's NaN codes come from
the NaN's payload bits (``_torchao_nan_codes``), and CUDA produces the canonical NaN 0x7FFFFFFF
where x86 gives 0x7FC00000/0xFFC00000, so torchao writes code 0x4 on GPU where it writes 0x3/0xB
on CPU; compressed-tensors' NaN codes are undefined. Those elements decode to NaN (their block
scale is NaN), so codes are compared where the decoded value is not NaN.

A second one: torchao and ModelOpt compute their global as ``amax / 2688.0`` (tensor by Python
scalar). On CUDA, PyTorch evaluates that as ``amax * fl(1/2688)``, a true division on CPU, so the
same library stores a global one ulp apart on the two devices for some amax. Given the same
stored global, everything else is device-independent.
"""

from __future__ import annotations

import pytest
import torch
from nvfp4_cases import same_bits

from workbench.formats.elements import unpack_fp4
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
    finite = torch.nan_to_num(x, nan=0.5, posinf=2.0)
    return [x, x.bfloat16(), x[1:2].clone(), finite]


def _decode(p, profile, dtype):
    return dequantize_nvfp4(p.data, p.scale, p.global_scale, profile, dtype,
                            library_global=p.library_global).cpu()


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cuda_matches_cpu_bit_for_bit(profile):
    for x in _inputs():
        amax_E11 = x.float().abs().nan_to_num(0.0).amax(dim=(1, 2), keepdim=True)
        for amax in (None, amax_E11):
            for tile_rows in ([1, 16] if profile == "te" else [1]):
                cpu = quantize_nvfp4_parts(x, profile, amax, tile_rows=tile_rows)
                gpu = quantize_nvfp4_parts(x.cuda(), profile, tile_rows=tile_rows,
                                           library_global=cpu.library_global.cuda())
                assert same_bits(cpu.scale, gpu.scale.cpu())
                for dtype in (torch.float32, torch.bfloat16):
                    assert same_bits(_decode(cpu, profile, dtype), _decode(gpu, profile, dtype))
                defined = ~torch.isnan(_decode(cpu, profile, torch.float32))
                assert torch.equal(unpack_fp4(cpu.data)[defined],
                                   unpack_fp4(gpu.data).cpu()[defined])
                if not torch.isnan(x).any():
                    assert torch.equal(cpu.data, gpu.data.cpu())


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_global_from_amax_on_cuda(profile):
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 100 + 1e-3
    cpu = PROFILES[profile].global_from_amax(amax)
    gpu = PROFILES[profile].global_from_amax(amax.cuda()).cpu()
    if PROFILES[profile].global_form == "decode":  # `amax / 2688.0`
        assert torch.equal(gpu, amax * torch.tensor(1.0 / 2688.0))
        assert torch.equal(cpu, (amax.double() / 2688.0).float())  # true division on CPU
    else:
        assert torch.equal(gpu, cpu)
