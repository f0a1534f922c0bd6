"""The demo's pieces: its reference is the QAT run's BF16 export and its packed checkpoint is
exactly what the trainer's compressed-tensors export writes; the trainer's final summary; the
demo folder does not depend on the working folder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from workbench import demo
from workbench.analysis import compare
from workbench.train.cli import main as train

ARGS = ["--preset", "tiny", "--recipe", "mxfp4", "--steps", "3", "--seed", "1", "--batch", "4",
        "--seq", "32", "--val-every", "3", "--wandb", "disabled"]


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_packing_the_bf16_export_equals_the_trainers_packed_export(tmp_path, capsys):
    packed_run = train([*ARGS, "--out", str(tmp_path / "ct"), "--export", "compressed-tensors"])
    text = capsys.readouterr().out
    # the final summary: steps, losses, the export path and where the metrics are
    assert "[train] done: step 3/3" in text
    assert f"export: {packed_run['export']}" in text
    assert str(tmp_path / "ct" / "metrics.jsonl") in text
    assert f"{packed_run['final_loss']:.4f}" in text
    bf16_run = demo.qat_run([*ARGS, "--out", str(tmp_path / "bf16"), "--export", "bf16"],
                            tmp_path / "packed")
    a, b = _tensors(Path(packed_run["export"])), _tensors(tmp_path / "packed")
    assert sorted(a) == sorted(b) and any(k.endswith("weight_packed") for k in a)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    # the reference is this run's masters (in BF16): stored vs reference is quantization
    # error only, the same size as PTQ of the reference with the run's recipe (within the BF16
    # rounding of the masters), not training drift
    r = compare(tmp_path / "packed", "ptq:mxfp4", bf16_run["export"], progress=False)
    assert (r.table.a_rel_err > 0).all()
    assert (r.table.change_pct.abs() < 2).all(), r.table.change_pct.abs().max()
    assert (r.table.change_pct == 0).mean() > 0.5  # most weights: the very same grid


def test_demo_folder_is_anchored_not_relative(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEMO_DIR", raising=False)
    here = demo.default_root()
    monkeypatch.chdir(tmp_path)
    assert demo.default_root() == here and here.is_absolute()
    assert tmp_path not in here.parents
    monkeypatch.setenv("WORKBENCH_DEMO_DIR", "rel/demo")
    assert demo.default_root() == (tmp_path / "rel" / "demo").resolve()
