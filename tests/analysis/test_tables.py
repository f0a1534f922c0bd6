"""Per-expert error tables against an independent computation with torchao and numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from analysis_ckpts import moe_weights, write_dense

from workbench.analysis import ErrorTables, candidate_errors, reference_errors, stored_vs_recipes
from workbench.checkpoint import open_checkpoint


def torchao_fake_quant(w: torch.Tensor, recipe: str):
    """(dequantized fp32, scale bytes or block scales, elem codes) computed by torchao."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    fmt, _, prof = recipe.partition(":")
    if fmt == "mxfp4":
        t = MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode[prof.upper()])
        deq = t.dequantize(torch.float32)
        return deq, _codes(t.qdata)
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    pts = per_tensor_amax_to_scale(w.float().abs().amax())
    s, data = nvfp4_quantize(w, per_tensor_scale=pts)
    return _nvfp4_dequant(data, s, pts), _codes(data)


def _codes(packed):
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], -1).flatten(-2)


def _nvfp4_dequant(data, s, pts):
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])
    b = data.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], -1).flatten(-2).long()
    v = lut[codes].reshape(*codes.shape[:-1], -1, 16)
    return (v * (s.float() * pts).unsqueeze(-1)).flatten(-2)


def numpy_metrics(w: torch.Tensor, deq: torch.Tensor, codes: torch.Tensor):
    a, b = w.double().numpy(), deq.double().numpy()
    err = b - a
    saturated = (codes.numpy() & 7) == 7
    return {
        "rel_err": np.linalg.norm(err) / np.linalg.norm(a),
        "sqnr_db": 10 * np.log10((a * a).sum() / (err * err).sum()),
        "max_abs_err": np.abs(err).max(),
        "cosine": (a * b).sum() / (np.linalg.norm(a) * np.linalg.norm(b)),
        "amax": np.abs(a).max(),
        "clip_frac": (saturated & (np.abs(a) > np.abs(b))).mean(),
        "zero_frac": ((codes.numpy() & 7) == 0).mean(),
    }


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    sd = moe_weights()
    return write_dense(tmp_path_factory.mktemp("dense") / "ck", sd), sd


RECIPES = ["mxfp4:floor", "mxfp4:rceil", "mxfp4:even", "nvfp4:torchao"]


def test_candidate_recipes_match_torchao(dense_ckpt):
    path, sd = dense_ckpt
    ck = open_checkpoint(path)
    t = candidate_errors(ck, RECIPES, progress=False)
    df = t.experts
    routed = df[df.kind == "routed"]
    assert len(routed) == 1 * 4 * 3 * len(RECIPES)  # layer 1 only holds routed experts
    assert set(df.kind) == {"routed", "shared", "dense"}
    assert len(df[(df.kind == "dense")]) == 3 * len(RECIPES)
    # the comparison below must exercise clipping: FLOOR clips, RCEIL never does
    assert df[df.recipe == "mxfp4:floor"].clip_frac.max() > 0
    assert (df[df.recipe == "mxfp4:rceil"].clip_frac == 0).all()
    for row in df.itertuples():
        if row.kind == "routed":
            name = f"model.layers.{row.layer}.mlp.experts.{row.expert}.{row.proj}_proj.weight"
        elif row.kind == "shared":
            name = f"model.layers.{row.layer}.mlp.shared_expert.{row.proj}_proj.weight"
        else:
            name = f"model.layers.{row.layer}.mlp.{row.proj}_proj.weight"
        deq, codes = torchao_fake_quant(sd[name], row.recipe)
        want = numpy_metrics(sd[name], deq, codes)
        for k, v in want.items():
            assert getattr(row, k) == pytest.approx(v, rel=1e-5, abs=1e-9), (name, row.recipe, k)


def test_scale_exponent_histogram_counts_every_block(dense_ckpt):
    path, sd = dense_ckpt
    t = candidate_errors(open_checkpoint(path), ["mxfp4:floor"], progress=False)
    s = t.scales
    one = s[(s.kind == "routed") & (s.layer == 1) & (s.expert == 2) & (s.proj == "down")]
    w = sd["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert one["count"].sum() == w.numel() // 32
    # FLOOR: exponent = floor(log2(block amax)) - 2, counted independently here
    amax = w.float().reshape(-1, 32).abs().amax(-1)
    want = torch.floor(torch.log2(amax)).int() - 2
    vals, counts = torch.unique(want, return_counts=True)
    assert dict(zip(one.exponent, one["count"])) == dict(zip(vals.tolist(), counts.tolist()))


def test_reference_errors_measure_a_known_perturbation(tmp_path):
    sd = moe_weights(layers=2, experts=2, shared=False, dense_layer=False)
    ref_sd = dict(sd)
    g = torch.Generator().manual_seed(5)
    name = "model.layers.1.mlp.experts.1.up_proj.weight"
    delta = (torch.randn(sd[name].shape, generator=g) * 1e-3).bfloat16()
    ref_sd[name] = (sd[name].float() + delta.float()).bfloat16()
    ck = open_checkpoint(write_dense(tmp_path / "a", sd))
    ref = open_checkpoint(write_dense(tmp_path / "b", ref_sd))
    df = reference_errors(ck, ref, progress=False).experts
    hit = df[(df.layer == 1) & (df.expert == 1) & (df.proj == "up")].iloc[0]
    a, b = ref_sd[name].double(), sd[name].double()
    assert hit.rel_err == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-5)
    others = df.drop(index=hit.name)
    assert (others.rel_err == 0).all() and (others.sqnr_db == math.inf).all()
    assert set(df.recipe) == {"stored:bf16"}


def test_save_and_reload_without_recomputing(dense_ckpt, tmp_path):
    path, _ = dense_ckpt
    t = candidate_errors(open_checkpoint(path), ["mxfp4"], progress=False)
    t.save(tmp_path / "out")
    back = ErrorTables.load(tmp_path / "out")
    assert back.experts.shape == t.experts.shape
    np.testing.assert_allclose(back.experts.rel_err, t.experts.rel_err, rtol=1e-12)
    assert back.scales["count"].sum() == t.scales["count"].sum()


def test_stored_grid_vs_recipes_on_a_compressed_tensors_checkpoint(tmp_path):
    """compressed-tensors writes MXFP4 with its EVEN-like rule: re-quantizing its decoded
    weights with `mxfp4:compressed-tensors` must reproduce every scale and code."""
    pytest.importorskip("compressed_tensors")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))
    from oracles import write_compressed_tensors

    o = write_compressed_tensors(tmp_path / "ct", "MXFP4A16", seed=1)
    ck = open_checkpoint(o.path)
    df = stored_vs_recipes(ck, ["mxfp4:compressed-tensors", "mxfp4:floor"], progress=False).experts
    ct = df[df.recipe == "mxfp4:compressed-tensors"]
    assert len(ct) == len(ck.experts()) + sum(1 for r in ck.expert_records() if r.kind != "routed"
                                              and ck.recipe_of(r.name) is not None)
    assert (ct.scale_mismatch_frac == 0).all() and (ct.code_mismatch_frac == 0).all()
    assert (ct.rel_err == 0).all()
