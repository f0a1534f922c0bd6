"""Fixtures of the eval tests: a trained run group (built once per session by the workbench
trainer in a subprocess, see builders.py) and its evaluation by `workbench eval` (the CLI, in a
subprocess, as a user runs it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from builders import env, train_group, workbench_eval

# The local Slurm cluster fixture and the isolated job index of the launch tests, loaded by path
# (a second module named conftest would shadow this one).
_spec = importlib.util.spec_from_file_location(
    "_launch_conftest", Path(__file__).resolve().parents[1] / "launch" / "conftest.py")
_launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_launch)
slurm_cluster = _launch.slurm_cluster
launch_index = _launch.launch_index


@pytest.fixture(autouse=True)
def _offline_caches(tmp_path, monkeypatch):
    """In-process evaluations: Hugging Face datasets and wandb write under tmp_path, and torch
    runs one intra-op thread (two shared cores: spinning thread pools cost 100x)."""
    import torch

    for k, v in env(tmp_path).items():
        if k.startswith(("HF_", "WANDB_", "TRANSFORMERS_")):
            monkeypatch.setenv(k, v)
    datasets = sys.modules.get("datasets")
    if datasets is not None:  # datasets reads its cache folder once, at import
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(tmp_path / "hf-datasets"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def group(tmp_path_factory) -> dict[str, Path]:
    return train_group(tmp_path_factory.mktemp("eval group") / "g")


@pytest.fixture(scope="session")
def group_eval_dir(group) -> Path:
    """`workbench eval` of the group: the transformers-written checkpoint, the BF16 run's export,
    its PTQ, the QAT run (its packed export) and the QAT run's DCP checkpoint; recorded into
    the runs (metrics.jsonl, wandb) as a user's call would."""
    root = group["root"]
    step = max((group["qat"] / "checkpoints").glob("step_*"))
    proc = workbench_eval([group["ckpt"], group["bf16_model"], f"ptq:mxfp4@{group['bf16_model']}",
                           group["qat"], step, "--tasks", "wb_code_choice,wb_code_complete",
                           "--out", root / "eval"], root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (root / "eval" / "stdout.txt").write_text(proc.stdout)
    return root / "eval"
