"""A trainer option declared once travels everywhere, with no other edit.

The fixture copies the `workbench` package and adds ONE line to the copy's TrainConfig: a new
field `travel_knob`. Run against that copy, the option is a flag of `workbench train` (help text
included), a keyword of `LaunchSpec.build`, checked where TrainConfig checks its fields, written
into the job's argv, parsed back by the trainer to the same value, and settable from notebook
02's parameters; and (slow) a job submitted from the notebook's spec records it in the run's
config.json, as the trainer saw it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import workbench

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_launch_qat.ipynb"
FIELD = '    travel_knob: float = option(0.25, "a knob only the travel test declares", gt=0)\n'


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """A copy of the package whose TrainConfig declares one more field; returns its parent."""
    src = tmp_path_factory.mktemp("with knob") / "src"
    shutil.copytree(Path(workbench.__file__).parent, src / "workbench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    config = src / "workbench" / "train" / "config.py"
    text = config.read_text()
    cls = text.index("class TrainConfig:")
    anchor = text.index("    def __post_init__(self) -> None:", cls)
    config.write_text(text[:anchor] + FIELD + "\n" + text[anchor:])
    return src


def _run(package: Path, args: list[str], cwd: Path, timeout: float = 300):
    env = {**os.environ, "PYTHONPATH": str(package), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
           "WORKBENCH_LAUNCH_INDEX": str(cwd / "index")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False, timeout=timeout)


# Runs in the copy: everything a user reaches without torch.
_SCENARIO = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import workbench
    from workbench.launch import LaunchSpec, LaunchSpecError
    from workbench.train.args import config_from_args, parser

    package, notebook, out = sys.argv[1:4]
    assert workbench.__file__.startswith(package), workbench.__file__
    seen = {"help": " ".join(parser().format_help().split())}
    spec = LaunchSpec.build(travel_knob=7.5, folder=out + "/direct")
    argv = spec.job_argv()
    seen.update(spec=spec.train.travel_knob, argv=[a for a in argv if "knob" in a],
                parsed=config_from_args(argv, raising=True).travel_knob,
                default=LaunchSpec.build(folder=out + "/d").train.travel_knob)
    try:
        LaunchSpec.build(travel_knob=-1.0)
    except LaunchSpecError as e:
        seen["refused"] = str(e)

    # Notebook 02 as papermill runs it: the parameters cell, the injected values, the cells that
    # build the spec (IPython magics are not Python).
    cells = [c for c in json.loads(Path(notebook).read_text())["cells"] if c["cell_type"] == "code"]
    ns = {}
    injected = {"executor": "local", "ep": 1, "out": out + "/nb", "wandb": "disabled",
                "train_overrides": {"travel_knob": 3.0, "steps": 1, "batch": 2, "seq": 16,
                                    "val_every": 0, "ckpt_every": 0, "export": None}}
    for i, cell in enumerate(cells):
        code = "".join(l for l in cell["source"] if not l.lstrip().startswith("%"))
        exec(code, ns)
        if "parameters" in cell["metadata"].get("tags", []):
            ns.update(injected)
        if "LaunchSpec.build(" in code:
            break
    nb_spec = ns["spec"]
    seen["notebook"] = nb_spec.train.travel_knob
    seen["notebook_argv"] = nb_spec.job_argv()
    Path(out, "notebook_spec.json").write_text(json.dumps(nb_spec.to_json()))
    print(json.dumps(seen))
""")


@pytest.fixture(scope="module")
def seen(package, tmp_path_factory) -> dict:
    cwd = tmp_path_factory.mktemp("travel")
    p = _run(package, ["-c", _SCENARIO, str(package), str(NOTEBOOK), str(cwd)], cwd)
    assert p.returncode == 0, p.stderr[-4000:]
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "cwd": str(cwd)}


def test_the_option_is_a_flag_with_its_help(seen, package, tmp_path):
    assert "--travel-knob TRAVEL_KNOB a knob only the travel test declares" in seen["help"]
    p = _run(package, ["-m", "workbench.cli", "train", "--help"], tmp_path)
    assert p.returncode == 0 and "--travel-knob" in p.stdout, p.stderr
    # and it is not in the real package: the copy's one line is what put it there
    p = _run(ROOT, ["-m", "workbench.cli", "train", "--help"], tmp_path)
    assert p.returncode == 0 and "--travel-knob" not in p.stdout


def test_the_launcher_carries_it_into_the_job_and_back(seen):
    assert seen["default"] == 0.25  # the declaration's default, through the preset
    assert seen["spec"] == 7.5 and seen["argv"] == ["--travel-knob=7.5"]
    assert seen["parsed"] == 7.5  # what the job's trainer parses from its argv
    assert "TrainConfig.travel_knob must be a finite number > 0 (--travel-knob)" in \
        seen["refused"]  # checked once, where TrainConfig checks its fields


def test_the_notebook_parameters_set_it(seen):
    assert seen["notebook"] == 3.0
    assert "--travel-knob=3.0" in seen["notebook_argv"]


_SUBMIT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from workbench.launch import LaunchSpec, submit

    spec = LaunchSpec.from_json(json.loads(Path(sys.argv[1]).read_text()))
    job = submit(spec)
    state = job.wait(timeout=500)
    assert state == "COMPLETED", job.log_tail(40)
    print(json.dumps(json.loads((job.folder / "config.json").read_text())))
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_the_trainer_runs_with_it(seen, package):
    """The notebook's spec submitted on the local executor: the trainer in the job parsed the
    option from its argv and recorded it with the run's configuration."""
    cwd = Path(seen["cwd"])
    p = _run(package, ["-c", _SUBMIT, str(cwd / "notebook_spec.json")], cwd, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    config = json.loads(p.stdout.strip().splitlines()[-1])
    assert config["travel_knob"] == 3.0 and config["steps"] == 1
