"""LaunchSpec: the job's TrainConfig plus its Resources. Presets, layouts, the job's argv, JSON
round trip, sweeps, the preflight at submit, and import hygiene (no cluster needed)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from workbench.launch import (
    LaunchSpec,
    LaunchSpecError,
    Resources,
    ep4,
    ep4x2_fsdp,
    ep8,
    local,
    submit,
    sweep_specs,
)
from workbench.train.args import config_from_args
from workbench.train.config import TrainConfig, run_config, small


def test_the_spec_holds_no_copy_of_a_trainer_field():
    """The trainer's configuration lives in `train` only: no field of the spec or its resources
    shadows a TrainConfig field."""
    trainer = {f.name for f in dataclasses.fields(TrainConfig)}
    launcher = {f.name for f in dataclasses.fields(LaunchSpec)} | \
        {f.name for f in dataclasses.fields(Resources)}
    assert trainer & launcher == set()
    assert {f.name for f in dataclasses.fields(LaunchSpec)} == {
        "train", "resources", "target", "stop_hook", "target_args"}


def test_presets_shape_the_world():
    a, b, c, d = ep4(), ep8(), local(), ep4x2_fsdp()
    assert (a.resources.nodes, a.resources.tasks_per_node, a.ep, a.resources.executor) == \
        (1, 4, 4, "slurm")
    assert (b.resources.nodes, b.resources.tasks_per_node, b.ep, b.resources.executor) == \
        (2, 4, 8, "slurm")
    assert (c.resources.nodes, c.resources.tasks_per_node, c.ep, c.resources.executor) == \
        (1, 1, 1, "local")
    assert (d.resources.nodes, d.resources.tasks_per_node, d.ep, d.dp, d.train.fsdp) == \
        (2, 4, 4, 2, True)
    assert ep8(recipe="nvfp4", seed=3).train.recipe == "nvfp4"


@pytest.mark.parametrize("ep,nodes,tpn,batch", [(4, 1, 4, 8), (8, 2, 4, 8), (6, 3, 2, 12),
                                                (16, 4, 4, 16)])
def test_tasks_per_node_derived(ep, nodes, tpn, batch):
    s = LaunchSpec.build(ep=ep, nodes=nodes, executor="slurm", batch=batch)
    assert s.resources.tasks_per_node == tpn and s.world_size == nodes * tpn == ep
    assert s.train.ep == ep


@pytest.mark.parametrize("kwargs,words", [
    ({"ep": 6, "nodes": 4, "executor": "slurm"}, "split evenly"),
    ({"ep": 8, "nodes": 2, "tasks_per_node": 2, "executor": "slurm"}, "nodes x tasks_per_node"),
    ({"ep": 8, "nodes": 2}, "executor='local'"),
    ({"ep": 4, "gpus_per_node": 2}, "own GPU"),
    ({"executor": "pbs"}, "executor"),
    ({"wandb": "yes"}, r"TrainConfig\.wandb must be one of"),
    ({"steps": 0}, r"TrainConfig\.steps must be a positive int"),
    ({"steps": True}, "steps"),
    ({"recipe": "bf16", "profile": "rceil"}, "quantized recipe"),
    ({"export": "gguf"}, "export"),
    ({"time_min": 1, "signal_delay_s": 60}, "signal_delay_s"),
    ({"recipe": "mx fp4"}, "recipe"),
    ({"target": "not a path"}, "target"),
    ({"target_args": ("--step-s", "1")}, "target of your own"),
    ({"sbatch": ["qos"]}, "sbatch"),
    ({"mem": "lots"}, "mem"),
    ({"nosuch": 1}, r"\['nosuch'\] is neither a TrainConfig nor a Resources field"),
    ({"trainer_args": ("--batch", "8")}, "e.g. batch=8"),
    ({"ep": 0}, "ep must be a positive int"),
    ({"dp": 0}, "dp must be a positive int"),
    ({"batch": 6, "ep": 4}, "multiple of the world size 4"),
])
def test_bad_specs_raise_one_line_typed_errors(kwargs, words):
    with pytest.raises(LaunchSpecError, match=words) as e:
        LaunchSpec.build(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"trainer_args": ("--distill",)}, "e.g. batch=8"),
    ({"preset": "nosuch"}, "unknown preset 'nosuch'"),
    ({"recipe": "bf16", "export": "compressed-tensors"}, "recipe 'bf16' has none"),
    ({"distill": True}, "--distill needs --init"),
    ({"batch": 0}, "TrainConfig.batch must be a positive int"),
    ({"preset": None}, "--init must be set"),
])
def test_runs_the_trainer_refuses_fail_at_construction(kwargs, words):
    """What the job's trainer would refuse minutes later fails when the spec is built, one line,
    by the trainer's own checks (TrainConfig's)."""
    with pytest.raises(LaunchSpecError) as e:
        LaunchSpec.build(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_job_argv_is_read_back_by_an_independent_parser(tmp_path):
    (tmp_path / "ck").mkdir()
    s = LaunchSpec.build(preset="small", recipe="mxfp4+mxfp8", profile="floor", steps=7, seed=5,
                         wandb="disabled", run_group="g1", ckpt_every=3, init=tmp_path / "ck",
                         export="bf16", keep=4, folder=tmp_path / "run")
    p = argparse.ArgumentParser()  # the trainer's documented flags, as an independent reader
    for flag in ("--preset", "--recipe", "--out", "--wandb", "--run-group", "--init", "--profile",
                 "--export"):
        p.add_argument(flag)
    for flag in ("--steps", "--seed", "--ckpt-every", "--keep"):
        p.add_argument(flag, type=int)
    p.add_argument("--deterministic", action="store_true")
    args, _ = p.parse_known_args(s.job_argv())
    assert args.deterministic  # the default: bitwise-reproducible runs
    assert (args.preset, args.recipe, args.profile, args.steps, args.seed) == (
        "small", "mxfp4+mxfp8", "floor", 7, 5)
    assert (args.out, args.wandb, args.run_group, args.init, args.ckpt_every, args.keep) == (
        str(tmp_path / "run"), "disabled", "g1", str(tmp_path / "ck"), 3, 4)
    assert args.export == "bf16"


def test_the_job_argv_is_the_specs_train_config(tmp_path):
    """What the job's trainer parses from its argv is exactly `spec.train`: the preset's values
    under the keywords, every field written out."""
    s = LaunchSpec.build(preset="small", recipe="nvfp4+mxfp8", steps=9, seed=4, wandb="disabled",
                         activation_checkpointing="selective", ep=2, fsdp=True, executor="slurm",
                         batch=6, lr=2.5e-4, allow_config_change=("steps", "lr"),
                         beta2=0.98, folder=tmp_path / "run")
    job = config_from_args(s.job_argv(), raising=True)
    assert job == s.train
    assert (job.preset, job.recipe, job.steps, job.seed, job.batch, job.lr, job.beta2) == (
        "small", "nvfp4+mxfp8", 9, 4, 6, 2.5e-4, 0.98)
    assert (job.activation_checkpointing, job.ep, job.fsdp, job.allow_config_change) == (
        "selective", 2, True, ("steps", "lr"))
    assert (job.seq, job.warmup, job.val_every) == (128, 20, 25)  # the small preset's
    assert job.out == str(tmp_path / "run")
    # the same config built by hand is the same spec
    by_hand = LaunchSpec(run_config(str(tmp_path / "run"), preset="small", recipe="nvfp4+mxfp8",
                                    steps=9, seed=4, wandb="disabled", ep=2, fsdp=True, batch=6,
                                    lr=2.5e-4, allow_config_change=("steps", "lr"), beta2=0.98,
                                    activation_checkpointing="selective"),
                         Resources(executor="slurm", nodes=1, tasks_per_node=2))
    assert by_hand == s


def test_a_train_config_built_elsewhere_launches_as_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = small("runs/x", steps=3, batch=4, weight_decay=0.0)
    s = LaunchSpec(cfg, Resources(executor="slurm", nodes=2, tasks_per_node=2))
    assert s.train == cfg.replace(out=str(tmp_path / "runs" / "x"))  # made absolute, nothing else
    assert config_from_args(s.job_argv(), raising=True) == s.train
    with pytest.raises(LaunchSpecError, match=r"multiple of the world size 8"):
        LaunchSpec(cfg, Resources(executor="slurm", nodes=2, tasks_per_node=4))
    with pytest.raises(LaunchSpecError, match="must be a TrainConfig"):
        LaunchSpec(cfg.to_dict())


def test_json_round_trip_and_immutability(tmp_path):
    s = ep8(recipe="nvfp4", sbatch={"qos": "high"}, env={"A": 1}, folder=tmp_path,
            pythonpath=[str(tmp_path)], data=("hf:org/name",), mem="64G")
    d = json.loads(json.dumps(s.to_json()))
    assert LaunchSpec.from_json(d) == s
    with pytest.raises(TypeError):
        s.resources.sbatch["qos"] = "low"
    assert s.resources.env["A"] == "1"
    with pytest.raises(LaunchSpecError, match="unknown fields"):
        LaunchSpec.from_json({**d, "gpus": 3})
    with pytest.raises(LaunchSpecError, match="no field"):
        LaunchSpec.from_json({**d, "train": {**d["train"], "gpus": 3}})
    with pytest.raises(LaunchSpecError, match="unknown fields"):
        LaunchSpec.from_json({**d, "resources": {**d["resources"], "steps": 3}})


def test_import_is_light():
    """Importing the launcher and building a GPU run's spec (its TrainConfig, the job's argv)
    load no torch: a notebook that only launches stays light."""
    code = ("import sys, workbench.launch as L; "
            "s = L.ep4(preset='qwen3_30b_a3b_like', recipe='mxfp4+mxfp8', gpus_per_node=4, "
            "batch=8, folder='/tmp/run'); "
            "assert s.train.batch == 8 and '--batch=8' in s.job_argv(); "
            "print(sorted(m for m in ('submitit', 'pandas', 'torch', 'wandb') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("recipe", ["mxfp44", "mxfp5", "mxfp4+nvfp4", "mxfp4:nosuch"])
def test_bad_recipe_raises_at_construction(recipe):
    with pytest.raises(LaunchSpecError, match="recipe") as e:
        LaunchSpec.build(preset="tiny", recipe=recipe)
    assert "\n" not in str(e.value) and ("accepted" in str(e.value) or "choose" in str(e.value))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4+mxfp8", "mxfp4:floor+mxfp8", "nvfp4:te"])
def test_every_qat_recipe_launches_into_the_trainer(recipe):
    from workbench.formats.recipe import parse_qat_recipe

    s = LaunchSpec.build(preset="tiny", recipe=recipe)
    cfg = config_from_args(s.job_argv(), raising=True)
    assert cfg.qat_recipe == parse_qat_recipe(recipe)
    assert ":" not in s.name and ":" not in s.folder.name  # folder and Slurm job names


def test_a_real_checkpoint_run_reaches_the_trainer_as_flags(tmp_path, monkeypatch):
    """preset=None + init: the model comes from the checkpoint; data, val_data, tokenizer and
    distill become the trainer's flags, with local paths made absolute (hub names kept)."""
    for name in ("ckpt", "tok", "docs"):
        (tmp_path / name).mkdir()
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "val.jsonl").write_text('{"text": "y"}\n')
    monkeypatch.chdir(tmp_path)
    s = LaunchSpec.build(preset=None, init="ckpt", recipe="mxfp4", steps=3, wandb="disabled",
                         data=("train.jsonl", "docs", "hf:org/name:cfg:train"),
                         val_data=("val.jsonl",), tokenizer="tok", distill=True,
                         token_cache="cache")
    assert s.name.startswith("ckpt-mxfp4-ep1")
    assert s.folder.parent == tmp_path / "runs" and s.folder.name.startswith(s.name)
    cfg = config_from_args(s.job_argv(), raising=True)
    assert cfg.preset is None and cfg.init == str(tmp_path / "ckpt") and cfg.distill
    assert cfg.data == (str(tmp_path / "train.jsonl"), str(tmp_path / "docs"),
                        "hf:org/name:cfg:train")
    assert cfg.val_data == (str(tmp_path / "val.jsonl"),)
    assert cfg.tokenizer == str(tmp_path / "tok") and cfg.token_cache == str(tmp_path / "cache")
    assert LaunchSpec.from_json(s.to_json()) == s
    # preset left out with init: the checkpoint's own model, as on the command line
    assert LaunchSpec.build(init="ckpt").train.preset is None
    assert LaunchSpec.build().train.preset == "tiny"


@pytest.mark.parametrize("kwargs, words", [
    ({"data": ("missing.jsonl",)}, "data '{tmp}/missing.jsonl'"),
    ({"data": (".",), "val_data": ("nope",)}, "val_data '{tmp}/nope'"),
    ({"init": "no-such-ckpt", "preset": "tiny"}, "init '{tmp}/no-such-ckpt'"),
    ({"tokenizer": "hf:org/tok"}, "tokenizer '{tmp}/hf:org/tok'"),
])
def test_missing_inputs_are_refused_at_submit_before_anything_is_queued(kwargs, words, tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = LaunchSpec.build(folder=tmp_path / "run", **kwargs)
    with pytest.raises(LaunchSpecError, match="does not exist; nothing was queued") as e:
        submit(s)
    assert words.format(tmp=tmp_path) in str(e.value)
    assert not (tmp_path / "run").exists()


def test_fsdp_layouts_shape_the_world_and_reach_the_trainer():
    s = ep4x2_fsdp(preset="tiny")
    assert (s.resources.nodes, s.resources.tasks_per_node, s.ep, s.dp, s.world_size) == \
        (2, 4, 4, 2, 8)
    assert "ep4x2-fsdp" in s.name
    cfg = config_from_args(s.job_argv(), raising=True)
    assert (cfg.ep, cfg.fsdp) == (4, True)
    cfg.check_world(s.world_size)  # the trainer accepts the layout at the spec's world size
    plain = LaunchSpec.build(ep=4, nodes=1, executor="slurm")
    assert (plain.train.ep, plain.train.fsdp, plain.dp) == (4, False, 1)
    assert LaunchSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("kwargs,words", [
    ({"ep": 2, "dp": 2, "executor": "slurm"}, "needs --fsdp"),
    ({"ep": 2, "dp": 2, "fsdp": True, "nodes": 2, "tasks_per_node": 4, "executor": "slurm"},
     "world size"),
    ({"ep": 3, "dp": 1, "fsdp": True, "nodes": 2, "executor": "slurm"}, "split evenly"),
    ({"fsdp": 1}, r"TrainConfig\.fsdp must be a bool"),
])
def test_bad_fsdp_specs_raise_typed_errors(kwargs, words):
    with pytest.raises(LaunchSpecError, match=words):
        LaunchSpec.build(**kwargs)


def test_the_layout_rule_is_the_trainers(tmp_path):
    """One rule for the layout, checked by TrainConfig.check_world: a spec whose resources do
    not fit its TrainConfig's ep is refused with the trainer's own words."""
    cfg = run_config(str(tmp_path), ep=2)
    with pytest.raises(LaunchSpecError, match=r"--ep 2.*< world size 4 needs --fsdp"):
        LaunchSpec(cfg, Resources(nodes=1, tasks_per_node=4))
    with pytest.raises(LaunchSpecError, match=r"--ep 3.*does not divide the world size 4"):
        LaunchSpec(cfg.replace(ep=3, fsdp=True), Resources(nodes=1, tasks_per_node=4))
    assert LaunchSpec(cfg.replace(fsdp=True), Resources(tasks_per_node=4)).dp == 2


def test_another_target_gets_its_own_flags_after_the_trainers():
    own = ("--step-s", "0.3", "--nosuch")
    s = LaunchSpec.build(target="launch_targets:counting_loop",
                         stop_hook="launch_targets:request_stop", steps=5, seed=2,
                         target_args=own)
    argv = s.job_argv()
    assert argv[-3:] == list(own)
    assert config_from_args(argv[:-3], raising=True) == s.train
    assert (s.train.steps, s.train.seed) == (5, 2)


def test_sweep_elements_get_their_folders_groups_and_values(tmp_path):
    s = LaunchSpec.build(folder=tmp_path / "sw", steps=3)
    specs = sweep_specs(s, recipes=["bf16", "mxfp4"], lr=[1e-3, 2e-3])
    assert [x.folder.name for x in specs] == [
        "tiny-bf16-ep1-s0-lr0.001", "tiny-bf16-ep1-s0-lr0.002", "tiny-mxfp4-ep1-s0-lr0.001",
        "tiny-mxfp4-ep1-s0-lr0.002"]
    assert {x.folder.parent for x in specs} == {tmp_path / "sw"}
    assert {x.train.run_group for x in specs} == {"sw"}
    assert [(x.train.recipe, x.train.lr) for x in specs] == [
        ("bf16", 1e-3), ("bf16", 2e-3), ("mxfp4", 1e-3), ("mxfp4", 2e-3)]
    assert [x.train.seed for x in sweep_specs(s, seed=[0, 1])] == [0, 1]
    with pytest.raises(LaunchSpecError, match="given twice"):
        sweep_specs(s, seeds=[0], seed=[1])
    with pytest.raises(LaunchSpecError, match="non-empty sequence"):
        sweep_specs(s, recipe="mxfp4")
    with pytest.raises(LaunchSpecError, match="repeated"):
        sweep_specs(s, seed=[1, 1])
    with pytest.raises(LaunchSpecError, match=r"element \{'batch': 3\}.*multiple"):
        sweep_specs(LaunchSpec.build(ep=2, folder=tmp_path / "b"), batch=[4, 3])
    with pytest.raises(LaunchSpecError, match="no field"):
        sweep_specs(s, nosuch=[1])
