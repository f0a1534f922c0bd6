"""jobs/bench_analysis.py runs each pass in a spawned child: a child that dies before it sends
its result must fail the benchmark, not leave the parent waiting for ever (a GPU host's
benchmark call once sat out its whole time limit that way, behind an import error)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[2] / "jobs" / "bench_analysis.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_analysis", JOB)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_a_child_that_dies_before_sending_fails_the_run(bench, tmp_path):
    got: list = []

    def call():
        try:  # no checkpoint there: the child raises before it sends anything
            bench._in_child("stored_vs_recipes", "mxfp4", str(tmp_path / "absent"), None,
                            "auto", 1, "cpu")
        except Exception as e:  # noqa: BLE001 - what the parent raised is the result
            got.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(240)  # a spawned child imports torch and workbench: seconds, even on a loaded host
    assert not t.is_alive(), "the parent still waits for a child that is gone"
    assert len(got) == 1 and isinstance(got[0], RuntimeError), got
    assert "failed with exit code 1" in str(got[0])
