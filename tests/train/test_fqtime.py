"""FakeQuantTimer: counts and times each forward fake quantization of workbench.qat once."""

from __future__ import annotations

import time

import pytest
import torch

from workbench.formats import parse_recipe
from workbench.model import GroupedExperts, MoEForCausalLM, tiny
from workbench.qat import fake_quant_reference, fake_quant_ste
from workbench.train.fqtime import FakeQuantTimer


def test_one_call_per_fake_quantization_and_time_within_the_block():
    model = MoEForCausalLM(tiny(), seed=0)
    from workbench.qat import prepare

    prepare(model, recipe="mxfp4+mxfp8", scope="routed-experts")
    # Independent count, per expert block and forward: three weight stacks (gate, up, down) and
    # two activations, the block's input (gate and up read the same tensor, quantized once for
    # both) and the down projection's input.
    blocks = sum(isinstance(m, GroupedExperts) for m in model.modules())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with FakeQuantTimer() as timer:
        assert timer.available
        t0 = time.perf_counter()
        model(ids, labels_BS=ids).loss.backward()  # the STE backward adds no call
        wall = time.perf_counter() - t0
        seconds, calls = timer.take()
        assert calls == (3 + 2) * blocks
        assert 0.0 < seconds < wall
        assert timer.take() == (0.0, 0)  # take() resets


def test_a_transposed_call_is_counted_once_and_the_hook_is_removed_on_error():
    x = torch.randn(64, 8)
    with pytest.raises(RuntimeError, match="boom"), FakeQuantTimer() as timer:
        y = fake_quant_ste(x, parse_recipe("mxfp4"), dim=0)  # blocks along dim 0: a transpose
        assert timer.take()[1] == 1
        raise RuntimeError("boom")
    assert not timer.available
    fake_quant_ste(x, parse_recipe("mxfp4"), dim=0)  # after the error: no longer timed
    assert timer.take() == (0.0, 0)
    # the timed call returned the codec's own result
    torch.testing.assert_close(y, fake_quant_reference(x, parse_recipe("mxfp4"), dim=0),
                               rtol=0, atol=0)


def test_nested_timers_each_count_and_leave_in_any_order():
    x = torch.randn(4, 32)
    outer, inner = FakeQuantTimer().__enter__(), FakeQuantTimer().__enter__()
    fake_quant_ste(x, parse_recipe("mxfp4"))
    outer.__exit__(None, None, None)  # the outer one leaves first: the inner keeps timing
    fake_quant_ste(x, parse_recipe("mxfp4"))
    inner.__exit__(None, None, None)
    fake_quant_ste(x, parse_recipe("mxfp4"))
    assert outer.take()[1] == 1 and inner.take()[1] == 2


def test_nothing_is_timed_outside_the_block():
    with FakeQuantTimer() as timer:
        pass
    fake_quant_ste(torch.randn(4, 32), parse_recipe("mxfp4"))
    assert timer.take() == (0.0, 0)
