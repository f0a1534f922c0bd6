"""jobs/bench_formats.py runs end to end on a tiny shape and finds the same bytes as torchao."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "jobs" / "bench_formats.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_formats", JOB)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_prints_a_table_with_matching_bytes(bench, capsys):
    assert bench.main(["--shapes", "4x64", "--repeats", "1", "--device", "cpu", "--no-check"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("cpu")]
    assert len(rows) == 3 * 2 * 3  # formats x profiles x ops
    assert all(line.rstrip().endswith("same") for line in rows), out


def test_config_rejects_what_it_cannot_compare(bench):
    with pytest.raises(ValueError, match="no torchao twin"):
        bench.BenchConfig(((4, 64),), ("mxfp4",), ("modelopt-export",), 1, ("cpu",), True)
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "4x65"])
