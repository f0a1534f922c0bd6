"""FakeQuantTimer: counts and times each forward fake quantization of workbench.qat once."""

from __future__ import annotations

import time

import pytest
import torch

from workbench.formats import parse_recipe
from workbench.model import GroupedExperts, MoEForCausalLM, tiny
from workbench.qat import ste
from workbench.qat.ste import fake_quant_ste
from workbench.train.fqtime import FakeQuantTimer


def test_one_call_per_fake_quantization_and_time_within_the_block():
    model = MoEForCausalLM(tiny(), seed=0)
    from workbench.qat import prepare

    prepare(model, recipe="mxfp4+mxfp8", scope="routed-experts")
    # Independent count: each grouped GEMM fake-quantizes its weight stack and its input once
    # per forward; three grouped GEMMs (gate, up, down) per expert block.
    blocks = sum(isinstance(m, GroupedExperts) for m in model.modules())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with FakeQuantTimer() as timer:
        assert timer.available
        t0 = time.perf_counter()
        model(ids, labels_BS=ids).loss.backward()  # the STE backward adds no call
        wall = time.perf_counter() - t0
        seconds, calls = timer.take()
        assert calls == 3 * 2 * blocks
        assert 0.0 < seconds < wall
        assert timer.take() == (0.0, 0)  # take() resets


def test_a_transposed_call_is_counted_once_and_the_hook_is_removed_on_error():
    orig = ste._fq
    x = torch.randn(64, 8)
    with pytest.raises(RuntimeError, match="boom"), FakeQuantTimer() as timer:
        y = fake_quant_ste(x, parse_recipe("mxfp4"), dim=0)  # _fq recurses on the transpose
        assert timer.take()[1] == 1
        assert ste._fq is not orig
        raise RuntimeError("boom")
    assert ste._fq is orig
    # the timed call returned the codec's own result
    torch.testing.assert_close(y, ste.fake_quant_reference(x, parse_recipe("mxfp4"), dim=0),
                               rtol=0, atol=0)


def test_nothing_is_timed_outside_the_block():
    with FakeQuantTimer() as timer:
        pass
    fake_quant_ste(torch.randn(4, 32), parse_recipe("mxfp4"))
    assert timer.take() == (0.0, 0)
