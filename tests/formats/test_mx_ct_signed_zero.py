"""compressed-tensors 0.20.1 stores -0.0 (and negatives whose quotient underflows to -0.0) as
+0: MXFP8 byte 0x00, MXFP4 code 0x0. Checked against the library's own model path
(apply_quantization_config -> calculate_qparams -> ModelCompressor.compress_model), which is
how llm-compressor writes a checkpoint, not against a transcription."""

from __future__ import annotations

import pytest
import torch

from workbench.formats import quantize

pytest.importorskip("compressed_tensors", reason="compressed-tensors is the oracle (.[dev] extra)")

SCHEMES = {"mxfp8_e4m3": "MXFP8A16", "mxfp4": "MXFP4A16"}


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Blocks of 32 holding -0.0, negatives that underflow to -0.0 after scaling, negatives
    that round to a zero code but stay nonzero after scaling, and ordinary values."""
    x = torch.zeros(4, 64, dtype=torch.float32)
    x[0, :4] = torch.tensor([1.0, -0.0, -2.0**-12, -2.0**-10])
    x[1, :3] = torch.tensor([-3.0, -0.0, -1e-6])
    x[2, :3] = torch.tensor([2.0**100, -2.0**-30, -0.0])  # scale 2^92: -2^-30 underflows
    x[3, 32:35] = torch.tensor([-0.0, -1e-30, 448.0])
    x[3, :32] = -0.0  # an all-(-0) block
    return x.to(dtype)


def ct_compress(w: torch.Tensor, scheme_name: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False)).to(w.dtype)
    with torch.no_grad():
        model[0].weight.copy_(w)
    qcfg = QuantizationConfig(config_groups={"g": preset_name_to_scheme(scheme_name, ["Linear"])})
    apply_quantization_config(model, qcfg)
    mod = model[0]
    args = mod.quantization_scheme.weights
    g = mod.weight.unflatten(-1, (-1, args.group_size))
    with torch.no_grad():
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args)
        mod.weight_scale.copy_(scale)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    return {k.removeprefix("0."): v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", sorted(SCHEMES))
def test_negative_zero_bytes_match_compressed_tensors(fmt, dtype):
    x = edge_rows(dtype)
    sd = ct_compress(x, SCHEMES[fmt])
    data = sd["weight"] if fmt == "mxfp8_e4m3" else sd["weight_packed"]
    q = quantize(x, fmt, "compressed-tensors")
    assert torch.equal(q.scale, sd["weight_scale"].view(torch.uint8))
    got, want = q.data.view(torch.uint8), data.view(torch.uint8)
    assert torch.equal(got, want), (got != want).nonzero().tolist()
    if fmt == "mxfp8_e4m3":
        # the rule is visible: no -0.0 byte where the input was -0.0
        assert int(want[0, 1]) == 0x00 and int(want[3, 32]) == 0x00
        # and a negative that stays nonzero after scaling keeps its sign (0x80 after rounding)
        assert int(want[0, 2]) & 0x80
