"""LaunchSpec validation, presets, the job's TrainConfig and argv, JSON round trip, and import
hygiene (no cluster needed)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from workbench.launch import LaunchSpec, LaunchSpecError, ep4, ep8, local
from workbench.train.args import config_from_args


def test_presets_shape_the_world():
    a, b, c = ep4(), ep8(), local()
    assert (a.nodes, a.tasks_per_node, a.ep, a.executor) == (1, 4, 4, "slurm")
    assert (b.nodes, b.tasks_per_node, b.ep, b.executor) == (2, 4, 8, "slurm")
    assert (c.nodes, c.tasks_per_node, c.ep, c.executor) == (1, 1, 1, "local")
    assert ep8(recipe="nvfp4", seed=3).recipe == "nvfp4"


@pytest.mark.parametrize("ep,nodes,tpn", [(4, 1, 4), (8, 2, 4), (6, 3, 2), (16, 4, 4)])
def test_tasks_per_node_derived(ep, nodes, tpn):
    s = LaunchSpec(ep=ep, nodes=nodes, executor="slurm")
    assert s.tasks_per_node == tpn and s.nodes * s.tasks_per_node == s.world_size == ep


@pytest.mark.parametrize("kwargs,words", [
    ({"ep": 6, "nodes": 4, "executor": "slurm"}, "split evenly"),
    ({"ep": 8, "nodes": 2, "tasks_per_node": 2, "executor": "slurm"}, "world size"),
    ({"ep": 8, "nodes": 2}, "executor='local'"),
    ({"ep": 4, "gpus_per_node": 2}, "own GPU"),
    ({"executor": "pbs"}, "executor"),
    ({"wandb": "yes"}, "wandb"),
    ({"steps": 0}, "steps"),
    ({"steps": True}, "steps"),
    ({"recipe": "bf16", "profile": "rceil"}, "quantized recipe"),
    ({"export": "gguf"}, "export"),
    ({"time_min": 1, "signal_delay_s": 60}, "signal_delay_s"),
    ({"recipe": "mx fp4"}, "recipe"),
    ({"target": "not a path"}, "target"),
    ({"trainer_args": "--resume"}, "trainer_args"),
    ({"sbatch": ["qos"]}, "sbatch"),
])
def test_bad_specs_raise_typed_errors(kwargs, words):
    with pytest.raises(LaunchSpecError, match=words):
        LaunchSpec(**kwargs)


def test_trainer_argv_parses_back_to_the_spec(tmp_path):
    (tmp_path / "ck").mkdir()
    s = LaunchSpec(preset="small", recipe="mxfp4+mxfp8", profile="floor", steps=7, seed=5,
                   wandb="disabled", run_group="g1", ckpt_every=3, init=tmp_path / "ck",
                   export="bf16", trainer_args=("--keep", "4"))
    p = argparse.ArgumentParser()  # the trainer's documented flags, as an independent reader
    for flag in ("--preset", "--recipe", "--out", "--wandb", "--run-group", "--init", "--profile",
                 "--export"):
        p.add_argument(flag)
    for flag in ("--steps", "--seed", "--ckpt-every", "--keep"):
        p.add_argument(flag, type=int)
    p.add_argument("--deterministic", action="store_true")
    args, _ = p.parse_known_args(s.trainer_argv(tmp_path))
    assert args.deterministic  # the default: bitwise-reproducible runs
    assert (args.preset, args.recipe, args.profile, args.steps, args.seed) == (
        "small", "mxfp4+mxfp8", "floor", 7, 5)
    assert args.export == "bf16"
    assert (args.out, args.wandb, args.run_group, args.init, args.ckpt_every) == (
        str(tmp_path), "disabled", "g1", str(tmp_path / "ck"), 3)
    assert args.keep == 4  # trainer_args reach the trainer


def test_trainer_argv_is_accepted_by_the_real_trainer_parser(tmp_path):
    s = LaunchSpec(preset="tiny", recipe="mxfp4", profile="floor", steps=3, seed=2, run_group="g",
                   ckpt_every=2, export="compressed-tensors", wandb="disabled")
    cfg = config_from_args(s.trainer_argv(tmp_path))
    assert (cfg.preset, cfg.recipe, cfg.profile, cfg.steps, cfg.seed, cfg.ckpt_every) == (
        "tiny", "mxfp4", "floor", 3, 2, 2)
    assert (cfg.out, cfg.export, cfg.wandb, cfg.run_group) == (
        str(tmp_path), "compressed-tensors", "disabled", "g")


def test_json_round_trip_and_immutability(tmp_path):
    s = ep8(recipe="nvfp4", sbatch={"qos": "high"}, env={"A": 1}, folder=tmp_path,
            pythonpath=[str(tmp_path)])
    d = json.loads(json.dumps(s.to_json()))
    assert LaunchSpec.from_json(d) == s
    with pytest.raises(TypeError):
        s.sbatch["qos"] = "low"
    assert s.env["A"] == "1"
    with pytest.raises(LaunchSpecError, match="unknown fields"):
        LaunchSpec.from_json({**d, "gpus": 3})


def test_import_is_light():
    """Importing the launcher and building a GPU run's spec (its TrainConfig, the job's argv, the
    preset's model config) load no torch: a notebook that only launches stays light."""
    code = ("import sys, workbench.launch as L; "
            "s = L.ep4(preset='qwen3_30b_a3b_like', recipe='mxfp4+mxfp8', gpus_per_node=4, "
            "trainer_args=('--batch', '8')); "
            "assert s.train_config.batch == 8 and '--batch' in s.trainer_argv('/tmp/run'); "
            "print(sorted(m for m in ('submitit', 'pandas', 'torch', 'wandb') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("recipe", ["mxfp44", "mxfp5", "mxfp4+nvfp4", "mxfp4:nosuch"])
def test_bad_recipe_raises_at_construction(recipe):
    """The trainer's own parser runs when the spec is built, not minutes later in the job."""
    with pytest.raises(LaunchSpecError, match="recipe") as e:
        LaunchSpec(preset="tiny", recipe=recipe)
    assert "\n" not in str(e.value) and "accepted" in str(e.value) or "choose" in str(e.value)


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4+mxfp8", "mxfp4:floor+mxfp8", "nvfp4:te"])
def test_every_qat_recipe_launches_into_the_trainer(tmp_path, recipe):
    from workbench.formats.recipe import parse_qat_recipe

    s = LaunchSpec(preset="tiny", recipe=recipe)
    cfg = config_from_args(s.trainer_argv(tmp_path))
    assert cfg.qat_recipe == parse_qat_recipe(recipe)
    assert ":" not in s.name  # folder and Slurm job names


def test_a_real_checkpoint_run_reaches_the_trainer_as_flags(tmp_path, monkeypatch):
    """preset=None + init: the model comes from the checkpoint; data, val_data, tokenizer and
    distill become the trainer's flags, with local paths made absolute."""
    for name in ("ckpt", "tok", "docs"):
        (tmp_path / name).mkdir()
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "val.jsonl").write_text('{"text": "y"}\n')
    monkeypatch.chdir(tmp_path)
    s = LaunchSpec(preset=None, init="ckpt", recipe="mxfp4", steps=3, wandb="disabled",
                   data=["train.jsonl", "docs", "hf:org/name:cfg:train"], val_data=["val.jsonl"],
                   tokenizer="tok", distill=True)
    assert s.name.startswith("ckpt-mxfp4-ep1")
    cfg = config_from_args(s.trainer_argv(tmp_path / "out"))
    assert cfg.preset is None and cfg.init == str(tmp_path / "ckpt") and cfg.distill
    assert cfg.data == (str(tmp_path / "train.jsonl"), str(tmp_path / "docs"),
                        "hf:org/name:cfg:train")
    assert cfg.val_data == (str(tmp_path / "val.jsonl"),)
    assert cfg.tokenizer == str(tmp_path / "tok")
    assert LaunchSpec.from_json(s.to_json()) == s
    # the default spec passes none of these flags
    plain = LaunchSpec().trainer_argv(tmp_path / "o")
    assert not {"--data", "--val-data", "--tokenizer", "--distill", "--init"} & set(plain)


@pytest.mark.parametrize("kwargs, words", [
    ({"preset": None}, "give init"),
    ({"distill": True}, "give init"),
    ({"distill": "yes", "init": "."}, "distill must be a bool"),
    ({"data": "train.jsonl"}, "not one string"),
    ({"data": ["missing.jsonl"]}, "data 'missing.jsonl' does not exist"),
    ({"data": ["."], "val_data": ["nope"]}, "val_data 'nope' does not exist"),
    ({"val_data": ["."]}, "val_data needs data"),
    ({"init": "no-such-ckpt"}, "init 'no-such-ckpt' does not exist"),
    ({"tokenizer": "hf:org/tok"}, "tokenizer 'hf:org/tok' does not exist"),
])
def test_bad_real_data_specs_fail_at_construction(kwargs, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchSpecError, match=words):
        LaunchSpec(**kwargs)


def test_fsdp_layouts_shape_the_world_and_reach_the_trainer(tmp_path):
    from workbench.launch import ep4x2_fsdp

    s = ep4x2_fsdp(preset="tiny")
    assert (s.nodes, s.tasks_per_node, s.ep, s.dp, s.world_size) == (2, 4, 4, 2, 8)
    assert "ep4x2-fsdp" in s.name
    cfg = config_from_args(s.trainer_argv(tmp_path))
    assert (cfg.ep, cfg.fsdp) == (4, True)
    cfg.check_world(s.world_size)  # the trainer accepts the layout at the spec's world size
    plain = config_from_args(LaunchSpec(ep=4, nodes=1, executor="slurm").trainer_argv(tmp_path))
    assert (plain.ep, plain.fsdp) == (None, False)  # EP = world, as before
    assert LaunchSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("kwargs,words", [
    ({"ep": 2, "dp": 2, "executor": "slurm"}, "needs fsdp"),
    ({"ep": 2, "dp": 2, "fsdp": True, "nodes": 2, "tasks_per_node": 4, "executor": "slurm"},
     "world size"),
    ({"ep": 3, "dp": 1, "fsdp": True, "nodes": 2, "executor": "slurm"}, "split evenly"),
    ({"fsdp": 1}, "fsdp must be a bool"),
    ({"dp": 0}, "dp must be a positive int"),
])
def test_bad_fsdp_specs_raise_typed_errors(kwargs, words):
    with pytest.raises(LaunchSpecError, match=words):
        LaunchSpec(**kwargs)


@pytest.mark.parametrize("kwargs, words", [
    ({"trainer_args": ("--nosuch", "1")}, "unrecognized arguments: --nosuch 1"),
    ({"trainer_args": ("--batch", "abc")}, "argument --batch: invalid int value: 'abc'"),
    ({"preset": "nosuch"}, "unknown preset 'nosuch'"),
    ({"recipe": "bf16", "export": "compressed-tensors"}, "recipe 'bf16' has none"),
    ({"trainer_args": ("--distill",)}, "--distill needs --init"),
    ({"trainer_args": ("--batch", "0")}, "TrainConfig.batch must be a positive int"),
])
def test_runs_the_trainer_refuses_fail_at_construction(kwargs, words):
    """What the job's trainer would refuse minutes later fails when the spec is built, one line."""
    with pytest.raises(LaunchSpecError) as e:
        LaunchSpec(**kwargs)
    msg = str(e.value)
    assert msg.startswith("LaunchSpec: the trainer refuses this run: ") and words in msg, msg
    assert "\n" not in msg


def test_trainer_args_may_not_move_the_run_folder():
    with pytest.raises(LaunchSpecError, match="may not set --out"):
        LaunchSpec(trainer_args=("--out", "elsewhere"))


def test_the_spec_holds_the_jobs_train_config(tmp_path):
    """train_config is what the job's trainer parses from the job's argv: spec fields, the
    trainer_args over them (last flag wins), and every other field at the preset's value."""
    s = LaunchSpec(preset="small", recipe="nvfp4+mxfp8", steps=9, seed=4, wandb="disabled",
                   activation_checkpointing="selective", ep=2, fsdp=True, executor="slurm",
                   trainer_args=("--batch", "6", "--lr", "2.5e-4", "--steps", "11",
                                 "--allow-config-change", "steps,lr"))
    job_argv = s.trainer_argv(tmp_path / "run")
    job = config_from_args(job_argv)
    assert s.train_config.replace(out=job.out) == job
    # the old way of writing the argv (spec flags + trainer_args as given) parses to the same run
    assert config_from_args(s._spec_argv(tmp_path / "run") + list(s.trainer_args)) == job
    assert (job.preset, job.recipe, job.steps, job.seed, job.batch, job.lr) == (
        "small", "nvfp4+mxfp8", 11, 4, 6, 2.5e-4)
    assert (job.activation_checkpointing, job.ep, job.fsdp, job.allow_config_change) == (
        "selective", 2, True, ("steps", "lr"))
    assert (job.seq, job.warmup, job.val_every) == (128, 20, 25)  # the small preset's
    assert job.out == str(tmp_path / "run")
    # with a folder, train_config names it; submit runs in the same resolved folder
    placed = LaunchSpec(folder=tmp_path / "f")
    assert placed.train_config.out == str((tmp_path / "f").resolve())


def test_another_target_gets_its_own_flags_unread(tmp_path):
    own = ("--step-s", "0.3", "--nosuch")
    s = LaunchSpec(target="launch_targets:counting_loop", stop_hook="launch_targets:request_stop",
                   steps=5, seed=2, trainer_args=own)
    argv = s.trainer_argv(tmp_path)
    assert argv[-3:] == list(own)  # as given, after the trainer's flags
    assert config_from_args(argv[:-3]) == s.train_config.replace(out=str(tmp_path))
    assert (s.train_config.steps, s.train_config.seed) == (5, 2)
    with pytest.raises(LaunchSpecError, match="unrecognized arguments"):  # the trainer reads them
        LaunchSpec(trainer_args=own)


def test_json_round_trip_rebuilds_the_train_config(tmp_path):
    s = LaunchSpec(recipe="mxfp4", trainer_args=("--batch", "4"), folder=tmp_path)
    d = json.loads(json.dumps(s.to_json()))
    assert "_train_config" not in d
    back = LaunchSpec.from_json(d)
    assert back == s and back.train_config == s.train_config and back.train_config.batch == 4
    with pytest.raises(LaunchSpecError, match="unknown fields"):
        LaunchSpec.from_json({**d, "_train_config": None})
