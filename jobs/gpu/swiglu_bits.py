"""Whether the fused SwiGLU kernels (workbench/kernels/_mx_kernel.py) compute torch's CUDA bits:
silu for every bf16 input, the forward's fake quantization of silu(g) * u, and the backward
(du, and dg for both values of CONTRACT) against torch's autograd of ``F.silu(g) * u``.

    python jobs/gpu/swiglu_bits.py [--rounds 8]

Every bf16 gate value, each round with new random incoming gradients and up values at another
scale. One line per check: differing elements (NaN equal to NaN). Keep the CONTRACT whose dg line
reads 0 (kernels.api.SILU_BACKWARD_CONTRACT); the last line names it, or says neither matched.
Exit 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's workbench

from workbench import kernels as K  # noqa: E402
from workbench.formats import fake_quantize  # noqa: E402


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    a, b = a.float(), b.float()
    same = (a == b) | (a.isnan() & b.isnan())
    return int((~same).sum())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_bits: needs a CUDA GPU (the question is torch's CUDA bits)")
    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = g.reshape(-1, 256).cuda()
    ones = torch.ones_like(g)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {g.numel()} bf16 gates")
    print(f"silu over every bf16: {_diff(K.silu_mul_backward(ones, g, ones)[1], F.silu(g))} differ")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = {True: 0, False: 0}
    for r in range(args.rounds):
        dq = (torch.randn(g.shape, generator=gen, device="cuda") * 4.0 ** (r % 4 - 1)).bfloat16()
        u = (torch.randn(g.shape, generator=gen, device="cuda") * 2.0 ** (r % 3 - 1)).bfloat16()
        q = K.silu_mul_fake_quantize(g, u, "mxfp8_e4m3")
        ref_q = fake_quantize((F.silu(g) * u).cpu(), "mxfp8_e4m3")
        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
        (F.silu(gl) * ul).backward(dq)
        line = [f"round {r}: q {_diff(q.cpu(), ref_q)}"]
        for contract in (True, False):
            dg, du = K.silu_mul_backward(dq, g, u, contract=contract)
            n = _diff(dg, gl.grad)
            bad[contract] += n
            line.append(f"CONTRACT={contract}: dg {n} du {_diff(du, ul.grad)}")
        print(", ".join(line), flush=True)
    good = [c for c, n in bad.items() if n == 0]
    print(f"torch's silu_backward bits: CONTRACT={good[0]}" if good else
          "neither CONTRACT gives torch's silu_backward bits")


if __name__ == "__main__":
    main()
