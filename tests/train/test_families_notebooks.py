"""Notebooks 01 and 02 on a gpt-oss-family checkpoint (executed headless with papermill): 01
inspects the released-style MXFP4 layout against its BF16 model expert by expert, 02 launches
QAT runs from it (--init, JSONL data, EP2, local executor) and draws their curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from families import family_oracle
from notebook_run import run_notebook
from realdata import corpus_texts, train_tokenizer, write_jsonl

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    fo = family_oracle()
    root = tmp_path_factory.mktemp("gpt_oss")
    cfg = fo.CASES["gpt_oss"].replace(vocab_size=512)
    texts = corpus_texts(120, 400)
    packed = fo.write_gpt_oss_mxfp4(cfg, root / "mxfp4", seed=1)
    bf16 = root / "bf16"
    fo.write(cfg, bf16, seed=1, dtype=torch.bfloat16)
    train_tokenizer(packed, texts)
    return {"packed": packed, "bf16": bf16, "data": write_jsonl(root / "train.jsonl", texts)}


def _outputs(path: Path) -> list[dict]:
    nb = json.loads(path.read_text())
    return [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]


def test_notebook_01_inspects_gpt_oss_mxfp4(tmp_path, gpt_oss):
    pytest.importorskip("papermill", reason="needs the notebooks extra")
    import pandas as pd

    executed = tmp_path / "01.ipynb"
    run_notebook(str(ROOT / "notebooks" / "01_inspect_checkpoint.ipynb"),
                 str(executed), cwd=str(ROOT), kernel_name="python3",
                 progress_bar=False,
                 parameters={"checkpoint": str(gpt_oss["packed"]),
                             "reference": str(gpt_oss["bf16"]),
                             "out_dir": str(tmp_path / "rep"),
                             "recipes": ["mxfp4:floor", "nvfp4:torchao"]})
    outputs = _outputs(executed)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert '"quant_method": "mxfp4"' in text
    experts = pd.read_csv(tmp_path / "rep" / "experts.csv")
    routed = experts[experts.kind == "routed"]
    cfg = family_oracle().CASES["gpt_oss"]
    assert set(routed.layer) == set(range(cfg.num_layers))
    assert set(routed.expert) == set(range(cfg.num_experts))


@pytest.mark.distributed
def test_notebook_02_launches_qat_from_gpt_oss(tmp_path, gpt_oss):
    pytest.importorskip("papermill", reason="needs the notebooks extra")
    from workbench.launch import JobHandle

    out = tmp_path / "runs"
    executed = tmp_path / "02.ipynb"
    run_notebook(str(ROOT / "notebooks" / "02_launch_qat.ipynb"), str(executed),
                 cwd=str(tmp_path), kernel_name="python3",
                 parameters={"executor": "local", "ep": 2, "steps": 4,
                             "out": str(out), "wandb": "disabled",
                             "timeout_s": 900, "init": str(gpt_oss["packed"]),
                             "data": [str(gpt_oss["data"])],
                             "recipes": ["bf16", "mxfp4"]})
    outputs = _outputs(executed)
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    runs = sorted(p.parent for p in out.glob("*/launch.json"))
    assert len(runs) == 2
    for folder in runs:
        job = JobHandle.attach(folder)
        assert job.state == "COMPLETED"
        assert job.metrics()["step"].tolist() == [1, 2, 3, 4]
