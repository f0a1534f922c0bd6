"""Assertions shared by the oracle tests: workbench.checkpoint against a third-party decode."""

from __future__ import annotations

import torch
from oracles import Oracle

# Row/column windows that are not block-aligned for MX (32), NVFP4 (16) or FP8 (128) blocks.
SLICES = [
    (slice(3, 41), slice(5, 70)),
    (slice(None), slice(17, 18)),
    (slice(10, 11), slice(None)),
    (slice(0, 64), slice(31, 33)),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """BF16 bit pattern, so -0.0 != +0.0 and NaN == NaN when payloads match."""
    assert t.dtype == torch.bfloat16, t.dtype
    return t.contiguous().view(torch.int16)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.bfloat16, f"{what}: dtype {got.dtype}, want bfloat16"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    diff = bits(got) != bits(want)
    if diff.any():
        value_diff = ~((got == want) | (got.isnan() & want.isnan()))
        idx = diff.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(diff.sum())} of {diff.numel()} elements differ in bits "
            f"({int(value_diff.sum())} in value, the rest sign of zero); first at {idx}: "
            f"workbench {got[tuple(idx)].item()!r} vs oracle {want[tuple(idx)].item()!r}")


def check_layout_and_records(ck, oracle: Oracle) -> None:
    assert ck.layout == oracle.layout
    records = list(ck.experts())
    keys = [(r.layer, r.expert, r.proj) for r in records]
    assert len(keys) == len(set(keys)), "duplicate expert records"
    assert set(keys) == set(oracle.experts), sorted(set(keys) ^ set(oracle.experts))[:6]
    for r in records:
        assert tuple(r.shape) == tuple(oracle.experts[(r.layer, r.expert, r.proj)].shape), r


def check_expert_values(ck, oracle: Oracle) -> None:
    for (layer, e, proj), want in oracle.experts.items():
        view = ck.expert_weight(layer, e, proj)
        assert tuple(view.shape) == tuple(want.shape)
        assert_bits_equal(view.materialize(), want, f"L{layer} E{e} {proj}")


def check_expert_slices(ck, oracle: Oracle) -> None:
    for (layer, e, proj), want in oracle.experts.items():
        if (e + layer) % 2:  # half the experts keep the test fast; values are checked above
            continue
        view = ck.expert_weight(layer, e, proj)
        for rows, cols in SLICES:
            assert_bits_equal(view[rows, cols], want[rows, cols],
                              f"L{layer} E{e} {proj}[{rows}, {cols}]")


def check_scope(ck, oracle: Oracle) -> None:
    """Quantized-or-not as the writing library decided it (what it stored packed)."""
    for r in ck.experts():
        assert ck.scope.is_quantized(r.name), (r.name, ck.scope.reason(r.name))
        assert ck.scope.reason(r.name)
    names = set(ck.logical_names())
    for name in sorted(oracle.quantized):
        if name in names:
            assert ck.scope.is_quantized(name), (name, ck.scope.reason(name))
    missing = sorted(n for n in oracle.dense if n not in names)
    assert not missing, f"plain tensors not listed by logical_names(): {missing[:5]}"
    for name in sorted(oracle.dense):
        assert not ck.scope.is_quantized(name), (name, ck.scope.reason(name))
        assert ck.scope.reason(name)


def check_all(ck, oracle: Oracle) -> None:
    check_layout_and_records(ck, oracle)
    check_scope(ck, oracle)
    check_expert_values(ck, oracle)
    check_expert_slices(ck, oracle)
