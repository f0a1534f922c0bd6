"""Per-expert quantization telemetry: the parquet table against the codecs, the data and EP."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from tests.train.conftest import TINY, run
from workbench.formats import fake_quantize, parse_recipe, quantize
from workbench.model import tiny
from workbench.qat.telemetry import code_churn, stack_stats
from workbench.train import distributed
from workbench.train.config import tiny as tiny_config
from workbench.train.expert_stats import ExpertStatsRecorder, read_expert_stats
from workbench.train.loop import train

BATCH, SEQ = 4, 32


def _in_process(out, recipe="mxfp4", steps=4, every=2, **kw):
    cfg = tiny_config(str(out), recipe=recipe, steps=steps, batch=BATCH, seq=SEQ, wandb="disabled",
                      warmup=2, ckpt_every=0, val_every=0, expert_stats_every=every, **kw)
    info = distributed.setup()
    result, model = train(cfg, info, return_model=True)
    return result, model


def test_last_record_equals_the_codec_on_the_final_masters(tmp_path):
    _, model = _in_process(tmp_path / "r", recipe="nvfp4", steps=4, every=2, export="bf16")
    df = read_expert_stats(tmp_path / "r")
    assert sorted(df["step"].unique()) == [0, 2, 4]
    last = df[df["step"] == 4].set_index(["layer", "expert", "proj"])
    r = parse_recipe("nvfp4")
    from safetensors.torch import load_file

    exported = {}
    for f in (tmp_path / "r" / "export").glob("*.safetensors"):
        exported.update(load_file(f))
    for layer, block in enumerate(model.model.layers):
        ex = block.mlp.experts
        for pname, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            w = getattr(ex, pname).detach()
            for e in range(w.shape[0]):
                we = w[e]
                # One global scale per expert, from the expert's own amax, as the seam does.
                fq = fake_quantize(we, r, global_amax=we.abs().amax().float())
                err = (fq - we).double()
                row = last.loc[(layer, e, proj)]
                assert row["rel_err"] == pytest.approx(
                    float(err.norm() / we.double().norm()), rel=1e-12)
                assert row["amax"] == float(we.abs().amax())
                # The exported BF16 weights are the masters rounded to BF16: the same error up
                # to that rounding.
                wb = exported[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"].float()
                fqb = fake_quantize(wb, r, global_amax=wb.abs().amax())
                assert row["rel_err"] == pytest.approx(
                    float((fqb - wb).norm() / wb.norm()), rel=0.05)


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4+mxfp8"])
def test_load_sums_to_topk_tokens_per_layer_and_interval(tmp_path, recipe):
    _in_process(tmp_path / "r", recipe=recipe, steps=6, every=3)
    df = read_expert_stats(tmp_path / "r")
    top_k = tiny().top_k
    tokens = BATCH * (SEQ + 1) * 3  # the trainer feeds seq + 1 tokens per sequence
    sums = df[df["step"] > 0].groupby(["step", "layer", "proj"])["load"].sum()
    assert (sums == top_k * tokens).all(), sums
    assert (df.loc[df["step"] == 0, "load"] == 0).all()
    if recipe == "mxfp4":
        assert df["act_amax"].isna().all()
    else:
        trained = df[df["step"] > 0]
        assert ((trained["act_amax"] > 0) == (trained["load"] > 0)).all()


def _same_table(other: pd.DataFrame, base: pd.DataFrame, continuous: tuple, shares: tuple,
                what: str) -> None:
    """Two layouts' tables of the same run. At step 0 the weights are the same bits, so only the
    order of the statistics' own sums may differ: 1e-6. After updates the layouts' weights differ
    by float summation order (gradients reduced over other rank sets), Adam turns that into more
    for elements whose gradient is near zero, and a weight on the other side of an FP4 rounding
    boundary moves by a whole step (tests/train/test_fsdp.py saw 1.3e-5 relative in the loss by
    step 3; here rel_err once differed by 1.7e-6 in one row of 144 on another CPU): 1e-4 for the
    continuous metrics, and at most two elements for the shares of elements (saturated, changed
    code). A table from the wrong rank, shard or step differs in every row by far more."""
    cfg = tiny()
    n = cfg.hidden_size * cfg.expert_ffn  # elements of each expert projection
    first = (base["step"] == 0).to_numpy()
    assert first.any() and (~first).any(), "the tables need a step-0 record and a later one"
    for col in continuous:
        for rows, rtol in ((first, 1e-6), (~first, 1e-4)):
            pd.testing.assert_series_equal(other[col][rows], base[col][rows], rtol=rtol,
                                           check_names=False, obj=f"{col} ({what})")
    for col in shares:
        pd.testing.assert_series_equal(other[col], base[col], rtol=0, atol=2.001 / n,
                                       check_names=False, obj=f"{col} ({what})")


@pytest.mark.distributed
def test_expert_parallel_gives_the_same_table_as_ep1(tmp_path):
    tables = {}
    for nproc in (1, 2, 4):
        out = tmp_path / f"ep{nproc}"
        run(nproc, [*TINY, "--recipe", "mxfp4", "--steps", "4", "--out", str(out),
                    "--ckpt-every", "0", "--val-every", "0", "--expert-stats-every", "2"])
        tables[nproc] = read_expert_stats(out).sort_values(["step", "layer", "expert", "proj"])
    base = tables[1].reset_index(drop=True)
    for nproc in (2, 4):
        other = tables[nproc].reset_index(drop=True)
        assert list(other["expert"]) == list(base["expert"])
        assert list(other["load"]) == list(base["load"])
        _same_table(other, base, ("rel_err", "sqnr_db", "amax"), ("sat_frac", "churn"),
                    f"EP{nproc}")


@pytest.mark.distributed
def test_fsdp_layouts_give_the_same_table_as_one_process(tmp_path):
    """EP1 x FSDP2 (world 2: every expert split between the ranks) and EP2 x FSDP2 (world 4).
    With MXFP8 activations, so `act_amax` needs the max over the dp ranks (each saw its own
    tokens); rows come once per expert (dp rank 0 of each EP slice). Tolerances as the EP test's:
    the layouts train the same function up to float summation order (docs/fsdp.md)."""
    def table(nproc, flags):
        out = tmp_path / f"w{nproc}{'_'.join(flags)}"
        run(nproc, [*TINY, "--recipe", "mxfp4+mxfp8", "--steps", "4", "--out", str(out),
                    "--ckpt-every", "0", "--val-every", "0", "--expert-stats-every", "2", *flags])
        df = read_expert_stats(out).sort_values(["step", "layer", "expert", "proj"])
        return df.reset_index(drop=True)

    base = table(1, [])
    assert base["act_amax"].notna().any()
    for nproc, ep in ((2, "1"), (4, "2")):
        other = table(nproc, ["--ep", ep, "--fsdp"])
        assert list(other["expert"]) == list(base["expert"]), (nproc, len(other), len(base))
        assert list(other["step"]) == list(base["step"])
        assert list(other["load"]) == list(base["load"])
        _same_table(other, base, ("rel_err", "sqnr_db", "amax", "act_amax"),
                    ("sat_frac", "churn"), f"world {nproc}")
        assert list(other["scale_exp_hist"].map(list)) == list(base["scale_exp_hist"].map(list))


def test_saturation_and_clipping_against_constructed_blocks():
    # One block of 32 per row: amax 6 * 2^-3 lands exactly on the largest FP4 code under RCEIL
    # (one saturated, nothing clipped); under FLOOR an amax of 7 * 2^-3 is clipped to 6 * 2^-3.
    w = torch.full((2, 4, 32), 0.01)
    w[0, :, 5] = 6 * 2**-3
    w[1, :, 5] = 7 * 2**-3
    st = stack_stats(w, parse_recipe("mxfp4:rceil"))
    assert st.sat_frac.tolist()[0] == pytest.approx(1 / 32)
    assert st.clip_frac.tolist() == [0.0, 0.0]
    fl = stack_stats(w, parse_recipe("mxfp4:floor"))
    assert fl.clip_frac.tolist() == [0.0, pytest.approx(1 / 32)]
    # The scale histogram counts every block once, at its exponent.
    q = quantize(w[0], "mxfp4:rceil")
    assert st.scale_hist[0].sum() == 4
    assert int(st.scale_hist[0].nonzero().item()) - 127 == int(q.scale[0, 0]) - 127


def test_churn_counts_changed_codes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, 64, generator=g)
    r = parse_recipe("mxfp4")
    a = stack_stats(w, r)
    assert code_churn(a.codes, stack_stats(w.clone(), r).codes).tolist() == [0, 0, 0]
    moved = w.clone()
    moved[1] = -moved[1]  # every code flips its sign bit (RCEIL keeps the sign of a zero too)
    moved[2, :4] *= 4.0  # a power of two moves only the block scales: no code changes
    moved[0, 0, :32] = 0.0  # one block of expert 0 becomes zeros
    b = stack_stats(moved, r)
    q0 = quantize(w[0, 0, :32], r).data  # that block's 16 bytes
    changed = int(((q0 & 0xF) != 0).sum() + ((q0 >> 4) != 0).sum())
    assert code_churn(a.codes, b.codes).tolist() == [changed / (8 * 64), 1.0, 0.0]


def test_dead_experts_need_consecutive_zero_intervals():
    rec = ExpertStatsRecorder.__new__(ExpertStatsRecorder)  # the summary logic alone
    rec.layers, rec.E, rec.dead_intervals, rec._zero_streak = [0], 3, 2, {}
    rows = [{"rel_err": 0.1, "churn": math.nan}, {"rel_err": 0.3, "churn": 0.5}]
    s0 = rec._summary(rows, [[0.0, 0.0, 0.0]], 0)  # step 0 has seen no tokens: not counted
    assert (s0["experts_zero_load"], s0["experts_dead"]) == (0, 0)
    s1 = rec._summary(rows, [[0.0, 5.0, 0.0]], 1)
    assert (s1["experts_zero_load"], s1["experts_dead"]) == (2, 0)
    s2 = rec._summary(rows, [[0.0, 0.0, 1.0]], 2)
    assert (s2["experts_zero_load"], s2["experts_dead"]) == (2, 1)  # expert 0: two in a row
    s3 = rec._summary(rows, [[0.0, 0.0, 0.0]], 3)
    assert (s3["experts_zero_load"], s3["experts_dead"]) == (3, 2)
    assert s3["expert_worst_rel_err"] == 0.3 and s3["expert_mean_churn"] == 0.5


def test_bf16_runs_and_zero_interval_write_no_table(tmp_path):
    _in_process(tmp_path / "b", recipe="bf16", steps=2, every=1)
    assert not (tmp_path / "b" / "expert_stats.parquet").exists()
    _in_process(tmp_path / "z", recipe="mxfp4", steps=2, every=0)
    with pytest.raises(FileNotFoundError, match="no expert statistics"):
        read_expert_stats(tmp_path / "z")
