"""A real-checkpoint QAT run launched from a LaunchSpec, as notebook 02 does it: a Qwen3-MoE
checkpoint written by transformers with its own tokenizer (no preset), JSONL data and
distillation from the frozen checkpoint, at EP1 on submitit's local executor and at EP4 on the
local Slurm cluster. The oracle is the trainer itself: both see the same tokens in the same order
(same data.json) and follow the same curve; the Slurm run's export has the tokenizer next to it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workbench.launch import LaunchSpec, ep4, submit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from realdata import corpus_texts, model_with_tokenizer, write_jsonl

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
STEPS, WAIT_S = 4, 540
ARGS = {"batch": 4, "seq": 32, "lr": 1e-3, "val_every": 2}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    texts = corpus_texts(200, 500)
    return {"model": model_with_tokenizer(root / "model", texts),
            "train": write_jsonl(root / "train.jsonl", texts[:170], chat_every=4),
            "val": write_jsonl(root / "val.jsonl", texts[170:])}


def _spec(real, folder, make=LaunchSpec.build, **kw) -> LaunchSpec:
    return make(preset=None, init=real["model"], data=[real["train"]], val_data=[real["val"]],
                distill=True, recipe="mxfp4", steps=STEPS, seed=1, wandb="disabled", time_min=20,
                folder=folder, **ARGS, **kw)


@pytest.mark.slurm
def test_real_checkpoint_distill_on_slurm_ep4_retraces_local_ep1(slurm_cluster, real, tmp_path):
    local = submit(_spec(real, tmp_path / "ep1", executor="local", ep=1))
    slurm = submit(_spec(real, tmp_path / "ep4", make=ep4, export="compressed-tensors"))
    assert (slurm.spec.resources.executor, slurm.spec.resources.tasks_per_node) == ("slurm", 4)
    assert local.wait(timeout=WAIT_S) == "COMPLETED", local.log_tail(40)
    assert slurm.wait(timeout=WAIT_S) == "COMPLETED", slurm.log_tail(40)
    assert slurm.result()["world_size"] == 4

    data = [json.loads((j.folder / "data.json").read_text()) for j in (local, slurm)]
    assert data[0] == data[1]  # one tokenization of the same files by the same tokenizer
    assert data[0]["train_tokens"] > 0 and data[0]["val_tokens"] > 0
    a, b = local.metrics(), slurm.metrics()
    assert a["step"].tolist() == b["step"].tolist() == list(range(1, STEPS + 1))
    for k in ("loss", "kl", "val_loss", "val_kl", "val_top1_agree", "teacher_val_loss"):
        x, y = a[k].dropna().tolist(), b[k].dropna().tolist()
        assert x and len(x) == len(y), k
        # EP4 sums the same tokens' contributions in another order (all-to-all, all-reduce)
        assert y == pytest.approx(x, rel=1e-5, abs=1e-6), k
    export = slurm.folder / "export"
    assert (export / "tokenizer.json").is_file() and (export / "config.json").is_file()
    qcfg = json.loads((export / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
