"""build(): a model whose weights --init or a checkpoint will overwrite is built on the meta
device and allocated without the seeded draw; it must end up exactly the model the loaders fill."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY

from workbench.model import MoEForCausalLM, tiny
from workbench.model.pretrained import materialize
from workbench.train import distributed
from workbench.train.args import config_from_args
from workbench.train.build import build


def _no_draw(self, seed=0):
    raise AssertionError("reset_parameters ran although the weights are overwritten")


def test_init_build_skips_the_draw_and_holds_the_init_weights(tmp_path, monkeypatch):
    from workbench.train.export import export_model

    src = MoEForCausalLM(tiny(), seed=3)
    path = export_model(src, tmp_path / "bf16", fmt="bf16")
    ref = MoEForCausalLM(tiny(), seed=3)  # the same weights, through the ordinary build + load
    from workbench.train.init import load_init

    info = distributed.setup()
    load_init(path, ref, info)
    cfg = config_from_args([*TINY, "--out", str(tmp_path / "run"), "--init", str(path)])
    monkeypatch.setattr(MoEForCausalLM, "reset_parameters", _no_draw)
    model = build(cfg, info).model
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), name
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)


def test_fresh_build_still_draws_the_seeded_init(tmp_path):
    cfg = config_from_args([*TINY, "--out", str(tmp_path / "run"), "--seed", "4"])
    model = build(cfg, distributed.setup()).model
    ref = MoEForCausalLM(tiny(), seed=4)
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("tied", [False, True])
def test_materialize_matches_the_constructor(tied):
    mcfg = dataclasses.replace(tiny(), tie_embeddings=tied)
    ref = MoEForCausalLM(mcfg, seed=1)
    model = materialize(MoEForCausalLM(mcfg, seed=9, device="meta"), torch.device("cpu"))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, mcfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.inductor_cpp
def test_compiled_layers_train_like_the_eager_ones(tmp_path):
    """--compile: each decoder layer runs compiled (a graph per layer kind), the losses of a few
    steps stay those of the eager model within fused rounding, and the masters are the same
    objects (the optimizer and QAT hold them)."""
    from workbench.train.data import load_corpus
    from workbench.train.loop import train_step

    info = distributed.setup()
    tokens = load_corpus().train
    losses = {}
    for flag in ([], ["--compile"]):
        cfg = config_from_args([*TINY, "--recipe", "mxfp4", "--out", str(tmp_path / "r"), *flag])
        torch.manual_seed(0)
        b = build(cfg, info)
        compiled = [layer._compiled_call_impl is not None for layer in b.model.model.layers]
        assert all(compiled) == cfg.compile and any(compiled) == cfg.compile
        params = {id(p) for p in b.model.parameters()}
        losses[cfg.compile] = [train_step(b.model, b.opt, b.sched, tokens, cfg, info, s)["loss"]
                               for s in range(1, 4)]
        assert params == {id(p) for p in b.model.parameters()}
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-5)


def test_a_run_as_long_as_the_model_allows_trains(tmp_path):
    """--seq equal to the model's max_seq_len: each batch row holds seq + 1 tokens (the last one
    only a label), so the model is built to take them."""
    from workbench.train.build import model_config
    from workbench.train.data import load_corpus
    from workbench.train.loop import train_step

    seq = tiny().max_seq_len
    cfg = config_from_args([*TINY, "--seq", str(seq), "--batch", "2",
                            "--out", str(tmp_path / "r")])
    assert model_config(cfg).max_seq_len == seq + 1
    info = distributed.setup()
    b = build(cfg, info)
    rec = train_step(b.model, b.opt, b.sched, load_corpus().train, cfg, info, 1)
    assert rec["loss"] > 0
