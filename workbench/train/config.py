"""The trainer's typed configuration: one frozen dataclass that declares every option once.

Each `TrainConfig` field is declared with `option(default, help, ...)` (`workbench.train.options`):
its type annotation, its default, its help text, its bounds or choices, how a `--resume` treats
it, and (for paths) what the launcher does with it. Everything else is derived from that one
declaration: the command line
(`workbench.train.args`: the parser, argv -> TrainConfig and back), the launcher's job argv
(`workbench.launch`), the field checks in `__post_init__`, and `FREE` / `CHANGEABLE` (what
`--resume` may change). Adding a trainer option is adding one field here (docs/contributing.md).

`batch` is the GLOBAL batch in sequences: every EP size trains on the same global batch and rank r
takes rows [r*batch/W, (r+1)*batch/W) (see `workbench.train.data`), so `batch` must be a multiple
of the world size.

Layout (`ep`, `fsdp`; `workbench.train.distributed.Layout`): world = ep x dp. `ep=None` is EP size =
world size (every rank holds a replica of the dense parameters, no FSDP). With `fsdp`, FSDP2 shards
the dense parameters over all ranks and the experts over the dp ranks that hold the same experts.
EP < world needs `fsdp`: replicated experts without FSDP are not supported (one way to run them).
The layout is not training semantics: a `--resume` may change it (the checkpoint reshards).
`check_world` is the one place these rules are checked, by the trainer and by the launcher.

Torch-free: the launcher builds and checks a job's configuration without loading torch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workbench.arch import PRESETS
from workbench.recipe import QATRecipe, RecipeError, parse_qat_recipe
from workbench.train.options import Declared, Option, TrainConfigError, declared, option

# What a field's declaration is made of lives in workbench.train.options; here for callers of
# TrainConfig, which use them together.
__all__ = ["ACT_CKPT_MODES", "CHANGEABLE", "EXPORTS", "FREE", "WANDB_MODES", "Declared", "Option",
           "TrainConfig", "TrainConfigError", "check_allowed_changes", "declared",
           "from_checkpoint", "gpu", "option", "preset_config", "run_config", "small", "split_names",
           "tiny"]

ACT_CKPT_MODES = ("off", "full", "selective")
EXPORTS = ("compressed-tensors", "bf16", "gpt-oss")
WANDB_MODES = ("offline", "online", "disabled")

def _path_text(v: Any) -> Any:
    return os.fspath(v) if isinstance(v, os.PathLike) else v


def split_names(text: str) -> tuple[str, ...]:
    """`a,b, c` -> ("a", "b", "c"): the command line's `--allow-config-change` (checked by
    TrainConfig)."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


@dataclass(frozen=True)
class TrainConfig:
    out: str = option(dataclasses.MISSING, "run directory (metrics, checkpoints, export)",
                      path="write", resume="free")
    preset: str | None = option(
        "tiny", "model + training preset (tiny, small, ...); left out: the --init checkpoint's own "
        "model (its config.json; also: --preset checkpoint), or tiny without --init",
        none="checkpoint", metavar="NAME")
    # Kept as the text given so recorded run folders ("mxfp4") stay resumable; typed as
    # `qat_recipe`.
    recipe: str = option("bf16", "W[:PROFILE][+A[:PROFILE]], e.g. mxfp4, nvfp4:te, mxfp4+mxfp8, "
                         "nvfp4+mxfp8, mxfp8; bf16 / none: no quantization")
    profile: str | None = option(None, "deprecated: the weight format's codec profile; write it "
                                 "in the recipe instead (--recipe mxfp4:floor)")
    steps: int = option(20, "optimizer steps", ge=1, resume="changeable")
    batch: int = option(8, "GLOBAL batch in sequences (a multiple of the world size)", ge=1)
    seq: int = option(64, "predicted tokens per sequence (one more is read for the labels)", ge=1)
    lr: float = option(3e-3, "peak learning rate", gt=0, resume="changeable")
    min_lr_ratio: float = option(0.1, "the cosine schedule decays to lr x this at the last step",
                                 ge=0, le=1, resume="changeable")
    warmup: int = option(5, "linear warm-up steps", ge=0, resume="changeable")
    weight_decay: float = option(0.1, "AdamW weight decay", ge=0)
    beta1: float = option(0.9, "Adam beta1", ge=0, lt=1)
    beta2: float = option(0.95, "Adam beta2", ge=0, lt=1)
    adam_eps: float = option(1e-8, "Adam epsilon", gt=0)
    grad_clip: float = option(1.0, "clip the global gradient L2 norm to this; 0: no clipping (the "
                              "norm is still logged)", ge=0, resume="changeable")
    # What to do with a step whose loss or gradient is NaN/Inf; never a value of the steps that
    # train, so free on resume (a stopped run resumes with skipping allowed).
    skip_nonfinite_steps: int = option(
        0, "skip up to N steps whose loss or gradient is NaN/Inf (no update, counted as "
        "skipped_steps); default 0: stop at the first, exit 2", ge=0, metavar="N", resume="free")
    # DeepSeek-V3's auxiliary-loss-free balancing (workbench.train.router_bias); it changes the
    # routing the run trains with, so a resume keeps it.
    router_bias_update: float = option(
        0.0, "sigmoid routers (DeepSeek-V3, Kimi K2, GLM-4.5): after every step move each "
        "expert's e_score_correction_bias by RATE against its load (DeepSeek-V3 used 0.001); "
        "default 0: the bias stays as the checkpoint has it", ge=0, metavar="RATE")
    val_every: int = option(10, "steps between validations; 0: none", ge=0, resume="free")
    val_batches: int = option(2, "batches per validation", ge=1, resume="changeable")
    ckpt_every: int = option(10, "steps between checkpoints; 0: only the final and preemption "
                             "checkpoints", ge=0, resume="free")
    keep: int = option(2, "complete checkpoints to keep", ge=1, resume="free")
    seed: int = option(0, "seed of the initialisation and the data order", ge=0)
    resume: bool = option(False, "continue from the newest complete checkpoint in --out (no-op "
                          "if none)", resume="free")
    init: str | None = option(None, "BF16 or packed HF checkpoint to start from: a folder, a hub "
                              "id ORG/NAME[@REV] or a URL (docs/hub.md)", path="checkpoint",
                              metavar="CKPT", resume="free")
    export: str | None = option(None, "write an HF checkpoint to OUT/export", choices=EXPORTS,
                                resume="free")
    # Real data (workbench.train.datasets, docs/data.md); none: the shipped byte corpus.
    data: tuple[str, ...] = option(
        (), "training text (repeatable): .jsonl, .parquet, .txt or folder, datasets.save_to_disk "
        "folder, hf:NAME[:CONFIG][:SPLIT]; see docs/data.md", repeat=True, metavar="PATH",
        path="source")
    val_data: tuple[str, ...] = option(
        (), "validation text (repeatable); default: hold out the last train sequences",
        repeat=True, metavar="PATH", path="source")
    tokenizer: str | None = option(None, "tokenizer folder or hub id (default: --init's)",
                                   path="tokenizer")
    token_cache: str | None = option(None, "private token cache folder (default: "
                                     "OUT/../.token-cache-UID)", path="write")
    # Distillation from the frozen --init model (workbench.train.distill).
    distill: bool = option(False, "distil from the frozen --init model (KL to its logits)")
    kd_temperature: float = option(1.0, "distillation temperature T", gt=0)
    kd_weight: float = option(1.0, "weight of T^2 * KL", ge=0)
    ce_weight: float = option(0.0, "weight of the CE loss (with --distill; without it the loss "
                              "is CE)", ge=0)
    wandb: str = option("offline", "wandb mode", choices=WANDB_MODES, resume="free")
    run_group: str | None = option(None, "wandb group (baseline + QAT runs compared together)",
                                   resume="free")
    project: str = option("workbench", "wandb project", resume="free")
    run_name: str | None = option(None, "wandb run name (default: the --out folder's name)",
                                  resume="free")
    # Bitwise-reproducible GPU runs (workbench.train.determinism); on by default, its cost is in
    # docs/determinism.md.
    deterministic: bool = option(True, "bitwise-reproducible run: deterministic algorithms and "
                                 "cuBLAS workspace (docs/determinism.md)", resume="free")
    activation_checkpointing: str = option(
        "off", "recompute each decoder layer in backward: full, or selective (keep the "
        "matmul/attention outputs)", choices=ACT_CKPT_MODES, resume="free")
    compile: bool = option(False, "compile each decoder layer (regional torch.compile): on a GPU "
                           "the fused elementwise work makes the step about 0.7x the eager one; "
                           "its numbers differ from eager ones in rounding (docs/performance.md)",
                           resume="free")
    ep: int | None = option(None, "expert-parallel size (default: the world size); N < world "
                            "needs --fsdp", ge=1, metavar="N", resume="free")
    fsdp: bool = option(False, "FSDP2: shard dense parameters over all ranks, experts over the "
                        "ranks that hold the same experts (docs/fsdp.md)", resume="free")
    expert_stats_every: int | None = option(
        None, "steps between per-expert quantization records in OUT/expert_stats.parquet "
        "(default: at each validation; 0: off)", ge=0, resume="free")
    # How long a collective waits for the other ranks; torch's own default (30 min) leaves a run
    # with a frozen rank silent for half an hour. Longer phases of rank 0 alone (tokenizing the
    # data) wait on the process group's store instead, without this limit.
    dist_timeout: float = option(10.0, "minutes a rank waits for the others in one collective; "
                                 "past it the run stops, naming the rank that did not answer",
                                 gt=0, metavar="MIN", resume="free")
    allow_config_change: tuple[str, ...] = option(
        (), "fields --resume may change from the checkpoint's configuration (listed at the end "
        "of --help); others must match", parse=split_names, fmt=",".join, metavar="FIELD[,FIELD]",
        resume="free")

    def __post_init__(self) -> None:
        if isinstance(self.recipe, QATRecipe):
            object.__setattr__(self, "recipe", str(self.recipe))
        for d in declared(type(self)):
            v = getattr(self, d.name)
            # One spelling per value (JSON, equality, hashing): 1 -> 1.0, Path -> str, list -> tuple
            if d.kind is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            elif d.kind is tuple and isinstance(v, list):
                v = tuple(v)
            if d.option.path is not None:
                v = tuple(_path_text(x) for x in v) if isinstance(v, tuple) else _path_text(v)
            object.__setattr__(self, d.name, v)
            d.check(v)
        # Rules between fields: one place, here (the launcher builds a TrainConfig too).
        if not self.out:
            raise TrainConfigError("TrainConfig.out (the run directory, --out) must be set")
        if self.preset is None and not self.init:
            raise TrainConfigError("TrainConfig.preset is None: the model is built from --init "
                                   "CKPT's config.json, so --init must be set (or pass --preset)")
        if self.preset is not None and self.preset not in PRESETS:
            raise TrainConfigError(f"unknown preset {self.preset!r}; choose one of "
                                   f"{sorted(PRESETS)} (or --init CKPT without a preset)")
        if self.val_data and not self.data:
            raise TrainConfigError("--val-data needs --data (the byte corpus has its own val "
                                   "split)")
        if self.distill and not self.init:
            raise TrainConfigError("--distill needs --init CKPT: the teacher is the frozen --init "
                                   "model")
        if self.distill and self.kd_weight == 0 and self.ce_weight == 0:
            raise TrainConfigError("--distill with --kd-weight 0 and --ce-weight 0 has no "
                                   "objective")
        try:
            parse_qat_recipe(self.recipe, self.profile)
        except RecipeError as e:
            raise RecipeError(f"TrainConfig.recipe {self.recipe!r}: {e}") from None
        if self.export == "gpt-oss" and (self.qat_recipe.weight is None
                                         or self.qat_recipe.weight.fmt != "mxfp4"):
            raise TrainConfigError(f"--export gpt-oss stores MXFP4 weights; recipe "
                                   f"{self.recipe!r} trains another weight format (use --export "
                                   "bf16)")
        if self.export == "compressed-tensors" and self.qat_recipe.weight is None:
            raise TrainConfigError(f"--export compressed-tensors packs the recipe's weight "
                                   f"format; recipe {self.recipe!r} has none (use --export bf16)")
        check_allowed_changes(self.allow_config_change)

    @property
    def stats_every(self) -> int:
        """Steps between expert-statistics records (0: none): the validation interval unless
        set; bf16 runs have no fake quantization to describe."""
        if self.qat_recipe.is_bf16:
            return 0
        return self.val_every if self.expert_stats_every is None else self.expert_stats_every

    @property
    def qat_recipe(self) -> QATRecipe:
        """The typed recipe (weights and activations, with profiles) this run trains."""
        return parse_qat_recipe(self.recipe, self.profile)

    @property
    def weight_format(self) -> str | None:
        """The format the routed-expert weights are fake-quantized in (None for bf16)."""
        w = self.qat_recipe.weight
        return None if w is None else w.fmt

    def ep_size(self, world_size: int) -> int:
        """The expert-parallel size at `world_size` ranks (`ep`, or the world size)."""
        return world_size if self.ep is None else self.ep

    def check_world(self, world_size: int) -> None:
        """The layout rules at `world_size` ranks (world = ep x dp; dp > 1 needs FSDP), checked
        by the trainer at start-up and by the launcher when a job is described."""
        if self.batch % world_size:
            raise TrainConfigError(f"global batch {self.batch} must be a multiple of the world "
                                   f"size {world_size} (each rank trains on batch/world "
                                   "sequences)")
        ep = self.ep_size(world_size)
        if world_size % ep:
            raise TrainConfigError(f"TrainConfig.ep (--ep {ep}) does not divide the world size "
                                   f"{world_size} (world = ep x dp)")
        if ep < world_size and not self.fsdp:
            raise TrainConfigError(
                f"TrainConfig.ep (--ep {ep}) < world size {world_size} needs --fsdp: the experts "
                f"of one EP group are then sharded over the {world_size // ep} data-parallel "
                "ranks that hold them (experts replicated without FSDP are not supported)")

    def replace(self, **changes: Any) -> TrainConfig:
        unknown = sorted(set(changes) - {d.name for d in declared(type(self))})
        if unknown:
            raise TrainConfigError(f"TrainConfig has no field(s) {unknown}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The inverse of `to_dict` after a JSON round trip (lists back to tuples)."""
        if not isinstance(d, dict):
            raise TrainConfigError(f"TrainConfig.from_dict needs a dict, got {type(d).__name__}")
        fields = {x.name: x for x in declared(cls)}
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise TrainConfigError(f"TrainConfig has no field(s) {unknown}")
        return cls(**{k: tuple(v) if fields[k].kind is tuple and isinstance(v, list) else v
                      for k, v in d.items()})


# What a --resume may change, from the declarations (workbench.train.resume_config compares the
# checkpoints against them; here so TrainConfig checks allow_config_change without torch).
FREE = frozenset(d.name for d in declared(TrainConfig) if d.option.resume == "free")
CHANGEABLE = tuple(d.name for d in declared(TrainConfig) if d.option.resume == "changeable")


def check_allowed_changes(names: Iterable[str]) -> None:
    """`TrainConfig.allow_config_change` may name only CHANGEABLE fields."""
    bad = [n for n in names if n not in CHANGEABLE]
    if bad:
        raise TrainConfigError(
            f"--allow-config-change {','.join(bad)}: only {', '.join(CHANGEABLE)} may change on "
            f"--resume (the others define the run; "
            f"{', '.join(sorted(FREE - {'resume', 'allow_config_change'}))} change freely)")


# Presets: the training hyper-parameters that fit each model preset of the same name.

def tiny(out: str, **overrides: Any) -> TrainConfig:
    """CPU tests: seconds for 20 steps."""
    return TrainConfig(out=out, preset="tiny", batch=8, seq=64, lr=3e-3, warmup=5,
                       val_every=10, ckpt_every=10).replace(**overrides)


def small(out: str, **overrides: Any) -> TrainConfig:
    """CPU demo: a visibly falling loss in a few minutes."""
    return TrainConfig(out=out, preset="small", batch=16, seq=128, lr=2e-3, warmup=20,
                       steps=200, val_every=25, ckpt_every=50).replace(**overrides)


def gpu(out: str, preset: str, **overrides: Any) -> TrainConfig:
    """GPU-sized model presets (real expert shapes): short sequences, a low LR for QAT fine-tunes."""
    return TrainConfig(out=out, preset=preset, batch=32, seq=1024, lr=1e-4, warmup=50,
                       steps=500, val_every=100, ckpt_every=100).replace(**overrides)


def from_checkpoint(out: str, init: str | None = None, **overrides: Any) -> TrainConfig:
    """No preset: the model is the --init checkpoint's; a fine-tune's hyper-parameters."""
    return TrainConfig(out=out, preset=None, init=init, batch=32, seq=1024, lr=1e-5, warmup=20,
                       steps=500, val_every=100, ckpt_every=100).replace(**overrides)


def preset_config(name: str | None, out: str, **overrides: Any) -> TrainConfig:
    if name is None:
        return from_checkpoint(out, **overrides)
    if name == "tiny":
        return tiny(out, **overrides)
    if name == "small":
        return small(out, **overrides)
    if name not in PRESETS:
        raise TrainConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return gpu(out, name, **overrides)


def run_config(out: str, **fields: Any) -> TrainConfig:
    """The configuration of a run as the command line builds it: the preset's hyper-parameters,
    then `fields` (any TrainConfig fields) over them. `preset` left out: the `init` checkpoint's
    own model when `init` is given, else tiny. The launcher builds its jobs' configs here too."""
    preset = fields.pop("preset") if "preset" in fields else (None if fields.get("init")
                                                              else "tiny")
    return preset_config(preset, out, **fields)
