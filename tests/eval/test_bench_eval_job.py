"""jobs/bench_eval.py runs end to end on CPU (tiny preset) and prints one row per model and
task, the packed export timed against the BF16 checkpoint of the same run, generation by the
tokens each model made."""

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
    gen = [r for r in rows if r["task"] == "bench_complete"]
    # generation is compared by tokens made: at most max_gen_toks (32) per document, at least 1
    assert all(3 <= r["generated_tokens"] <= 3 * 32 for r in gen)
    bf16_rate = gen[0]["generated_tokens"] / gen[0]["seconds"]
    for r in gen:
        assert r["speed_vs_bf16"] == pytest.approx(r["generated_tokens"] / r["seconds"] / bf16_rate)
    # the untimed warm-up took every model through both tasks
    warm = json.loads((out / "warmup" / "eval.json").read_text())
    assert len(warm["models"]) == 3
    assert all({"bench_choice", "bench_complete"} <= set(m["results"]) for m in warm["models"])
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)
    packed = json.loads((out / "packed-mxfp4" / "config.json").read_text())
    assert packed["quantization_config"]["format"] == "mxfp4-pack-quantized"
