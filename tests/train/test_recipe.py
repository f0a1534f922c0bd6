"""One recipe grammar at every edge: the parser, TrainConfig, the trainer's command line
(workbench.train.args: the parser and its argv writer), LaunchSpec. Expected values are written out from the grammar, not taken from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workbench.formats.recipe import QATRecipe, Recipe, RecipeError, parse_qat_recipe
from workbench.train.args import TrainArgsError, config_from_args, parser, trainer_argv
from workbench.train.config import TrainConfig, tiny

ROOT = Path(__file__).resolve().parents[2]

GOOD = {  # text -> (weight fmt, weight profile, act fmt, act profile)
    "mxfp4": ("mxfp4", "rceil", None, None),
    "mxfp8": ("mxfp8_e4m3", "rceil", None, None),
    "mxfp8_e5m2:floor": ("mxfp8_e5m2", "floor", None, None),
    "nvfp4": ("nvfp4", "torchao", None, None),
    "nvfp4:te": ("nvfp4", "te", None, None),
    "mxfp4+mxfp8": ("mxfp4", "rceil", "mxfp8_e4m3", "rceil"),
    "nvfp4+mxfp8": ("nvfp4", "torchao", "mxfp8_e4m3", "rceil"),
    "mxfp4:floor+mxfp8:even": ("mxfp4", "floor", "mxfp8_e4m3", "even"),
    "bf16+mxfp8": (None, None, "mxfp8_e4m3", "rceil"),
    "MXFP4": ("mxfp4", "rceil", None, None),
}
BAD = ["mxfp44", "mxfp5", "mxfp4+", "mxfp4+mxfp8+mxfp8", "mxfp4:nosuch", "mxfp4+nvfp4",
       "nvfp4:rceil", "fp8", ":rceil"]


def _parts(r: QATRecipe):
    w, a = r.weight, r.act
    return (w and w.fmt, w and w.profile, a and a.fmt, a and a.profile)


@pytest.mark.parametrize("text", sorted(GOOD))
def test_grammar_and_aliases(text):
    r = parse_qat_recipe(text)
    assert _parts(r) == GOOD[text]
    assert parse_qat_recipe(str(r)) == r  # str() round-trips through the parser


@pytest.mark.parametrize("text", ["bf16", "none", "BF16", ""])
def test_baseline_spellings(text):
    assert parse_qat_recipe(text) == QATRecipe(None, None)


@pytest.mark.parametrize("text", BAD)
def test_bad_recipe_is_one_line_listing_what_is_accepted(text):
    with pytest.raises(RecipeError) as e:
        parse_qat_recipe(text)
    msg = str(e.value)
    assert "\n" not in msg
    assert "accepted" in msg or "choose one of" in msg
    assert isinstance(e.value, ValueError)


def test_mxfp4_colon_empty_profile_is_the_default():
    # "mxfp4:" names no profile: the format's default, not an error.
    assert parse_qat_recipe("mxfp4:").weight == Recipe("mxfp4", "rceil")


def test_profile_argument_applies_to_weights_only():
    r = parse_qat_recipe("mxfp4+mxfp8", "floor")
    assert (r.weight.profile, r.act.profile) == ("floor", "rceil")
    with pytest.raises(RecipeError):
        parse_qat_recipe("bf16", "floor")
    with pytest.raises(RecipeError):
        parse_qat_recipe("mxfp4:even", "floor")


@pytest.mark.parametrize("text, weight_fmt", [("nvfp4+mxfp8", "nvfp4"), ("mxfp8", "mxfp8_e4m3"),
                                              ("mxfp4:floor+mxfp8", "mxfp4"), ("none", None),
                                              ("bf16+mxfp8", None)])
def test_train_config_accepts_every_qat_recipe(tmp_path, text, weight_fmt):
    cfg = tiny(str(tmp_path), recipe=text)
    assert cfg.qat_recipe == parse_qat_recipe(text)
    assert cfg.weight_format == weight_fmt
    assert cfg.stats_every == (0 if text == "none" else cfg.val_every)


def test_train_config_rejects_a_bad_recipe_naming_the_field(tmp_path):
    with pytest.raises(RecipeError, match=r"TrainConfig\.recipe 'mxfp44'"):
        tiny(str(tmp_path), recipe="mxfp44")
    with pytest.raises(ValueError, match="compressed-tensors"):
        tiny(str(tmp_path), recipe="bf16+mxfp8", export="compressed-tensors")


def test_old_run_folders_recorded_plain_strings(tmp_path):
    # config.json of earlier runs records "recipe": "mxfp4"; the field keeps the text given, so
    # the resume comparison of recorded and current configs still matches.
    cfg = tiny(str(tmp_path), recipe="mxfp4")
    assert cfg.to_dict()["recipe"] == "mxfp4"
    assert tiny(str(tmp_path), recipe=parse_qat_recipe("mxfp4")).recipe == "mxfp4:rceil"


CONFIGS = [
    {},
    {"recipe": "nvfp4+mxfp8", "steps": 7, "seed": 3, "lr": 1.5e-4},
    {"recipe": "mxfp4:floor+mxfp8", "export": "compressed-tensors", "deterministic": False},
    {"recipe": "mxfp8", "activation_checkpointing": "selective", "expert_stats_every": 0, "keep": 5},
    {"recipe": "mxfp4", "profile": "even", "wandb": "disabled", "run_group": "g", "run_name": "n",
         "project": "p", "resume": True, "allow_config_change": ("steps", "lr")},
    {"data": ("a.jsonl", "b.txt"), "val_data": ("c.jsonl",), "tokenizer": "tok", "token_cache": "tc",
         "grad_clip": 0.0, "warmup": 0, "val_every": 0, "ckpt_every": 0, "batch": 4, "seq": 32},
    {"recipe": "nvfp4:te+mxfp8", "ep": 2, "fsdp": True, "activation_checkpointing": "full"},
    {"init": "ckpt", "distill": True, "kd_weight": 0.5, "ce_weight": 0.25, "kd_temperature": 2.0,
         "export": "bf16", "data": ("d.parquet",)},
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_trainer_argv_round_trips(tmp_path, overrides):
    cfg = tiny(str(tmp_path / "run"), **overrides)
    assert config_from_args(trainer_argv(cfg)) == cfg


def test_trainer_argv_round_trips_distill_and_checkpoint_models(tmp_path):
    cfg = TrainConfig(out=str(tmp_path), preset=None, init="ckpt", distill=True, kd_weight=0.5,
                      ce_weight=0.25, kd_temperature=2.0, batch=32, seq=1024, lr=1e-5,
                      warmup=20, steps=500, val_every=100, ckpt_every=100)
    assert config_from_args(trainer_argv(cfg)) == cfg


def test_trainer_argv_refuses_fields_without_a_flag(tmp_path):
    with pytest.raises(ValueError, match="beta1"):
        trainer_argv(tiny(str(tmp_path), beta1=0.5))


@pytest.mark.parametrize("extra, words", [
    (["--nosuch", "1"], "unrecognized arguments: --nosuch 1"),
    (["--batch", "abc"], "argument --batch: invalid int value: 'abc'"),
    (["--export", "gguf"], "argument --export: invalid choice: 'gguf'"),
    (["--allow-config-change", "seed"], "argument --allow-config-change: --allow-config-change seed"),
    (["--help"], "exits here"),  # a launcher's process (a notebook kernel) must not exit
])
def test_raising_parser_refuses_in_one_line(tmp_path, extra, words, capsys):
    argv = ["--out", str(tmp_path), *extra]
    with pytest.raises(TrainArgsError) as e:
        config_from_args(argv, raising=True)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("jobs/qat.py: ")
    if extra != ["--help"]:  # argparse's message alone: no usage printed, no "prog: error:" twice
        assert "error:" not in str(e.value) and capsys.readouterr().err == ""
        # the terminal's parser: usage and exit code 2, as argparse does
        with pytest.raises(SystemExit) as e:
            config_from_args(argv)
        assert e.value.code == 2
    with pytest.raises(TrainArgsError, match="the following arguments are required: --out"):
        parser(raising=True).parse_args([])


def test_cli_help_and_bad_flag(tmp_path):
    env = {"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "PATH": "/usr/bin"}
    p = subprocess.run([sys.executable, "-m", "workbench.train.cli", "--help"], cwd=ROOT,
                       capture_output=True, text=True, check=False, env=env)
    assert p.returncode == 0 and "--allow-config-change" in p.stdout, p.stderr
    assert p.stdout.splitlines()[0].startswith("usage: jobs/qat.py")
    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "qat.py"), "--out", str(tmp_path),
                        "--nosuch"], capture_output=True, text=True, check=False, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert [ln for ln in p.stderr.splitlines() if "error:" in ln] == [
        "jobs/qat.py: error: unrecognized arguments: --nosuch"]


def test_cli_bad_recipe_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "jobs" / "qat.py"), "--recipe", "mxfp44",
                        "--out", str(tmp_path / "r")], capture_output=True, text=True, check=False,
                       env={"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "PATH": "/usr/bin"})
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if "mxfp44" in ln]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "mxfp4+mxfp8" in lines[0]  # lists what is accepted


def test_torch_free_table_agrees_with_the_format_specs():
    from workbench.formats.constants import FORMATS
    from workbench.recipe import FORMAT_PROFILES

    assert FORMAT_PROFILES == {k: (s.profiles, s.default_profile) for k, s in FORMATS.items()}
