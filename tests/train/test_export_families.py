"""Exports of every family in the format it ships in, loaded back by transformers.

- gpt-oss `--export gpt-oss`: its native MXFP4 layout; transformers' `Mxfp4Config(dequantize=True)`
  load gives the logits of `from_pretrained` of the export, and the experts decode to the very
  weights QAT fake-quantized (`fake_quant_ste` of the masters), bit for bit.
- gpt-oss `--export bf16`: fused BF16 experts with their biases, transformers' own layout.
- DeepSeek-V3 / GLM-4.5 `--export compressed-tensors`: per-expert packed experts under the
  family's names; MXFP4 loads in transformers with the logits of `from_pretrained`; NVFP4 is
  checked against compressed-tensors' own decompression (transformers 5.24 scales fused NVFP4
  experts wrongly: tests/checkpoint/test_oracles_transformers_nvfp4_bug.py).
Tolerance: both sides compute in fp32 on the same BF16 / decoded weights (test_families_parity).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from families import family_oracle, logits, trained_like

pytest.importorskip("transformers", reason="transformers loads the exports (pip install 'workbench[dev]')")

from workbench._io import NoSpaceError
from workbench.model import from_pretrained, hf_to_ours
from workbench.qat import fake_quant_ste, parse_qat_recipe
from workbench.train import export_gpt_oss
from workbench.train.export import ExportError, export_model

ATOL = RTOL = 2e-5


def test_gpt_oss_native_export_loads_in_transformers(tmp_path):
    from transformers import GptOssForCausalLM, Mxfp4Config

    cfg, _, model = trained_like("gpt_oss", "mxfp4")
    out = export_model(model, tmp_path / "oss", fmt="gpt-oss", recipe="mxfp4")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    assert config["architectures"] == ["GptOssForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in index
    assert "model.layers.1.mlp.router.weight" in index and "model.layers.1.self_attn.sinks" in index

    ours = from_pretrained(out)
    ref = GptOssForCausalLM.from_pretrained(out, quantization_config=Mxfp4Config(dequantize=True),
                                            dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    theirs = hf_to_ours(ref.state_dict(), family="gpt_oss")
    for name, p in ours.named_parameters():
        assert torch.equal(p.data, theirs[name].float()), name
    x = family_oracle().ids(cfg)
    torch.testing.assert_close(logits(ours, x), logits(ref, x), rtol=RTOL, atol=ATOL)
    # the experts are what the run trained with: QAT's fake quantization of the masters
    recipe = parse_qat_recipe("mxfp4").weight
    for layer in range(cfg.num_layers):
        mine, saved = model.model.layers[layer].mlp.experts, ours.model.layers[layer].mlp.experts
        for w in ("w1", "w3", "w2"):
            fq = fake_quant_ste(getattr(mine, w).detach(), recipe).float()
            assert torch.equal(getattr(saved, w).data, fq), (layer, w)
        assert torch.equal(saved.b1.data, mine.b1.detach().to(torch.bfloat16).float())


def test_gpt_oss_bf16_export_is_transformers_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, hf, model = trained_like("gpt_oss", None)
    out = export_model(model, tmp_path / "bf16", fmt="bf16")
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    for name, t in hf.state_dict().items():
        assert torch.equal(ref.state_dict()[name], t.to(torch.bfloat16).float()), name
    x = family_oracle().ids(cfg)
    torch.testing.assert_close(logits(from_pretrained(out), x), logits(ref, x), rtol=RTOL, atol=ATOL)


def test_gpt_oss_export_on_a_full_disk_keeps_the_previous_export(tmp_path, monkeypatch):
    """The second shard meets a full disk (part of it written, then ENOSPC without a file name,
    as the kernel gives it): one line naming the device and the shard, the later shards are not
    attempted, and the previous export stays as it was."""
    _, _, model = trained_like("gpt_oss", "mxfp4")
    out = export_model(model, tmp_path / "oss", fmt="gpt-oss", recipe="mxfp4")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = export_gpt_oss.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(export_gpt_oss, "save_file", save_file)
    with pytest.raises(NoSpaceError, match=r"^no space left on .* while writing "
                       r".*/\.tmp-oss/model-00002-of-\d{5}\.safetensors$"):
        export_model(model, out, fmt="gpt-oss", recipe="mxfp4")
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_wrong_format_for_the_family_is_refused(tmp_path):
    _, _, oss = trained_like("gpt_oss", "nvfp4")
    with pytest.raises(ExportError, match="stores MXFP4"):
        export_model(oss, tmp_path / "a", fmt="gpt-oss", recipe="nvfp4")
    with pytest.raises(ExportError, match="use --export gpt-oss"):
        export_model(oss, tmp_path / "b", fmt="compressed-tensors", recipe="nvfp4")
    _, _, ds = trained_like("deepseek_v3", "mxfp4")
    with pytest.raises(ExportError, match="this model is deepseek_v3"):
        export_model(ds, tmp_path / "c", fmt="gpt-oss", recipe="mxfp4")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_compressed_tensors_mxfp4_export_loads_in_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    cfg, _, model = trained_like(case, "mxfp4")
    out = export_model(model, tmp_path / case, fmt="compressed-tensors", recipe="mxfp4")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # the router and the shared experts stay dense, named the way transformers names them
    assert "re:.*mlp.gate$" in qc["ignore"] and "re:.*mlp.shared_experts.gate_proj$" in qc["ignore"]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index
    assert "model.layers.1.mlp.experts.3.gate_proj.weight_packed" in index
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    for p in ref.parameters():  # a compressed-tensors model refuses .float(): cast the data
        p.data = p.data.float()
    for b in ref.buffers():
        b.data = b.data.float() if b.is_floating_point() else b.data
    ref.config._attn_implementation = "eager"
    ours = from_pretrained(out)
    theirs = hf_to_ours(ref.state_dict(), family=cfg.family)
    for name, p in ours.named_parameters():
        assert torch.equal(p.data, theirs[name].float()), name
    x = family_oracle().ids(cfg)
    torch.testing.assert_close(logits(ours, x), logits(ref, x), rtol=RTOL, atol=ATOL)
    # the correction bias keeps its fp32 bits through the export
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(ours.model.layers[1].mlp.gate.e_score_correction_bias.data, bias.data)


@pytest.mark.parametrize("case", ["deepseek_v3", "glm4_moe"])
def test_compressed_tensors_nvfp4_export_is_compressed_tensors_decode(tmp_path, case):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file

    cfg, _, model = trained_like(case, "nvfp4")
    out = export_model(model, tmp_path / case, fmt="compressed-tensors", recipe="nvfp4")
    stored = {}
    for shard in sorted(out.glob("*.safetensors")):
        stored.update(load_file(shard))
    decoded = CompressedTensorsDequantizer(out, dtype=torch.bfloat16).process(dict(stored))
    want = hf_to_ours({k: v for k, v in {**stored, **decoded}.items()
                       if k.endswith(("weight", "bias"))}, family=cfg.family)
    ours = from_pretrained(out)
    for name, p in ours.named_parameters():
        assert torch.equal(p.data, want[name].float()), name
    recipe = parse_qat_recipe("nvfp4").weight
    experts = model.model.layers[1].mlp.experts
    fq = fake_quant_ste(experts.w1.detach(), recipe, per_leading=True).to(torch.bfloat16)
    assert torch.equal(ours.model.layers[1].mlp.experts.w1.data, fq.float())


@pytest.mark.distributed
def test_gpt_oss_exports_are_the_same_bytes_at_ep2_and_under_fsdp(tmp_path):
    """The fused gpt-oss layouts gather each layer's experts on rank 0: an EP2 model and an
    EP1 x FSDP2 model built from the same --init write the files the world-1 model writes. A
    second export into the same folder, whose first expert shard meets a full disk on rank 0,
    fails on every rank with the same line (none waits forever) and leaves the first intact."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import REPO, env
    from safetensors import safe_open

    from workbench.train.build import build
    from workbench.train.config import from_checkpoint
    from workbench.train.distributed import setup

    fo = family_oracle()
    init = fo.write_gpt_oss_mxfp4(fo.CASES["gpt_oss"], tmp_path / "init", seed=1)
    worker = Path(__file__).with_name("gpt_oss_export_worker.py")
    for layout in ("ep", "fsdp"):
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node=2", str(worker), str(tmp_path), str(init), layout],
                           env=env(), cwd=REPO, capture_output=True, text=True, timeout=600,
                           check=False)
        assert p.returncode == 0, p.stderr[-5000:]
    for layout in ("ep", "fsdp"):
        got = [json.loads((tmp_path / f"{layout}-full-rank{r}.json").read_text()) for r in (0, 1)]
        assert [g["writes"] for g in got] == [2, 0], got  # none after the failed shard
        # rank 0 reports the full disk; rank 1 stops with it too, it does not wait forever
        assert [g["type"] for g in got] == ["NoSpaceError", "PeerFailed"], got
        assert got[1]["error"] == f"rank 0 failed: {got[0]['error']}", got
        shard = re.escape(str(tmp_path / f".tmp-{layout}-gpt-oss" / "model-00002-of-"))
        assert re.match(rf"no space left on .* while writing {shard}\d{{5}}\.safetensors$",
                        got[0]["error"]), got[0]
    info = setup()
    for fmt, recipe in (("gpt-oss", "mxfp4"), ("bf16", "bf16")):
        cfg = from_checkpoint("/nonexistent-not-written", str(init), recipe=recipe, batch=4,
                              seq=16)
        ref = export_model(build(cfg, info).model, tmp_path / f"one-{fmt}", fmt=fmt,
                           recipe=recipe)
        want = json.loads((ref / "model.safetensors.index.json").read_text())["weight_map"]
        for layout in ("ep", "fsdp"):
            other = tmp_path / f"{layout}-{fmt}"
            got = json.loads((other / "model.safetensors.index.json").read_text())["weight_map"]
            assert got == want, layout
            for name, shard in want.items():
                with safe_open(ref / shard, "pt") as a, safe_open(other / shard, "pt") as b:
                    ta, tb = a.get_tensor(name), b.get_tensor(name)
                    assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8),
                                                                tb.view(torch.uint8)), (layout, name)
            assert json.loads((ref / "config.json").read_text()) == \
                json.loads((other / "config.json").read_text())
