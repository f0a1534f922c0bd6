"""The trainer's command line, derived from TrainConfig's declarations: every field is a flag,
argv -> TrainConfig -> argv is exact for every field, refusals are one line with exit code 2, and
`workbench train`, `python -m workbench.train.cli` and `jobs/qat.py` run the same parser."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.train.args import TrainArgsError, config_from_args, parser, trainer_argv
from workbench.train.config import (
    CHANGEABLE,
    FREE,
    Option,
    TrainConfig,
    declared,
    option,
    small,
    tiny,
)

ROOT = Path(__file__).resolve().parents[2]

# Every field at a value that is neither TrainConfig's default nor the small preset's; a field
# added to TrainConfig without an entry here fails test_every_field_has_a_test_value.
ALL = {
    "out": "/runs/all fields", "preset": "small", "recipe": "mxfp4+mxfp8", "profile": "floor",
    "steps": 7, "batch": 6, "seq": 17, "lr": 1.5e-4, "min_lr_ratio": 0.25, "warmup": 3,
    "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99, "adam_eps": 1e-6, "grad_clip": 0.5,
    "skip_nonfinite_steps": 2,
    "val_every": 4, "val_batches": 3, "ckpt_every": 5, "keep": 4, "seed": 9, "resume": True,
    "init": "/ck", "export": "compressed-tensors", "data": ("a.jsonl", "-dash.txt"),
    "val_data": ("c.jsonl",), "tokenizer": "tok", "token_cache": "tc", "distill": True,
    "kd_temperature": 2.0, "kd_weight": 0.5, "ce_weight": 0.25, "wandb": "disabled",
    "run_group": "g", "project": "p", "run_name": "-n", "deterministic": False,
    "activation_checkpointing": "selective", "compile": True, "ep": 2, "fsdp": True, "expert_stats_every": 3,
    "dist_timeout": 2.5, "allow_config_change": ("steps", "lr"), "router_bias_update": 0.001,
}
# What a field needs beside it to be valid on its own.
NEEDS = {"profile": {"recipe": "mxfp4"}, "export": {"recipe": "mxfp4"},
         "distill": {"init": "/ck"}, "val_data": {"data": ("a.jsonl",)}}


def test_every_field_has_a_test_value():
    base, preset = TrainConfig(out="x"), small("x")
    assert set(ALL) == {f.name for f in dataclasses.fields(TrainConfig)}
    for name, v in ALL.items():
        if name not in ("out", "preset"):
            assert v != getattr(base, name) and v != getattr(preset, name), name


def test_every_field_round_trips_at_once():
    cfg = TrainConfig(**ALL)
    argv = trainer_argv(cfg)
    assert config_from_args(argv, raising=True) == cfg
    # the text of a few flags, written out by hand
    for text in ("--out=/runs/all fields", "--batch=6", "--lr=0.00015", "--no-deterministic",
                 "--data=a.jsonl", "--data=-dash.txt", "--allow-config-change=steps,lr",
                 "--run-name=-n", "--resume", "--fsdp", "--ep=2", "--beta1=0.8"):
        assert text in argv, text
    none = cfg.replace(preset=None)  # the checkpoint's own model
    assert "--preset=checkpoint" in trainer_argv(none)
    assert config_from_args(trainer_argv(none), raising=True) == none


@pytest.mark.parametrize("name", sorted(ALL))
def test_each_field_round_trips_alone_over_a_preset(name):
    """One field changed from the small preset's values: the argv carries it, and no other
    field drifts to TrainConfig's default on the way back."""
    cfg = small("/runs/one").replace(**{name: ALL[name], **NEEDS.get(name, {})})
    back = config_from_args(trainer_argv(cfg), raising=True)
    assert back == cfg and getattr(back, name) == ALL[name]


def test_awkward_values_survive(tmp_path):
    awkward = math.nextafter(3e-4, 1.0)  # no short decimal spelling
    cfg = tiny(str(tmp_path), lr=awkward, run_group="", project="a=b", seed=2**40)
    back = config_from_args(trainer_argv(cfg), raising=True)
    assert back == cfg and back.lr == awkward and back.project == "a=b"


def test_flags_left_out_keep_the_preset(tmp_path):
    cfg = config_from_args(["--out", str(tmp_path), "--preset", "small", "--lr", "1e-3"])
    assert (cfg.batch, cfg.seq, cfg.steps, cfg.warmup, cfg.lr) == (16, 128, 200, 20, 1e-3)
    assert config_from_args(["--out", str(tmp_path)]).preset == "tiny"
    with_init = config_from_args(["--out", str(tmp_path), "--init", "ck"])
    assert with_init.preset is None and (with_init.lr, with_init.seq) == (1e-5, 1024)
    assert config_from_args(["--out", str(tmp_path), "--init", "ck", "--preset", "tiny"]).preset \
        == "tiny"
    assert config_from_args(["--out=x", "--data", "a", "--data=b"]).data == ("a", "b")


def test_every_field_is_a_flag_with_its_help():
    text = " ".join(parser().format_help().split())
    for d in declared(TrainConfig):
        assert d.flag in text and " ".join(d.option.help.split())[:30] in text, d.name
    assert "--no-deterministic" in text and "--no-fsdp" in text


def test_resume_rules_come_from_the_declarations():
    """The sets resume_config enforces, as docs/resume.md states them."""
    assert FREE == {"out", "resume", "allow_config_change", "init", "val_every", "ckpt_every",
                    "keep", "export", "wandb", "project", "run_group", "run_name",
                    "activation_checkpointing", "compile", "deterministic", "expert_stats_every", "ep",
                    "fsdp", "skip_nonfinite_steps", "dist_timeout"}
    assert CHANGEABLE == ("steps", "lr", "min_lr_ratio", "warmup", "grad_clip", "val_batches")


@pytest.mark.parametrize("bad, words", [
    ({"batch": 0}, "TrainConfig.batch must be a positive int (--batch), got 0"),
    ({"lr": float("nan")}, "TrainConfig.lr must be a finite number > 0 (--lr)"),
    ({"beta1": 1.0}, "TrainConfig.beta1 must be a finite number >= 0 and < 1"),
    ({"wandb": "on"}, "TrainConfig.wandb must be one of ('offline', 'online', 'disabled')"),
    ({"ep": True}, "TrainConfig.ep must be a positive int or None"),
    ({"data": ("",)}, "TrainConfig.data must be a tuple of non-empty strings"),
    ({"export": "gguf"}, "TrainConfig.export must be one of ('compressed-tensors', 'bf16', 'gpt-oss') or None"),
    ({"preset": "nosuch"}, "unknown preset 'nosuch'"),
])
def test_field_checks_name_the_field_and_flag(bad, words):
    with pytest.raises(ValueError) as e:
        TrainConfig(out="x", **bad)
    assert words in str(e.value), str(e.value)


def test_config_normalises_one_spelling_per_value(tmp_path):
    cfg = TrainConfig(out=tmp_path, lr=1, data=["a"], init=tmp_path / "ck", preset=None)
    assert (cfg.out, cfg.lr, cfg.data, cfg.init) == (str(tmp_path), 1.0, ("a",),
                                                     str(tmp_path / "ck"))
    assert isinstance(cfg.lr, float) and hash(cfg)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match=r"no field\(s\) \['gpus'\]"):
        TrainConfig.from_dict({"out": "x", "gpus": 1})


def test_declarations_are_checked():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        x: int = 1

    @dataclasses.dataclass(frozen=True)
    class Odd:
        x: bytes = option(b"", "raw bytes")

    with pytest.raises(TypeError, match="not declared with option"):
        declared(Bare)
    with pytest.raises(TypeError, match="not one the command line carries"):
        declared(Odd)
    with pytest.raises(ValueError, match="parse and fmt together"):
        Option("h", parse=int)
    with pytest.raises(ValueError, match="resume"):
        Option("h", resume="sometimes")


@pytest.mark.parametrize("extra, words", [
    (["--nosuch", "1"], "unrecognized arguments: --nosuch 1"),
    (["--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
    (["--batch", "0"], "TrainConfig.batch must be a positive int (--batch), got 0"),
    (["--export", "gguf"], "TrainConfig.export must be one of"),
    (["--allow-config-change", "seed"], "--allow-config-change seed: only steps, lr"),
    (["--preset", "nosuch"], "unknown preset 'nosuch'"),
    (["--recipe", "mxfp44"], "TrainConfig.recipe 'mxfp44'"),
    (["--help"], "exits here"),  # a caller's process (a notebook kernel) must not exit
])
def test_refusals_are_one_line(tmp_path, extra, words, capsys):
    argv = ["--out", str(tmp_path), *extra]
    with pytest.raises(TrainArgsError) as e:
        config_from_args(argv, raising=True)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith("workbench train: ")
    if extra != ["--help"]:
        assert capsys.readouterr().err == ""
        with pytest.raises(SystemExit) as e:  # a terminal: one line on stderr, exit code 2
            config_from_args(argv, prog="jobs/qat.py")
        assert e.value.code == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("jobs/qat.py: error: ") and words in err[0]
    with pytest.raises(TrainArgsError, match="the following arguments are required: --out"):
        parser(raising=True).parse_args([])


def _env() -> dict:
    return {"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/tmp")}


def test_entry_points_share_the_parser(tmp_path):
    """`-m workbench.train.cli` (torchrun's form) and `workbench train` print the same flags; a
    refused command line is one line and exit code 2 from each, and jobs/qat.py no longer edits
    sys.path (the package is installed, or on PYTHONPATH)."""
    helps = []
    for cmd in ([sys.executable, "-m", "workbench.train.cli", "--help"],
                [sys.executable, "-m", "workbench.cli", "train", "--help"]):
        p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=False,
                           env=_env(), timeout=300)
        assert p.returncode == 0, p.stderr
        helps.append(p.stdout.split("\n\n", 1)[1])  # past the usage, wrapped after the name
    assert helps[0] == helps[1]
    assert "--allow-config-change" in helps[1] and "--beta1" in helps[1]
    for cmd, prog in (([sys.executable, str(ROOT / "jobs" / "qat.py")], "jobs/qat.py"),
                      ([sys.executable, "-m", "workbench.cli", "train"], "workbench train")):
        p = subprocess.run([*cmd, "--out", str(tmp_path / "r"), "--batch", "0"], cwd=tmp_path,
                           capture_output=True, text=True, check=False, env=_env(), timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.strip().splitlines() == [
            f"{prog}: error: TrainConfig.batch must be a positive int (--batch), got 0"]
    assert "sys.path" not in (ROOT / "jobs" / "qat.py").read_text()


@pytest.mark.slow
def test_workbench_train_runs_the_trainer(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "train", "--steps", "2",
                        "--batch", "2", "--seq", "16", "--val-every", "0", "--ckpt-every", "0",
                        "--wandb", "disabled", "--beta2=0.9", "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, check=False, env=_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["step"] == 2
    assert json.loads((out / "config.json").read_text())["beta2"] == 0.9
