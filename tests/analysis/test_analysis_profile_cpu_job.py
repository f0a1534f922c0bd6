"""jobs/analysis_profile_cpu.py at a tiny size (a few seconds), so the job cannot rot: every
question x format gives a row with each stage, the stages add up to the wall time, and the
table lands in --out."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "jobs" / "analysis_profile_cpu.py"


def test_the_profile_job_runs_at_a_tiny_size(tmp_path, capsys):
    from workbench.analysis import batched, fast, fused
    from workbench.analysis.session import Session
    from workbench.checkpoint import stream

    spec = importlib.util.spec_from_file_location("analysis_profile_cpu", JOB)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    before = [(fast, "batched"), (fast, "stream_stacks"), (stream, "load_stack"),
              (Session, "run"), (fused, "pack_blocks"), (fused.FusedResult, "histogram")]
    saved = [getattr(o, n) for o, n in before]
    assert mod.main(["--small-shape", "--experts", "4", "--size-gb", "0.002",
                     "--ref-gb", "0.003", "--dir", str(tmp_path / "ck"),
                     "--formats", "mxfp4,nvfp4", "--out", str(tmp_path / "out")]) == 0
    # the job instruments these for its run only: later tests find them as they were
    assert [getattr(o, n) for o, n in before] == saved and fast.batched is batched
    text = (tmp_path / "out" / "analysis_profile_cpu.md").read_text()
    lines = [x for x in text.splitlines() if x.startswith("| ") and "---" not in x]
    k = len(mod.STAGES)
    assert lines[0].split(" | ")[7:7 + k] == list(mod.STAGES)
    paths_seen = [x.split(" | ")[6] for x in lines[1:]]
    assert len([p for p in paths_seen if p != "fused (asked)"]) == 2 * 3, text
    assert "fused (asked)" in paths_seen  # a small job: auto batched, then asked fused
    for x in lines[1:]:
        cells = [c.strip() for c in x.strip("|").split("|")]
        secs = float(cells[4])
        parts = [float(c.split()[0]) for c in cells[7:7 + k]]
        assert all(p >= -0.01 for p in parts), x  # exclusive timers never go negative
        main = sum(parts[1:])  # all but read (on the reader threads)
        # ... and add up to the wall time, to the table's rounding (each cell to 0.005 s)
        assert abs(main - secs) <= 0.005 * k + 1e-9, (x, main, secs)
        assert cells[6] in ("batched", "fused", "fused (asked)") and float(cells[-1]) > 0
    assert "auto's reasons:" in text and "machine:" in text
    rows = json.loads((tmp_path / "out" / "analysis_profile_cpu.json").read_text())
    assert len(rows) == len(lines) - 1
    for r in rows:  # unrounded: the stages but the read add up to the call's wall time
        assert sum(v for s, v in r["split"].items() if s != "read") == pytest.approx(r["secs"])
    capsys.readouterr()
