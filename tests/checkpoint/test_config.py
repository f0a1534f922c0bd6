"""quantization_config parsing (every method and where it lives) and compressed-tensors FP8
(`float-quantized`, channel and block scales) decoded against compressed-tensors itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from writers import gen, save_sharded, write_ct, write_gpt_oss, write_modelopt

from workbench.checkpoint import ConfigError, UnknownFormatError, load_quant_config, open_checkpoint


def cfg_dir(tmp_path: Path, config: dict, hf: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if hf is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf))
    return tmp_path


def test_compressed_tensors_fields(tmp_path):
    d = write_ct(tmp_path / "c", "nvfp4")
    _, q = load_quant_config(d)
    assert (q.method, q.format, q.pattern_style) == ("compressed-tensors",
                                                     "nvfp4-pack-quantized", "ct")
    assert [g.codec for g in q.groups] == ["nvfp4-ct"]
    assert q.groups[0].weights.group_size == 16 and q.groups[0].targets == ("Linear",)
    assert q.ignore == ("lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$")
    assert q.source == d / "config.json"


def test_text_config_nesting(tmp_path):
    d = write_ct(tmp_path / "c", "mxfp8", text_config=True, shards=1)
    model_cfg, q = load_quant_config(d)
    assert "quantization_config" not in model_cfg and q.format == "mxfp8-quantized"
    assert [g.codec for g in q.groups] == ["mxfp8_e4m3"]


def test_mixed_precision_groups(tmp_path):
    w4 = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}
    w8 = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision",
          "config_groups": {"a": {"targets": ["re:.*experts.*"], "weights": w4,
                                  "format": "mxfp4-pack-quantized"},
                            "b": {"targets": ["re:.*self_attn.*"], "weights": w8,
                                  "format": "mxfp8-quantized"}}}
    _, q = load_quant_config(cfg_dir(tmp_path, {"quantization_config": qc}))
    assert [g.codec for g in q.groups] == ["mxfp4", "mxfp8_e4m3"]
    qc["config_groups"]["b"]["weights"]["num_bits"] = 4
    with pytest.raises(ConfigError, match="needs float8"):
        load_quant_config(cfg_dir(tmp_path, {"quantization_config": qc}))


def test_quantization_status_must_be_compressed(tmp_path):
    d = write_ct(tmp_path / "c", "mxfp4")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quantization_status"] = "frozen"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownFormatError, match="frozen") as ei:
        open_checkpoint(d)
    assert ei.value.path.endswith("config.json")


def test_gpt_oss_modules_to_not_convert(tmp_path):
    ck = open_checkpoint(write_gpt_oss(tmp_path / "g"))
    q = ck.quant_config
    assert (q.method, q.pattern_style, ck.layout) == ("mxfp4", "hf", "gpt-oss")
    attn = "model.layers.0.self_attn.q_proj.weight"
    assert not ck.scope.is_quantized(attn)
    assert "model.layers.*.self_attn" in ck.scope.reason(attn)
    assert ck.scope.is_quantized("model.layers.1.mlp.experts.gate_up_proj")
    assert not ck.scope.is_quantized("model.layers.1.mlp.experts.gate_up_proj_bias")


def test_modelopt_from_hf_quant_config_and_config_json(tmp_path):
    a = open_checkpoint(write_modelopt(tmp_path / "a", "MXFP4", in_config=False))
    b = open_checkpoint(write_modelopt(tmp_path / "b", "MXFP4", in_config=True))
    assert a.quant_config.source.name == "hf_quant_config.json"
    assert b.quant_config.source.name == "config.json"
    for ck in (a, b):
        assert ck.quant_config.ignore == ("lm_head", "*.mlp.gate")
        assert ck.quant_config.pattern_style == "glob"
        assert not ck.scope.is_quantized("model.layers.0.mlp.gate.weight")
        assert "*.mlp.gate" in ck.scope.reason("model.layers.0.mlp.gate.weight")
        assert ck.scope.is_quantized("model.layers.0.self_attn.q_proj.weight")
    assert "input_scale" not in " ".join(open_checkpoint(tmp_path / "a").logical_names())


def test_hf_quant_config_needs_quantization_object(tmp_path):
    d = cfg_dir(tmp_path, {"model_type": "x"}, hf={"producer": {}})
    with pytest.raises(ConfigError, match="'quantization'") as ei:
        load_quant_config(d)
    assert ei.value.path.endswith("hf_quant_config.json")


@pytest.mark.parametrize("bs", [None, [128], [128, 0], "128"])
def test_fp8_block_size_is_checked(tmp_path, bs):
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": bs}
    with pytest.raises(ConfigError, match="weight_block_size"):
        load_quant_config(cfg_dir(tmp_path, {"quantization_config": qc}))


def test_dense(tmp_path):
    d = save_sharded(tmp_path, {"model.layers.0.mlp.down_proj.weight": gen((8, 4))})
    ck = open_checkpoint(d)
    assert ck.layout == "dense" and ck.quant_config.method == "dense"
    assert ck.scope.reason("model.layers.0.mlp.down_proj.weight") == \
        "no quantization_config: stored dense"
    assert [r.kind for r in ck.expert_records()] == ["dense"]


@pytest.mark.parametrize("strategy", ["channel", "block"])
def test_ct_float_quantized_fp8_matches_compressed_tensors(tmp_path, strategy):
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    R, C = 200, 160
    w = gen((R, C), seed=3, dtype=torch.float32)
    if strategy == "channel":
        s = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
        args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        sx = s.float()
    else:
        s = (torch.rand(2, 2, generator=torch.Generator().manual_seed(1)) * 1e-3 + 1e-4)
        args = QuantizationArgs(num_bits=8, type="float", strategy="block", symmetric=True,
                                block_structure=[128, 128])
        sx = s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]
    fp8 = (w / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
    name = "model.layers.0.mlp.experts.0.down_proj"
    wargs = json.loads(args.model_dump_json())
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"targets": ["Linear"], "weights": wargs}}}
    save_sharded(tmp_path, {f"{name}.weight": fp8, f"{name}.weight_scale": s},
                 config={"quantization_config": qc})
    ck = open_checkpoint(tmp_path)
    want = NaiveQuantizationCompressor.decompress(
        {"weight": fp8, "weight_scale": s}, QuantizationScheme(targets=["Linear"], weights=args)
    )["weight"].to(torch.bfloat16)
    v = ck.tensor(f"{name}.weight")
    assert torch.equal(v.materialize().view(torch.int16), want.view(torch.int16))
    assert torch.equal(v[120:140, 100:131].view(torch.int16),
                       want[120:140, 100:131].view(torch.int16))
    assert ck.recipe_of(f"{name}.weight") == "fp8"


def test_checkpoint_scope_recipes_are_formats_recipes(tmp_path):
    from workbench.formats import Recipe, fake_quantize

    ck = open_checkpoint(write_ct(tmp_path / "c", "nvfp4"))
    name = ck.experts()[0].name
    r = ck.scope.recipe(name)
    assert isinstance(r, Recipe) and (r.fmt, r.profile) == ("nvfp4", "compressed-tensors")
    assert r == ck.recipe_of(name)
    x = ck.tensor(name).materialize()
    assert fake_quantize(x, r).shape == x.shape  # usable as is
    assert ck.scope.recipe("model.layers.0.mlp.gate.weight") is None
    ck4 = open_checkpoint(write_ct(tmp_path / "i", "int4"))
    assert ck4.scope.recipe(ck4.experts()[0].name) == "int4"
