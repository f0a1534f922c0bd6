"""`make demo` (jobs/demo.py) executes every notebook the repository ships, in order, each fed
by what the earlier ones made. The notebooks themselves run headless in their own tests
(tests/launch/test_launch_notebook.py, tests/track, tests/browser); this checks the demo's
wiring without building the demo checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import workbench.demo
import workbench.eval.cli

ROOT = Path(__file__).resolve().parents[1]


def _demo_module():
    spec = importlib.util.spec_from_file_location("_demo_job", ROOT / "jobs" / "demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_demo_runs_every_notebook_in_order(tmp_path, monkeypatch):
    demo = _demo_module()
    ran: list[tuple[str, dict]] = []
    fake = workbench.demo.DemoCheckpoint(tmp_path, tmp_path / "init", tmp_path / "run",
                                         tmp_path / "packed", tmp_path / "ref")
    monkeypatch.setattr(workbench.demo, "demo_checkpoint", lambda steps: fake)
    monkeypatch.setattr(demo, "run_notebook",
                        lambda name, out, parameters: ran.append((name, parameters)) or out / name)
    evals: list[list[str]] = []
    monkeypatch.setattr(workbench.eval.cli, "main", lambda argv: evals.append(argv) or 0)
    monkeypatch.chdir(tmp_path)  # main() moves to the repository; the test's cwd comes back
    assert demo.main(["--out", str(tmp_path / "out")]) == 0
    # the README's Evaluate table: the BF16 model, its PTQ and the QAT run, on the shipped tasks
    [argv] = evals
    assert argv[:3] == [str(fake.init), f"ptq:mxfp4@{fake.init}", str(fake.run)]
    assert argv[argv.index("--tasks") + 1] == "wb_code_choice,wb_code_complete"
    names = [name for name, _ in ran]
    assert names == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    params = dict(ran)
    runs = params["02_launch_qat.ipynb"]["out"]
    assert runs == str(tmp_path / "out" / "runs")
    for later in ("03_budgets.ipynb", "04_compare.ipynb", "05_expert_telemetry.ipynb"):
        assert params[later]["group_dir"] == runs, later  # fed by notebook 02's runs
    assert params["01_inspect_checkpoint.ipynb"]["checkpoint"] == str(fake.packed)
