"""`workbench eval` gives exactly the numbers `lm_eval` itself prints for the same checkpoint and
tasks: lm-eval's own CLI, loading the model by path through its HF backend, run beside ours on a
checkpoint written by transformers and on the demo's BF16 model (written by the workbench)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from builders import TASKS, env, workbench_eval, write_demo_init

from workbench.track import read_eval

pytestmark = pytest.mark.slow
TASK_LIST = "wb_code_choice,wb_code_complete"


def lm_eval_cli(ckpt: Path, out: Path, tmp: Path) -> tuple[dict, dict[str, list[dict]], str]:
    """lm-eval's CLI on `ckpt`: (its results JSON, its samples per task, its stdout). Run from
    the task folder: lm-eval reads a YAML's relative data files from its working folder."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={ckpt},dtype=float32", "--tasks", TASK_LIST,
           "--include_path", str(TASKS), "--device", "cpu", "--batch_size", "1",
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, env=env(tmp), cwd=TASKS, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (res_file,) = out.rglob("results_*.json")
    samples = {t: [json.loads(line) for line in f.read_text().splitlines()]
               for t in TASK_LIST.split(",") for f in out.rglob(f"samples_{t}_*.jsonl")}
    return json.loads(res_file.read_text()), samples, proc.stdout


def printed_table(stdout: str) -> dict[tuple[str, str], tuple[float, float | None]]:
    """(task, metric) -> (value, stderr or None where it prints N/A) from lm-eval's table."""
    rows, task = {}, None
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not re.fullmatch(r"-?[0-9.]+", cells[6]):
            continue
        task = cells[0] or task
        rows[(task, cells[4])] = (float(cells[6]), None if cells[8] == "N/A" else float(cells[8]))
    return rows


def assert_same(ours: dict, theirs: dict, their_samples: dict, stdout: str, our_samples: Path):
    assert set(ours["results"]) == set(TASK_LIST.split(","))
    for task, metrics in ours["results"].items():
        tr = theirs["results"][task]
        assert ours["n_samples"][task] == theirs["n-samples"][task]["effective"] == 20
        for key, v in metrics.items():
            metric, filt = key.split(",")
            assert v["value"] == tr[key], (task, key)  # exactly, not approximately
            stderr = tr[f"{metric}_stderr,{filt}"]
            assert v["stderr"] == (stderr if stderr != "N/A" else None), (task, key)
            shown_v, shown_s = printed_table(stdout)[(task, metric)]
            assert round(v["value"], 4) == shown_v
            assert shown_s == (None if v["stderr"] is None else round(v["stderr"], 4))
        # answer by answer: lm-eval writes its responses as strings
        mine = [json.loads(x) for x in (our_samples / f"{task}.jsonl").read_text().splitlines()]
        assert len(mine) == len(their_samples[task]) == 20
        for a, b in zip(mine, sorted(their_samples[task], key=lambda s: s["doc_id"])):
            assert (a["doc_id"], a["doc_hash"]) == (b["doc_id"], b["doc_hash"])
            if task == "wb_code_complete":
                assert a["filtered_resps"] == b["filtered_resps"]
            else:
                assert [float(r[0][0]) for r in a["resps"]] == \
                    [float(r[0][0]) for r in b["resps"]]


def test_transformers_checkpoint_matches_lm_eval(group, group_eval_dir, tmp_path):
    ours = {m["label"]: m for m in read_eval(group_eval_dir)["models"]}["g/ckpt"]
    theirs, samples, stdout = lm_eval_cli(group["ckpt"], tmp_path / "lm-eval", tmp_path)
    assert_same(ours, theirs, samples, stdout, group_eval_dir / "samples" / "g_ckpt")


def test_demo_model_matches_lm_eval(tmp_path):
    init = write_demo_init(tmp_path / "demo model" / "init")
    proc = workbench_eval([init, "--tasks", TASK_LIST, "--out", tmp_path / "ours"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (ours,) = read_eval(tmp_path / "ours")["models"]
    assert (ours["role"], ours["engine"]) == ("bf16", "transformers")
    theirs, samples, stdout = lm_eval_cli(init, tmp_path / "lm-eval", tmp_path)
    assert_same(ours, theirs, samples, stdout, tmp_path / "ours" / "samples" / "demo_model_init")
