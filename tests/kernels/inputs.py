"""Inputs for the kernel tests: Gaussian data and an adversarial "specials" tensor (NaN, +-inf,
-0.0, subnormals, zero blocks, scale-rule edges, E2M1 ties, huge and tiny blocks), and the
bit-exact comparisons (NaN positions must agree; NaN payloads are not compared)."""

from __future__ import annotations

import torch


def gaussian(shape, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # per-row exponent spread so blocks land on many scale bytes
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape[:-1] + (1,),
                                                                   generator=g).float())
    return x.to(dtype).to(device)


def specials(rows: int, k: int, dtype=torch.bfloat16, seed=1, with_nan=True, device="cpu"):
    """[rows, k] (k a multiple of 32): each 32-wide block is one kind of edge case."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    blocks = x.view(rows, k // 32, 32)
    nb = blocks.shape[0] * blocks.shape[1]
    flat = blocks.reshape(nb, 32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0], dtype=torch.float64)
    amaxes = [7.0, 6.1, 5.0, 6.0, 8.0, 448.0, 449.0, 57344.0, 1.75, 1.5, 0.75, 3.0 * 2.0**100]
    for i in range(nb):
        kind = i % 16
        row = flat[i]
        if kind == 0:
            row.zero_()
        elif kind == 1:
            row.mul_(2.0**-128)  # subnormal region: byte-0 blocks
        elif kind == 2:
            row.mul_(2.0**120)  # near the top of the exponent range
        elif kind == 3 and with_nan:
            row[5] = float("nan")
        elif kind == 4:
            row[7] = float("inf")
        elif kind == 5:
            row[3] = float("-inf")
        elif kind == 6:
            row.zero_()
            row[::2] = -0.0
            row[1] = -(2.0**-140)
        elif kind == 7:
            row[:] = ties[torch.randint(0, len(ties), (32,), generator=g)] * torch.where(
                torch.rand(32, generator=g) < 0.5, -1.0, 1.0)
            row[0] = 6.0  # amax 6: the E2M1 ties sit at scale 1
        elif kind == 8:
            a = amaxes[i // 16 % len(amaxes)]
            row.clamp_(-a * 0.9, a * 0.9)
            row[2] = -a
        elif kind == 9:
            row.mul_(2.0**-135)
        elif kind == 10 and with_nan:
            row[:] = float("nan")
        elif kind == 11:
            row[:] = 2.0**-149 * torch.randint(-3, 4, (32,), generator=g).double()
        elif kind == 12:
            row.mul_(1e-3)
            row[9] = 3.3e38
    x = x.to(dtype)
    # one NaN payload: torch's vectorised casts write 0x7FFF as well as 0x7FC0 (bf16), and which
    # NaN a reduction returns when payloads differ is order-dependent (NVFP4 torchao's codes of
    # NaN-scaled blocks read the global amax's payload); the kernels keep the max payload
    x[torch.isnan(x)] = float("nan")
    return x.to(device)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    """Bit-exact equality of two float or uint8 tensors; NaNs must sit at the same places."""
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype == torch.uint8:
        bad = a != b
    else:
        af, bf = a.float(), b.float()
        an, bn = torch.isnan(af), torch.isnan(bf)
        assert torch.equal(an, bn), f"{what}: NaN positions differ ({(an != bn).sum()} elements)"
        ia = a.view(torch.uint8 if a.element_size() == 1 else
                    {2: torch.int16, 4: torch.int32}[a.element_size()])
        ib = b.view(ia.dtype)
        bad = (ia != ib) & ~an
    n = int(bad.sum())
    if n:
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {n} elements differ, first at {idx}: "
                             f"{a[tuple(idx)]!r} vs {b[tuple(idx)]!r}")
