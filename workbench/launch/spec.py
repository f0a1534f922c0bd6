"""What to launch: a typed, validated launch spec and its presets.

A `LaunchSpec` says which trainer run to start (preset, recipe, steps, seed...) and where
(executor, nodes x tasks, GPUs, partition, time). `ep` is the expert-parallel size and `dp` the
expert-data-parallel degree: the world size is `ep * dp == nodes * tasks_per_node` (EP groups are
contiguous rank blocks, so EP4 x 2 over two nodes of 4 keeps each EP group on one node). `dp > 1`
needs `fsdp` (FSDP2 shards the dense parameters over the world, the experts over dp; the
trainer's `--ep N --fsdp`). The defaults (dp 1, no FSDP) are the trainer's EP = world layout.

A spec holds the job's `TrainConfig`, built at construction by the trainer's own parser
(`workbench.train.args`) from the spec's fields and, for the workbench trainer, `trainer_args`:
a run the trainer would refuse (an unknown flag, `--batch abc`, an unknown preset, an export the
recipe cannot write) fails here, not minutes later in the job. The job's argv is written from
that config by `workbench.train.args.trainer_argv`, next to the parser, so the two cannot drift.
Both modules are torch-free: `import workbench.launch` and building a spec load no torch.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from workbench.recipe import RecipeError, parse_qat_recipe
from workbench.source import SourceError, resolve
from workbench.train.args import TrainArgsError, config_from_args
from workbench.train.args import trainer_argv as _trainer_argv
from workbench.train.config import ACT_CKPT_MODES, EXPORTS, WANDB_MODES, TrainConfig

EXECUTORS = ("local", "slurm")
DEFAULT_TARGET = "workbench.train.cli:main"
DEFAULT_STOP_HOOK = "workbench.train.loop:request_stop"
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME = re.compile(r"^[A-Za-z0-9_.+\-]+$")
# TrainConfig.out of the config a spec holds: the run folder is known only at submit (default
# folders carry the submission time); train_config and trainer_argv put the real one in.
_RUN_FOLDER = "<run folder>"
# Both maps end up in the generated sbatch script (`export KEY=...`, `#SBATCH --key=value`): keys
# must be plain names, and no value may start a new script line.
_KEY_RULES = {"env": re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$"),
              "sbatch": re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")}


class LaunchSpecError(ValueError):
    """A launch spec that cannot describe a valid job."""


_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.+\-]")


def _source(value: object, what: str, *, hub: bool = True) -> str:
    """A data/model source for the job's command line: `hf:NAME...` as given (the trainer parses
    it), else a local path made absolute, which must exist now (a typo fails here, not in the
    job). The job runs elsewhere but sees the same shared file system."""
    if not isinstance(value, (str, Path)) or not str(value):
        raise LaunchSpecError(f"LaunchSpec: {what} must be a path or 'hf:NAME', got {value!r}")
    text = str(value)
    if hub and text.startswith("hf:"):
        return text
    if any(c in text for c in "\n\r\0"):
        raise LaunchSpecError(f"LaunchSpec: {what} must be one line, got {text!r}")
    path = Path(text).expanduser().resolve()
    if not path.exists():
        raise LaunchSpecError(f"LaunchSpec: {what} {text!r} does not exist")
    return str(path)


def _model_source(value: object, what: str) -> str:
    """init / tokenizer for the job's command line: a hub id resolved now and pinned to its
    commit (every rank and restart of the job reads the same one; offline, it must be in the
    Hugging Face cache), a URL as given, else a local path as `_source` takes it."""
    if isinstance(value, str) and value and not os.path.lexists(value):
        try:
            src = resolve(value, need="tokenizer" if what == "tokenizer" else "checkpoint")
        except SourceError as e:
            raise LaunchSpecError(f"LaunchSpec: {what}: {e}") from None
        if src.kind == "hub":
            return f"{src.repo_id}@{src.revision}"
        if src.kind == "url":
            return value
    return _source(value, what, hub=False)


def _frozen_str_map(value: Mapping[str, object] | None, what: str) -> Mapping[str, str]:
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        raise LaunchSpecError(f"{what} must be a mapping of str to str, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise LaunchSpecError(f"{what}: keys must be non-empty strings, got {k!r}")
        rule = _KEY_RULES.get(what)
        if rule is not None and not rule.match(k):
            raise LaunchSpecError(f"{what}: key {k!r} is not a valid name "
                                  f"(must match {rule.pattern})")
        if "\n" in str(v) or "\r" in str(v) or "\0" in str(v):
            raise LaunchSpecError(f"{what}[{k!r}]: value must be one line, got {str(v)!r}")
        out[k] = str(v)
    return MappingProxyType(out)


@dataclass(frozen=True)
class LaunchSpec:
    """One trainer run to launch through submitit.

    `tasks_per_node` is derived from `ep // nodes` when not given. `profile` is the codec profile
    of the recipe's weight format (trainer flag `--profile`). `sbatch` holds extra
    sbatch flags (e.g. `{"qos": "high"}`), `env` extra environment variables for the job,
    `pythonpath` folders prepended to the job's PYTHONPATH. `target` is the `module:function`
    called in every rank with the trainer argv (the workbench trainer by default); `stop_hook` is
    the `module:function` the job's preemption signal handler calls. The job gets USR2
    `signal_delay_s` before `time_min` runs out, time to finish a step and save a checkpoint (Slurm
    may send it up to a minute earlier); it then requeues, at most `max_requeues` times.
    `deterministic` passes `--deterministic` to the trainer and puts the cuBLAS workspace setting
    in every rank's environment (docs/determinism.md). `dp` and `fsdp`: the layout, world =
    ep x dp (`--ep ep --fsdp` for the trainer when `fsdp`; docs/fsdp.md).

    A real checkpoint (docs/real-checkpoint.md): `preset=None` with `init=CKPT` builds the model
    from `CKPT/config.json` and tokenizes with the checkpoint's tokenizer (`tokenizer` overrides
    it); `data` and `val_data` (sequences of sources) are the trainer's `--data`/`--val-data`
    (files or folders, made absolute here and checked to exist, or `hf:NAME[:CONFIG][:SPLIT]`);
    `distill` adds the frozen `init` model as teacher.

    `train_config` is the job's `TrainConfig`, parsed at construction by the trainer's parser
    from the spec's fields plus `trainer_args` (last flag wins, as in the job); a target other
    than the workbench trainer gets its `trainer_args` as given, unread here.
    """

    preset: str | None = "tiny"
    recipe: str = "bf16"
    steps: int = 20
    ep: int = 1
    nodes: int = 1
    tasks_per_node: int | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    partition: str | None = None
    time_min: int = 60
    sbatch: Mapping[str, str] = field(default_factory=dict)
    folder: str | Path | None = None
    executor: str = "local"
    seed: int = 0
    profile: str | None = None
    wandb: str = "offline"
    run_group: str | None = None
    init: str | None = None
    export: str | None = None
    ckpt_every: int | None = None
    trainer_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()
    target: str = DEFAULT_TARGET
    stop_hook: str = DEFAULT_STOP_HOOK
    max_requeues: int = 3
    signal_delay_s: int = 90
    deterministic: bool = True
    activation_checkpointing: str = "off"
    dp: int = 1  # expert-data-parallel degree: world = ep x dp (dp > 1 needs fsdp)
    fsdp: bool = False  # the trainer's --fsdp
    gpu_mem_gib: float = 141.0  # per GPU, for the memory check (H200: 141)
    skip_memory_check: bool = False
    data: tuple[str, ...] = ()
    val_data: tuple[str, ...] = ()
    tokenizer: str | None = None
    distill: bool = False
    # Derived in __post_init__; not a constructor argument, not compared, not in to_json.
    _train_config: TrainConfig = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise LaunchSpecError(f"LaunchSpec: {msg}")

        for name in ("steps", "ep", "dp", "nodes", "cpus_per_task", "time_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{name} must be a positive int, got {v!r}")
        for name in ("gpus_per_node", "seed", "max_requeues"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(f"{name} must be a non-negative int, got {v!r}")
        delay = self.signal_delay_s
        if not isinstance(delay, int) or not 0 < delay < self.time_min * 60:
            bad(f"signal_delay_s (the time-limit warning, {delay!r} s before the end) "
                f"must be positive and shorter than time_min ({self.time_min} min)")
        if self.executor not in EXECUTORS:
            bad(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        if self.wandb not in WANDB_MODES:
            bad(f"wandb must be one of {WANDB_MODES}, got {self.wandb!r}")
        if self.preset is None:
            if not self.init:
                bad("preset=None builds the model from a checkpoint's config.json: give init=CKPT")
        elif not isinstance(self.preset, str) or not _NAME.match(self.preset):
            bad(f"preset must be a non-empty name like 'tiny' (or None with init), "
                f"got {self.preset!r}")
        if not isinstance(self.distill, bool):
            bad(f"distill must be a bool, got {self.distill!r}")
        if self.distill and not self.init:
            bad("distill=True distils from the frozen init model: give init=CKPT")
        for name in ("data", "val_data"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes, Path)):
                bad(f"{name} must be a sequence of sources (files, folders or hf:NAME), "
                    "not one string")
            object.__setattr__(self, name, tuple(_source(d, name) for d in v))
        if self.val_data and not self.data:
            bad("val_data needs data (the byte corpus has its own validation split)")
        for name in ("tokenizer", "init"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _model_source(getattr(self, name), name))
        if self.profile is not None and (not isinstance(self.profile, str)
                                         or not _NAME.match(self.profile)):
            bad(f"profile must be a name like 'floor', got {self.profile!r}")
        try:  # the trainer's own parser: a typo fails here, not minutes later in the job
            parse_qat_recipe(self.recipe, self.profile)
        except RecipeError as e:
            bad(f"recipe {self.recipe!r}: {e}")
        if self.export is not None and self.export not in EXPORTS:
            bad(f"export must be one of {EXPORTS} or None, got {self.export!r}")
        if not isinstance(self.deterministic, bool):
            bad(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.activation_checkpointing not in ACT_CKPT_MODES:
            bad(f"activation_checkpointing must be one of {ACT_CKPT_MODES}, got "
                f"{self.activation_checkpointing!r}")
        if not isinstance(self.fsdp, bool):
            bad(f"fsdp must be a bool, got {self.fsdp!r}")
        if self.dp > 1 and not self.fsdp:
            bad(f"dp={self.dp} > 1 (ep {self.ep} < world {self.ep * self.dp}) needs fsdp=True: "
                "experts replicated over data-parallel ranks run only under FSDP2")
        if not isinstance(self.gpu_mem_gib, (int, float)) or not self.gpu_mem_gib > 0:
            bad(f"gpu_mem_gib must be a positive number, got {self.gpu_mem_gib!r}")
        if self.ckpt_every is not None and (not isinstance(self.ckpt_every, int)
                                            or self.ckpt_every < 1):
            bad(f"ckpt_every must be a positive int or None, got {self.ckpt_every!r}")

        world = self.ep * self.dp
        what = f"ep={self.ep}" if self.dp == 1 else f"ep x dp = {self.ep} x {self.dp} = {world}"
        tpn = self.tasks_per_node
        if tpn is None:
            if world % self.nodes:
                bad(f"{what} ranks cannot be split evenly over nodes={self.nodes}; "
                    "pass tasks_per_node or change ep/dp/nodes")
            tpn = world // self.nodes
            object.__setattr__(self, "tasks_per_node", tpn)
        if not isinstance(tpn, int) or isinstance(tpn, bool) or tpn < 1:
            bad(f"tasks_per_node must be a positive int, got {tpn!r}")
        if self.nodes * tpn != world:
            bad(f"{what} is the world size and must equal nodes x tasks_per_node "
                f"({self.nodes} x {tpn} = {self.nodes * tpn})")
        if self.gpus_per_node and tpn > self.gpus_per_node:
            bad(f"with GPUs every rank needs its own GPU: tasks_per_node ({tpn}) > "
                f"gpus_per_node ({self.gpus_per_node})")
        if self.executor == "local" and self.nodes != 1:
            bad(f"executor='local' runs on this one machine, so nodes must be 1 "
                f"(got {self.nodes}); "
                "use executor='slurm' for several nodes")

        for name in ("target", "stop_hook"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _DOTTED.match(v):
                bad(f"{name} must be 'package.module:function', got {v!r}")
        if isinstance(self.trainer_args, (str, bytes)):
            bad("trainer_args must be a sequence of strings, not one string")
        object.__setattr__(self, "trainer_args", tuple(str(a) for a in self.trainer_args))
        if isinstance(self.pythonpath, (str, bytes)):
            bad("pythonpath must be a sequence of folders, not one string")
        object.__setattr__(self, "pythonpath",
                           tuple(str(Path(p).resolve()) for p in self.pythonpath))
        object.__setattr__(self, "sbatch", _frozen_str_map(self.sbatch, "sbatch"))
        object.__setattr__(self, "env", _frozen_str_map(self.env, "env"))
        if self.folder is not None:
            object.__setattr__(self, "folder", Path(self.folder))
        object.__setattr__(self, "_train_config", self._build_train_config())

    def _build_train_config(self) -> TrainConfig:
        """The job's TrainConfig (out: a placeholder), or LaunchSpecError with the trainer's reason
        on one line."""
        extra = list(self.trainer_args) if self.target == DEFAULT_TARGET else []
        try:
            cfg = config_from_args(self._spec_argv(_RUN_FOLDER) + extra, raising=True)
        except (TrainArgsError, ValueError) as e:
            msg = " ".join(str(e).split())
            raise LaunchSpecError(f"LaunchSpec: the trainer refuses this run: {msg}") from None
        if cfg.out != _RUN_FOLDER:
            raise LaunchSpecError(f"LaunchSpec: trainer_args may not set --out ({cfg.out!r}): the "
                                  "run folder is LaunchSpec.folder (or the one submit picks)")
        return cfg

    @property
    def train_config(self) -> TrainConfig:
        """The TrainConfig the job's trainer runs (`out`: the run folder when `folder` is set,
        else a placeholder until submit picks one). For a non-default `target` it leaves out
        `trainer_args`, which only that target reads."""
        if self.folder is None:
            return self._train_config
        return self._train_config.replace(out=str(Path(self.folder).resolve()))

    @property
    def world_size(self) -> int:
        return self.ep * self.dp

    @property
    def name(self) -> str:
        """A short, filesystem-safe run name used for default folders and Slurm job names."""
        recipe = self.recipe if self.profile is None else f"{self.recipe}-{self.profile}"
        recipe = recipe.replace(":", "-")  # "mxfp4:floor": no ':' in folder or job names
        model = self.preset if self.preset is not None else _NAME_SAFE.sub("_", Path(self.init).name)
        layout = f"ep{self.ep}" + (f"x{self.dp}" if self.dp > 1 else "") + \
            ("-fsdp" if self.fsdp else "")
        parts = [model, recipe, layout, f"s{self.seed}"]
        return "-".join(parts)

    def trainer_argv(self, out_dir: str | Path) -> list[str]:
        """The job's argv: every field of the spec's TrainConfig as the trainer's flags
        (`workbench.train.args.trainer_argv`, with `--out out_dir`), plus `trainer_args` as given
        for a target other than the workbench trainer."""
        argv = _trainer_argv(self._train_config.replace(out=str(out_dir)))
        return argv if self.target == DEFAULT_TARGET else argv + list(self.trainer_args)

    def _spec_argv(self, out_dir: str | Path) -> list[str]:
        """The spec's own fields as trainer flags (without trainer_args): what the TrainConfig
        is parsed from."""
        argv = (["--preset", self.preset] if self.preset is not None else []) + [
            "--recipe", self.recipe, "--steps", str(self.steps),
            "--out", str(out_dir), "--seed", str(self.seed), "--wandb", self.wandb]
        if self.run_group:
            argv += ["--run-group", self.run_group]
        if self.init:
            argv += ["--init", str(self.init)]
        if self.tokenizer:
            argv += ["--tokenizer", self.tokenizer]
        for source in self.data:
            argv += ["--data", source]
        for source in self.val_data:
            argv += ["--val-data", source]
        if self.distill:
            argv += ["--distill"]
        if self.ckpt_every:
            argv += ["--ckpt-every", str(self.ckpt_every)]
        if self.profile:
            argv += ["--profile", self.profile]
        if self.export:
            argv += ["--export", self.export]
        argv += ["--deterministic" if self.deterministic else "--no-deterministic"]
        if self.activation_checkpointing != "off":
            argv += ["--activation-checkpointing", self.activation_checkpointing]
        if self.fsdp:  # without FSDP the trainer's default (EP = world) is this spec's layout
            argv += ["--ep", str(self.ep), "--fsdp"]
        return argv

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        d["folder"] = None if self.folder is None else str(self.folder)
        d["sbatch"] = dict(self.sbatch)
        d["env"] = dict(self.env)
        d["trainer_args"] = list(self.trainer_args)
        d["data"], d["val_data"] = list(self.data), list(self.val_data)
        d["pythonpath"] = list(self.pythonpath)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> LaunchSpec:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LaunchSpecError(f"LaunchSpec.from_json: unknown fields {unknown}")
        d = dict(d)
        for k in ("trainer_args", "pythonpath", "data", "val_data"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)


def local(**overrides) -> LaunchSpec:
    """Local executor (this machine, no Slurm), one rank: the embedded default."""
    return LaunchSpec(**{"executor": "local", "ep": 1, "nodes": 1, **overrides})


def ep4(**overrides) -> LaunchSpec:
    """EP4: one node x 4 ranks (Slurm by default)."""
    return LaunchSpec(**{"executor": "slurm", "ep": 4, "nodes": 1, **overrides})


def ep8(**overrides) -> LaunchSpec:
    """EP8: two nodes x 4 ranks on Slurm."""
    return LaunchSpec(**{"executor": "slurm", "ep": 8, "nodes": 2, **overrides})


def ep4x2_fsdp(**overrides) -> LaunchSpec:
    """EP4 x FSDP2: two nodes x 4 ranks on Slurm, one EP group per node, experts FSDP-sharded
    over the two nodes, dense parameters over all 8 ranks."""
    return LaunchSpec(**{"executor": "slurm", "ep": 4, "dp": 2, "fsdp": True, "nodes": 2,
                         **overrides})
