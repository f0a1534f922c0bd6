"""config.json as the libraries write it: transformers' config classes and compressed-tensors'
/ transformers' quantization configs, serialised with every optional field null or left out.
The reader takes what it needs and defaults the rest, as those libraries do; no such config may
end in a type error (``float(None)``, ``int(None)``) instead of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from writers import write_ct, write_fp8_block, write_gpt_oss

from workbench.checkpoint import CheckpointError, open_checkpoint

tr = pytest.importorskip("transformers")


def _retarget(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, default=list))


def _same_weights(a, b) -> None:
    ra, rb = a.experts(), b.experts()
    assert [r.key for r in ra] == [r.key for r in rb] and ra
    for r in (ra[0], ra[-1]):
        assert torch.equal(a.view_of(r).materialize(), b.view_of(r).materialize())


@pytest.mark.parametrize("unset", [False, True])
def test_compressed_tensors_config_as_the_library_writes_it(tmp_path, unset):
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    base = write_ct(tmp_path / "ref", "mxfp4", layers=2, experts=4, shards=1)
    other = write_ct(tmp_path / "lib", "mxfp4", layers=2, experts=4, shards=1)
    ignore = json.loads((base / "config.json").read_text())["quantization_config"]["ignore"]
    qc = ct.QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("MXFP4A16",
                                                                                ["Linear"])},
                               format="mxfp4-pack-quantized", ignore=ignore,
                               quantization_status=ct.QuantizationStatus.COMPRESSED)
    # exclude_unset: only what was given (no defaults); to_dict: every field, nulls included
    qd = {**qc.model_dump(exclude_unset=True), "quant_method": "compressed-tensors"} if unset \
        else qc.to_dict()
    model = tr.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_experts=4,
                              moe_intermediate_size=32).to_dict()
    assert any(v is None for v in model.values())  # the nulls this test is about
    _retarget(other, {**model, "quantization_config": qd})
    ck = open_checkpoint(other)
    assert ck.layout == "compressed-tensors" and ck.config["model_type"] == "qwen3_moe"
    _same_weights(ck, open_checkpoint(base))


def test_gpt_oss_config_with_transformers_mxfp4_defaults(tmp_path):
    base = write_gpt_oss(tmp_path / "ref", layers=2, shards=1)
    other = write_gpt_oss(tmp_path / "lib", layers=2, shards=1)
    model = tr.GptOssConfig(num_hidden_layers=2, num_local_experts=4, hidden_size=64,
                            intermediate_size=32).to_dict()
    qd = tr.Mxfp4Config().to_dict()
    assert qd["modules_to_not_convert"] is None
    _retarget(other, {**model, "quantization_config": qd})
    ck = open_checkpoint(other)
    assert ck.layout == "gpt-oss"
    _same_weights(ck, open_checkpoint(base))


def test_fp8_block_config_with_transformers_defaults(tmp_path):
    base = write_fp8_block(tmp_path / "ref", layers=2, shards=1)
    other = write_fp8_block(tmp_path / "lib", layers=2, shards=1)
    model = tr.DeepseekV3Config(num_hidden_layers=2, hidden_size=160).to_dict()
    qd = tr.FineGrainedFP8Config(weight_block_size=(128, 128)).to_dict()
    assert "fmt" not in qd  # the writer leaves the format to its default
    _retarget(other, {**model, "quantization_config": qd})
    ck = open_checkpoint(other)
    assert ck.layout == "fp8-block"
    _same_weights(ck, open_checkpoint(base))


@pytest.mark.parametrize("field", ["quantization_config", "text_config", "model_type"])
def test_optional_top_level_fields_null(tmp_path, field):
    folder = write_ct(tmp_path / "ck", "mxfp4", layers=1, experts=2, shards=1)
    cfg = json.loads((folder / "config.json").read_text())
    if field == "quantization_config":
        cfg[field] = None  # a dense checkpoint's config may say so explicitly
        ck_layout = "dense"
    else:
        cfg[field] = None
        ck_layout = "compressed-tensors"
    _retarget(folder, cfg)
    if ck_layout == "dense":  # packed tensors without a config: a clear error, not a crash
        with pytest.raises(CheckpointError):
            open_checkpoint(folder)
    else:
        assert open_checkpoint(folder).layout == ck_layout
