"""Inputs and comparisons shared by the NVFP4 tests (no expected values live here).

``special_tensors`` draws [rows, 16*blocks] tensors whose blocks mix ordinary data with the
values libraries disagree on: NaN, +-inf, -0.0, fp32 subnormals, all-zero blocks, E2M1 ties and
binade edges after scaling, and whole-tensor zeros.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

BLOCK = 16
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 1e-45)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, except that any NaN equals any NaN (payloads are not data)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    a32, b32 = a.float(), b.float()
    nan_a, nan_b = torch.isnan(a32), torch.isnan(b32)
    if not torch.equal(nan_a, nan_b):
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b])


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """A readable pointer to where two tensors first differ, for assertion messages."""
    diff = (a.float() != b.float()) & ~(torch.isnan(a.float()) & torch.isnan(b.float()))
    if not diff.any():
        return "no value difference (signs of zero or dtype)"
    idx = tuple(int(i) for i in diff.nonzero()[0])
    return f"first difference at {idx}: ours {a[idx].item()!r} vs library {b[idx].item()!r}"


@st.composite
def special_tensors(draw, *, allow_nonfinite: bool = True, max_rows: int = 4, max_blocks: int = 3):
    rows = draw(st.integers(1, max_rows))
    blocks = draw(st.integers(1, max_blocks))
    n = rows * blocks * BLOCK
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    log_scale = draw(st.floats(-30, 30))
    x = rng.standard_normal(n).astype(np.float32) * np.float32(2.0**log_scale)
    kind = draw(st.sampled_from(["gaussian", "grid", "zeros", "tiny"]))
    if kind == "grid":
        # Values on and between E2M1 points after scaling by a power of two: exercises ties.
        grid = np.array([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7])
        x = (rng.choice(grid, n) * rng.choice([-1, 1], n)).astype(np.float32)
        x *= np.float32(2.0 ** draw(st.integers(-20, 20)))
    elif kind == "zeros":
        x[:] = 0.0
    elif kind == "tiny":
        x = (rng.standard_normal(n) * 1e-39).astype(np.float32)
    specials = [s for s in SPECIALS if allow_nonfinite or np.isfinite(s)]
    for _ in range(draw(st.integers(0, 6))):
        x[draw(st.integers(0, n - 1))] = draw(st.sampled_from(specials))
    if draw(st.booleans()):
        b = draw(st.integers(0, rows * blocks - 1))
        x[b * BLOCK:(b + 1) * BLOCK] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return torch.from_numpy(x.reshape(rows, blocks * BLOCK)).to(dtype)


def gaussian(shape, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(10 * torch.log10(x.pow(2).mean() / (x - y).pow(2).mean()))
