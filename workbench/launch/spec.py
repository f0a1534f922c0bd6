"""What to launch: the job's `TrainConfig` and the resources it runs on.

A `LaunchSpec` is `train` (the trainer's `TrainConfig`: the run, its folder `train.out`, its layout
`train.ep` / `train.fsdp`) plus `resources` (`Resources`: executor, nodes x tasks, GPUs, time,
partition, sbatch extras, environment). It holds no copy of a trainer field: the job's argv is
`workbench.train.args.trainer_argv(spec.train)`, which the trainer parses back to the same config,
so a field added to TrainConfig reaches the job with no edit here. Validation happens once:
TrainConfig checks its fields when it is built, `Resources` its own, and the spec only what joins
them (the layout at the spec's world size, `TrainConfig.check_world`, the same check the trainer
makes at start-up).

    LaunchSpec.build(preset="tiny", recipe="mxfp4", steps=20, ep=4, executor="slurm",
                     folder="runs/ep4")                         # the common case, in one call
    LaunchSpec(train=run_config("runs/x", recipe="mxfp4", ep=4),
               resources=Resources(executor="slurm", nodes=1, tasks_per_node=4))

`ep` is the expert-parallel size and dp the expert-data-parallel degree: the world size is
`ep * dp == nodes * tasks_per_node` (EP groups are contiguous rank blocks, so EP4 x 2 over two
nodes of 4 keeps each EP group on one node); dp > 1 needs `fsdp` (docs/fsdp.md).

Torch-free: `import workbench.launch` and building a spec load no torch.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from workbench.source import COMMIT, URL_SCHEMES, SourceError, parse_hub_id, resolve
from workbench.train.args import trainer_argv
from workbench.train.config import TrainConfig, declared, run_config

EXECUTORS = ("local", "slurm")
DEFAULT_TARGET = "workbench.train.cli:main"
DEFAULT_STOP_HOOK = "workbench.train.loop:request_stop"
_DOTTED = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_NAME = re.compile(r"^[A-Za-z0-9_.+\-]+$")
_NAME_SAFE = re.compile(r"[^A-Za-z0-9_.+\-]")
_MEM = re.compile(r"^[0-9]+[KMGT]?$")
# Both maps end up in the generated sbatch script (`export KEY=...`, `#SBATCH --key=value`): keys
# must be plain names, and no value may start a new script line.
_KEY_RULES = {"env": re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$"),
              "sbatch": re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")}
_HUB = "hf:"  # a `source` path may name a Hugging Face dataset instead of a local file


class LaunchSpecError(ValueError):
    """A launch spec that cannot describe a valid job; the message is one line."""


def _frozen_str_map(value: Mapping[str, object] | None, what: str) -> Mapping[str, str]:
    value = {} if value is None else value
    if not isinstance(value, Mapping):
        raise LaunchSpecError(f"{what} must be a mapping of str to str, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise LaunchSpecError(f"{what}: keys must be non-empty strings, got {k!r}")
        rule = _KEY_RULES[what]
        if not rule.match(k):
            raise LaunchSpecError(f"{what}: key {k!r} is not a valid name "
                                  f"(must match {rule.pattern})")
        if "\n" in str(v) or "\r" in str(v) or "\0" in str(v):
            raise LaunchSpecError(f"{what}[{k!r}]: value must be one line, got {str(v)!r}")
        out[k] = str(v)
    return MappingProxyType(out)


def _int(v: object, name: str, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        kind = "a positive int" if low == 1 else f"an int >= {low}"
        raise LaunchSpecError(f"{name} must be {kind}, got {v!r}")


@dataclass(frozen=True)
class Resources:
    """Where and how a job runs; nothing here changes what it trains.

    `nodes x tasks_per_node` is the world size (one rank per task, one GPU each when
    `gpus_per_node`). `mem`: Slurm's --mem per node (e.g. "64G"; None: the partition's default).
    `sbatch`: extra sbatch flags (`{"qos": "high"}`); `env`: extra environment variables of the
    job; `pythonpath`: folders prepended to the job's PYTHONPATH. The job gets USR2
    `signal_delay_s` before `time_min` runs out, time to finish a step and save a checkpoint
    (Slurm may send it up to a minute earlier); it then requeues, at most `max_requeues` times.
    `job_name`: the Slurm job name (default `wb-<run name>`). `gpu_mem_gib`: memory per GPU for
    the fit check at submit (H200: 141), `skip_memory_check` turns that check off."""

    executor: str = "local"
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem: str | None = None
    partition: str | None = None
    time_min: int = 60
    signal_delay_s: int = 90
    max_requeues: int = 3
    sbatch: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()
    job_name: str | None = None
    gpu_mem_gib: float = 141.0
    skip_memory_check: bool = False

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise LaunchSpecError(f"Resources.executor must be one of {EXECUTORS}, "
                                  f"got {self.executor!r}")
        for name in ("nodes", "tasks_per_node", "cpus_per_task", "time_min"):
            _int(getattr(self, name), f"Resources.{name}", 1)
        for name in ("gpus_per_node", "max_requeues"):
            _int(getattr(self, name), f"Resources.{name}", 0)
        delay = self.signal_delay_s
        if not isinstance(delay, int) or isinstance(delay, bool) or not \
                0 < delay < self.time_min * 60:
            raise LaunchSpecError(f"Resources.signal_delay_s (the time-limit warning, {delay!r} s "
                                  f"before the end) must be positive and shorter than time_min "
                                  f"({self.time_min} min)")
        if self.gpus_per_node and self.tasks_per_node > self.gpus_per_node:
            raise LaunchSpecError(f"with GPUs every rank needs its own GPU: tasks_per_node "
                                  f"({self.tasks_per_node}) > gpus_per_node "
                                  f"({self.gpus_per_node})")
        if self.executor == "local" and self.nodes != 1:
            raise LaunchSpecError(f"executor='local' runs on this one machine, so nodes must be 1 "
                                  f"(got {self.nodes}); use executor='slurm' for several nodes")
        for name, rule in (("mem", _MEM), ("partition", _NAME), ("job_name", _NAME)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not rule.match(v)):
                raise LaunchSpecError(f"Resources.{name} must match {rule.pattern} or be None, "
                                      f"got {v!r}")
        if not isinstance(self.gpu_mem_gib, (int, float)) or not self.gpu_mem_gib > 0:
            raise LaunchSpecError(f"Resources.gpu_mem_gib must be a positive number, "
                                  f"got {self.gpu_mem_gib!r}")
        if not isinstance(self.skip_memory_check, bool):
            raise LaunchSpecError(f"Resources.skip_memory_check must be a bool, "
                                  f"got {self.skip_memory_check!r}")
        if isinstance(self.pythonpath, (str, bytes)):
            raise LaunchSpecError("Resources.pythonpath must be a sequence of folders, "
                                  "not one string")
        object.__setattr__(self, "pythonpath",
                           tuple(str(Path(p).resolve()) for p in self.pythonpath))
        object.__setattr__(self, "sbatch", _frozen_str_map(self.sbatch, "sbatch"))
        object.__setattr__(self, "env", _frozen_str_map(self.env, "env"))

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**d, "sbatch": dict(self.sbatch), "env": dict(self.env),
                "pythonpath": list(self.pythonpath)}

    @classmethod
    def from_json(cls, d: Mapping) -> Resources:
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise LaunchSpecError(f"Resources: unknown fields {unknown}")
        d = dict(d)
        if isinstance(d.get("pythonpath"), list):
            d["pythonpath"] = tuple(d["pythonpath"])
        return cls(**d)


def _remote(x: str, kind: str) -> bool:
    """`x` names no local path: an `hf:` dataset (`source`), or a hub id or URL where a
    checkpoint or tokenizer may be one."""
    if kind == "source":
        return x.startswith(_HUB)
    return kind in ("checkpoint", "tokenizer") and not os.path.lexists(x) and (
        URL_SCHEMES.match(x) is not None or parse_hub_id(x) is not None)


def _place(x: str, kind: str) -> str:
    """One path value of the job's TrainConfig as every rank must see it: a local path made
    absolute (the job runs in another folder, on nodes that share the file system); a hub id
    pinned to the commit it resolves to now (every rank and restart reads the same one; offline
    it must be in the Hugging Face cache); a URL or an `hf:` dataset as given."""
    if not _remote(x, kind):
        return str(Path(x).expanduser().resolve())
    if kind == "source":
        return x
    hub = parse_hub_id(x)
    if hub is not None and hub[1] is not None and COMMIT.match(hub[1]):
        return x  # pinned already (a spec read back from launch.json)
    src = resolve(x, need=kind)
    return f"{src.repo_id}@{src.revision}" if src.kind == "hub" else x


def _placed(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every path field (declared `path=...`) placed by `_place`."""
    changes = {}
    for d in declared(TrainConfig):
        v = getattr(cfg, d.name)
        if d.option.path is None or v is None:
            continue
        try:
            fixed = tuple(_place(x, d.option.path) for x in (v if d.kind is tuple else (v,)))
        except SourceError as e:
            raise LaunchSpecError(f"LaunchSpec: {d.name}: {e}") from None
        changes[d.name] = fixed if d.kind is tuple else fixed[0]
    return cfg.replace(**changes)


def missing_inputs(cfg: TrainConfig) -> list[str]:
    """`field 'path'` for each local path the job would read that does not exist now."""
    out = []
    for d in declared(TrainConfig):
        v = getattr(cfg, d.name)
        if d.option.path in (None, "write") or v is None:
            continue
        for x in v if d.kind is tuple else (v,):
            if not _remote(x, d.option.path) and not Path(x).exists():
                out.append(f"{d.name} {x!r}")
    return out


def safe_name(text: str) -> str:
    """`text` with every character a folder or Slurm job name should not hold replaced by '_'."""
    return _NAME_SAFE.sub("_", text)


def run_name(train: TrainConfig, resources: Resources) -> str:
    """A short, filesystem-safe run name for default folders and Slurm job names."""
    recipe = train.recipe if train.profile is None else f"{train.recipe}-{train.profile}"
    recipe = recipe.replace(":", "-")  # "mxfp4:floor": no ':' in folder or job names
    model = train.preset if train.preset is not None else safe_name(Path(train.init).name)
    world = resources.world_size
    ep = train.ep_size(world)
    layout = f"ep{ep}" + (f"x{world // ep}" if ep < world else "") + \
        ("-fsdp" if train.fsdp else "")
    return "-".join([model, recipe, layout, f"s{train.seed}"])


@dataclass(frozen=True)
class LaunchSpec:
    """One trainer run to launch through submitit: `train` on `resources`.

    `target` is the `module:function` called in every rank with the job's argv (the workbench
    trainer by default); `stop_hook` the `module:function` the job's preemption signal handler
    calls. `target_args` are extra flags for a target other than the workbench trainer (which
    takes every setting from `train`). Local paths in `train` (its `out`, `init`, `data`, ...)
    are made absolute when the spec is built; `submit` checks that the inputs exist."""

    train: TrainConfig
    resources: Resources = field(default_factory=Resources)
    target: str = DEFAULT_TARGET
    stop_hook: str = DEFAULT_STOP_HOOK
    target_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.train, TrainConfig):
            raise LaunchSpecError(f"LaunchSpec.train must be a TrainConfig, "
                                  f"got {type(self.train).__name__}")
        if not isinstance(self.resources, Resources):
            raise LaunchSpecError(f"LaunchSpec.resources must be a Resources, "
                                  f"got {type(self.resources).__name__}")
        for name in ("target", "stop_hook"):
            v = getattr(self, name)
            if not isinstance(v, str) or not _DOTTED.match(v):
                raise LaunchSpecError(f"LaunchSpec.{name} must be 'package.module:function', "
                                      f"got {v!r}")
        if isinstance(self.target_args, (str, bytes)):
            raise LaunchSpecError("LaunchSpec.target_args must be a sequence of strings, "
                                  "not one string")
        object.__setattr__(self, "target_args", tuple(str(a) for a in self.target_args))
        if self.target_args and self.target == DEFAULT_TARGET:
            raise LaunchSpecError(f"LaunchSpec.target_args {list(self.target_args)} are for a "
                                  "target of your own; the workbench trainer takes every setting "
                                  "from LaunchSpec.train (any TrainConfig field)")
        try:  # the trainer's own layout rules, at this spec's world size
            self.train.check_world(self.resources.world_size)
        except ValueError as e:
            raise LaunchSpecError(f"LaunchSpec: {e} (resources: {self.resources.nodes} node(s) x "
                                  f"{self.resources.tasks_per_node} task(s))") from None
        object.__setattr__(self, "train", _placed(self.train))

    @classmethod
    def build(cls, *, folder: str | Path | None = None, ep: int = 1, dp: int = 1,
              nodes: int = 1, tasks_per_node: int | None = None, target: str = DEFAULT_TARGET,
              stop_hook: str = DEFAULT_STOP_HOOK, target_args: tuple[str, ...] = (),
              **settings: Any) -> LaunchSpec:
        """The common case in one call. Each keyword in `settings` goes to the dataclass that
        declares it: a `Resources` field (executor, gpus_per_node, time_min, sbatch, env, ...)
        there, anything else to the job's TrainConfig (`run_config`: the preset's values, then
        these; `preset` left out: init's own model with `init`, else tiny). So every TrainConfig
        field, present or future, is a keyword here. `ep x dp` ranks over `nodes` nodes
        (tasks_per_node derived when left out); `folder` is the run folder (`train.out`; default
        `runs/<run name>-<time>`)."""
        if "out" in settings:  # TrainConfig's name for the run folder
            if folder is not None:
                raise LaunchSpecError("LaunchSpec.build: give the run folder once (folder= or "
                                      "out=)")
            folder = settings.pop("out")
        res_names = {f.name for f in dataclasses.fields(Resources)}
        unknown = sorted(set(settings) - res_names - {d.name for d in declared(TrainConfig)})
        if unknown:
            raise LaunchSpecError(
                f"LaunchSpec.build: {unknown} is neither a TrainConfig nor a Resources field "
                "(trainer settings are TrainConfig fields, e.g. batch=8; flags for a target of "
                "your own go in target_args)")
        resources = {k: settings.pop(k) for k in list(settings) if k in res_names}
        for name, v in (("ep", ep), ("dp", dp), ("nodes", nodes)):
            _int(v, f"LaunchSpec.build: {name}", 1)
        world = ep * dp
        what = f"ep={ep}" if dp == 1 else f"ep x dp = {ep} x {dp} = {world}"
        if tasks_per_node is None:
            if world % nodes:
                raise LaunchSpecError(f"LaunchSpec.build: {what} ranks cannot be split evenly "
                                      f"over nodes={nodes}; pass tasks_per_node or change "
                                      "ep/dp/nodes")
            tasks_per_node = world // nodes
        elif nodes * tasks_per_node != world:
            raise LaunchSpecError(f"LaunchSpec.build: {what} is the world size and must equal "
                                  f"nodes x tasks_per_node ({nodes} x {tasks_per_node} = "
                                  f"{nodes * tasks_per_node})")
        try:
            res = Resources(nodes=nodes, tasks_per_node=tasks_per_node, **resources)
            train = run_config(str(folder) if folder is not None else "runs/pending", ep=ep,
                               **settings)
        except ValueError as e:
            msg = e if isinstance(e, LaunchSpecError) else f"LaunchSpec: {e}"
            raise LaunchSpecError(" ".join(str(msg).split())) from None
        if folder is None:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            train = train.replace(out=str(Path("runs") / f"{run_name(train, res)}-{stamp}"))
        return cls(train, res, target, stop_hook, tuple(target_args))

    @property
    def folder(self) -> Path:
        """The run folder: `train.out` (absolute)."""
        return Path(self.train.out)

    @property
    def world_size(self) -> int:
        return self.resources.world_size

    @property
    def ep(self) -> int:
        return self.train.ep_size(self.world_size)

    @property
    def dp(self) -> int:
        return self.world_size // self.ep

    @property
    def name(self) -> str:
        return run_name(self.train, self.resources)

    def job_argv(self) -> list[str]:
        """The argv every rank's `target` gets: the trainer's flags for `train`
        (`workbench.train.args.trainer_argv`), then `target_args`."""
        return trainer_argv(self.train) + list(self.target_args)

    def replace(self, **changes: Any) -> LaunchSpec:
        """A copy with spec fields (`train=`, `resources=`, ...) changed, checked again."""
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        train = {k: list(v) if isinstance(v, tuple) else v for k, v in self.train.to_dict().items()}
        return {"train": train, "resources": self.resources.to_json(), "target": self.target,
                "stop_hook": self.stop_hook, "target_args": list(self.target_args)}

    @classmethod
    def from_json(cls, d: Mapping) -> LaunchSpec:
        if not isinstance(d, Mapping):
            raise LaunchSpecError(f"LaunchSpec.from_json needs a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise LaunchSpecError(f"LaunchSpec.from_json: unknown fields {unknown}")
        if "train" not in d:
            raise LaunchSpecError("LaunchSpec.from_json: missing 'train'")
        try:
            train = TrainConfig.from_dict(d["train"])
        except (ValueError, TypeError) as e:
            raise LaunchSpecError(f"LaunchSpec.from_json: train: {e}") from None
        res = d.get("resources", {})
        if not isinstance(res, Mapping):
            raise LaunchSpecError("LaunchSpec.from_json: resources must be a mapping")
        rest = {k: d[k] for k in ("target", "stop_hook") if k in d}
        return cls(train, Resources.from_json(res), target_args=tuple(d.get("target_args", ())),
                   **rest)


def local(**settings: Any) -> LaunchSpec:
    """Local executor (this machine, no Slurm), one rank: the embedded default."""
    return LaunchSpec.build(**{"executor": "local", "ep": 1, "nodes": 1, **settings})


def ep4(**settings: Any) -> LaunchSpec:
    """EP4: one node x 4 ranks (Slurm by default)."""
    return LaunchSpec.build(**{"executor": "slurm", "ep": 4, "nodes": 1, **settings})


def ep8(**settings: Any) -> LaunchSpec:
    """EP8: two nodes x 4 ranks on Slurm."""
    return LaunchSpec.build(**{"executor": "slurm", "ep": 8, "nodes": 2, **settings})


def ep4x2_fsdp(**settings: Any) -> LaunchSpec:
    """EP4 x FSDP2: two nodes x 4 ranks on Slurm, one EP group per node, experts FSDP-sharded
    over the two nodes, dense parameters over all 8 ranks."""
    return LaunchSpec.build(**{"executor": "slurm", "ep": 4, "dp": 2, "fsdp": True, "nodes": 2,
                               **settings})
