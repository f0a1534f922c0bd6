"""The trainer's typed configuration: one frozen dataclass, presets as functions, CLI overrides.

`batch` is the GLOBAL batch in sequences: every EP size trains on the same global batch and rank r
takes rows [r*batch/W, (r+1)*batch/W) (see `workbench.train.data`), so `batch` must be a multiple
of the world size.

Layout (`ep`, `fsdp`; `workbench.train.distributed.Layout`): world = ep x dp. `ep=None` is EP size =
world size (every rank holds a replica of the dense parameters, no FSDP). With `fsdp`, FSDP2 shards
the dense parameters over all ranks and the experts over the dp ranks that hold the same experts.
EP < world needs `fsdp`: replicated experts without FSDP are not supported (one way to run them).
The layout is not training semantics: a `--resume` may change it (the checkpoint reshards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from workbench.arch import PRESETS
from workbench.recipe import QATRecipe, RecipeError, parse_qat_recipe

ACT_CKPT_MODES = ("off", "full", "selective")
EXPORTS = ("compressed-tensors", "bf16")
WANDB_MODES = ("offline", "online", "disabled")

# What a --resume may change (workbench.train.resume_config compares against the checkpoints;
# here so TrainConfig checks allow_config_change without importing torch). FREE: activation
# checkpointing recomputes the same numbers; the layout (ep, fsdp) only changes which rank holds
# which shard; determinism and telemetry change no value the run trains with.
FREE = frozenset({"out", "resume", "allow_config_change", "init", "val_every", "ckpt_every",
                  "keep", "export", "wandb", "project", "run_group", "run_name",
                  "activation_checkpointing", "deterministic", "expert_stats_every",
                  # what to do with a step whose loss or gradient is NaN/Inf: never a value of
                  # the steps that train (a stopped run resumes with skipping allowed)
                  "skip_nonfinite_steps",
                  # the parallel layout: the checkpoint reshards (checkpointing.state_dict), and
                  # the trained function is the same at every layout (docs/fsdp.md)
                  "ep", "fsdp"})
CHANGEABLE = ("steps", "lr", "min_lr_ratio", "warmup", "grad_clip", "val_batches")


def check_allowed_changes(names: Iterable[str]) -> None:
    """`TrainConfig.allow_config_change` may name only CHANGEABLE fields."""
    if isinstance(names, str):
        raise TypeError(f"allow_config_change must be a tuple of field names, got {names!r}")
    bad = [n for n in names if n not in CHANGEABLE]
    if bad:
        raise ValueError(f"--allow-config-change {','.join(bad)}: only {', '.join(CHANGEABLE)} "
                         "may change on --resume (the others define the run; "
                         f"{', '.join(sorted(FREE - {'resume', 'allow_config_change'}))} "
                         "change freely)")


def parse_allowed_changes(text: str) -> tuple[str, ...]:
    """The CLI's `--allow-config-change a,b,c`."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    check_allowed_changes(names)
    return names


@dataclass(frozen=True)
class TrainConfig:
    out: str
    # Model preset of workbench.arch.PRESETS; None: the model is the --init
    # checkpoint's own architecture (its config.json).
    preset: str | None = "tiny"
    # W[:PROFILE][+A[:PROFILE]] (workbench.recipe); checked at construction, typed as
    # `qat_recipe`. Kept as the text given so recorded run folders ("mxfp4") stay resumable.
    recipe: str = "bf16"
    profile: str | None = None  # deprecated: the weight profile; prefer "mxfp4:floor"
    steps: int = 20
    batch: int = 8  # global sequences per step
    seq: int = 64  # tokens per sequence (inputs; one more token is read for the labels)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    warmup: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping (the norm is still logged)
    # A step whose loss or global gradient norm is NaN/Inf stops the run before the optimizer
    # step (exit 2, naming the step and the last good checkpoint); N > 0 skips up to N such
    # steps instead (no optimizer or LR step; counted in metrics as `skipped_steps`).
    skip_nonfinite_steps: int = 0
    val_every: int = 10  # 0 disables validation
    val_batches: int = 2
    ckpt_every: int = 10  # 0: only the final / preemption checkpoint
    keep: int = 2  # complete checkpoints kept on disk
    seed: int = 0
    resume: bool = False
    init: str | None = None  # BF16 or packed HF checkpoint to start from
    export: str | None = None  # None, "compressed-tensors" or "bf16"
    # Real data (workbench.train.datasets, docs/data.md); none: the shipped byte corpus.
    data: tuple[str, ...] = ()
    val_data: tuple[str, ...] = ()  # none: the last train sequences are held out
    tokenizer: str | None = None  # None: the --init folder's tokenizer
    token_cache: str | None = None  # None: <parent of out>/.token-cache-<uid> (private, 0700)
    # Distillation from the frozen --init model (workbench.train.distill).
    distill: bool = False
    kd_temperature: float = 1.0
    kd_weight: float = 1.0
    ce_weight: float = 0.0
    wandb: str = "offline"
    run_group: str | None = None
    project: str = "workbench"
    run_name: str | None = None
    # Bitwise-reproducible GPU runs (workbench.train.determinism, docs/determinism.md).
    deterministic: bool = True  # 0.8% of the GPU step (docs/determinism.md), so on by default
    activation_checkpointing: str = "off"  # off | full | selective (workbench.train.act_ckpt)
    ep: int | None = None  # expert-parallel size; None: the world size (see the module doc)
    fsdp: bool = False  # FSDP2 over dense parameters (all ranks) and experts (dp ranks)
    expert_stats_every: int | None = None  # None: at each validation; 0: off (expert_stats.py)
    allow_config_change: tuple[str, ...] = ()  # fields --resume may change (resume_config)

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("TrainConfig.out (the run directory, --out) must be set")
        if self.preset is None and not self.init:
            raise ValueError("TrainConfig.preset is None: the model is built from --init CKPT's "
                             "config.json, so --init must be set (or pass --preset)")
        for name in ("data", "val_data"):
            v = getattr(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) and x for x in v):
                raise TypeError(f"TrainConfig.{name} must be a tuple of paths, got {v!r}")
        if self.val_data and not self.data:
            raise ValueError("--val-data needs --data (the byte corpus has its own val split)")
        if self.distill and not self.init:
            raise ValueError("--distill needs --init CKPT: the teacher is the frozen --init model")
        if not self.kd_temperature > 0 or self.kd_weight < 0 or self.ce_weight < 0:
            raise ValueError("--kd-temperature must be > 0, --kd-weight and --ce-weight >= 0")
        if self.distill and self.kd_weight == 0 and self.ce_weight == 0:
            raise ValueError("--distill with --kd-weight 0 and --ce-weight 0 has no objective")
        if isinstance(self.recipe, QATRecipe):
            object.__setattr__(self, "recipe", str(self.recipe))
        try:
            parse_qat_recipe(self.recipe, self.profile)
        except RecipeError as e:
            raise RecipeError(f"TrainConfig.recipe {self.recipe!r}: {e}") from None
        for name in ("steps", "batch", "seq", "val_batches", "keep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        for name in ("warmup", "val_every", "ckpt_every", "seed", "skip_nonfinite_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"Adam betas must lie in [0, 1), got {self.beta1}, {self.beta2}")
        if self.grad_clip < 0 or self.weight_decay < 0 or self.adam_eps <= 0:
            raise ValueError("grad_clip and weight_decay must be >= 0 and adam_eps > 0")
        if self.export is not None and self.export not in EXPORTS:
            raise ValueError(f"export {self.export!r} is not one of {EXPORTS}")
        if self.export == "compressed-tensors" and self.qat_recipe.weight is None:
            raise ValueError(f"--export compressed-tensors packs the recipe's weight format; "
                             f"recipe {self.recipe!r} has none (use --export bf16)")
        if self.wandb not in WANDB_MODES:
            raise ValueError(f"wandb mode {self.wandb!r} is not one of {WANDB_MODES}")
        check_allowed_changes(self.allow_config_change)
        if not isinstance(self.deterministic, bool):  # ValueError like the field checks above
            raise ValueError(  # noqa: TRY004
                f"TrainConfig.deterministic must be a bool, got {self.deterministic!r}")
        if self.expert_stats_every is not None and (
                not isinstance(self.expert_stats_every, int) or self.expert_stats_every < 0):
            raise ValueError(f"TrainConfig.expert_stats_every must be an int >= 0 or None, got "
                             f"{self.expert_stats_every!r}")
        if self.ep is not None and (not isinstance(self.ep, int) or isinstance(self.ep, bool)
                                    or self.ep <= 0):
            raise ValueError(f"TrainConfig.ep must be a positive int or None, got {self.ep!r}")
        if not isinstance(self.fsdp, bool):
            raise ValueError(f"TrainConfig.fsdp must be a bool, got {self.fsdp!r}")  # noqa: TRY004
        if self.activation_checkpointing not in ACT_CKPT_MODES:
            raise ValueError(f"activation_checkpointing {self.activation_checkpointing!r} is not "
                             f"one of {ACT_CKPT_MODES}")

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
        if self.batch % world_size:
            raise ValueError(f"global batch {self.batch} must be a multiple of the world size "
                             f"{world_size} (each rank trains on batch/world sequences)")
        ep = self.ep_size(world_size)
        if world_size % ep:
            raise ValueError(f"TrainConfig.ep (--ep {ep}) does not divide the world size "
                             f"{world_size} (world = ep x dp)")
        if ep < world_size and not self.fsdp:
            raise ValueError(f"TrainConfig.ep (--ep {ep}) < world size {world_size} needs --fsdp: "
                             "the experts of one EP group are then sharded over the "
                             f"{world_size // ep} data-parallel ranks that hold them (experts "
                             "replicated without FSDP are not supported)")

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


def from_checkpoint(out: str, init: str, **overrides: Any) -> TrainConfig:
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
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return gpu(out, name, **overrides)
