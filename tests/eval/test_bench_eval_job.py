"""jobs/bench_eval.py runs end to end on CPU (tiny preset) and prints one row per model and
task, the packed export timed against the BF16 checkpoint of the same run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from builders import REPO, env

pytestmark = pytest.mark.slow


def test_bench_eval_job_prints_its_table(tmp_path):
    out = tmp_path / "bench out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "bench_eval.py"), "--preset", "tiny", "--device",
         "cpu", "--docs", "6", "--gen-docs", "3", "--batch-size", "2", "--out", str(out)],
        env=env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=900,
        check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((out / "bench_eval.json").read_text())
    assert [(r["model"], r["task"]) for r in rows] == [
        (m, t) for t in ("bench_choice", "bench_complete") for m in ("bf16", "packed", "ptq")]
    assert {r["engine"] for r in rows if r["model"] == "packed"} == {"transformers"}
    assert all(r["seconds"] > 0 and r["requests"] == r["docs"] * (4 if r["task"] ==
               "bench_choice" else 1) for r in rows)
    assert [r["speed_vs_bf16"] for r in rows if r["model"] == "bf16"] == [1.0, 1.0]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
    packed = json.loads((out / "packed-mxfp4" / "config.json").read_text())
    assert packed["quantization_config"]["format"] == "mxfp4-pack-quantized"
