"""The trainer's command line as data: the parser, argv -> TrainConfig, and its inverse.

    torchrun --nproc-per-node N jobs/qat.py --preset tiny --recipe mxfp4 --steps S --out DIR \\
        [--resume] [--export compressed-tensors|bf16] [--init CKPT] [--seed N] [--ckpt-every N] \\
        [--wandb offline|online|disabled] [--run-group G] [--val-every N] [--batch B] [--seq S] \\
        [--lr LR] [--profile P] [--keep K] [--[no-]deterministic] \\
        [--activation-checkpointing full|selective] [--expert-stats-every N] \\
        [--ep N] [--fsdp] \\
        [--allow-config-change steps,lr,...]

Runs as one process without torchrun too. Flags left out keep the preset's value.

Torch-free (it imports only `workbench.train.config`, `workbench.arch` and `workbench.recipe`):
the launcher builds each job's `TrainConfig` with this parser when a `LaunchSpec` is made, and
writes the job's argv with `trainer_argv`, next to the parser it must agree with.
`workbench.train.cli` runs the trainer on what `config_from_args` returns.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from workbench.train.config import (
    ACT_CKPT_MODES,
    CHANGEABLE,
    EXPORTS,
    WANDB_MODES,
    TrainConfig,
    parse_allowed_changes,
    preset_config,
)

# --help's first line, as it read when the parser lived in workbench.train.cli.
_DESCRIPTION = "Command line of the QAT trainer (`jobs/qat.py` and `python -m workbench.train.cli`)."


class TrainArgsError(ValueError):
    """The trainer's parser refused a command line (an unknown flag, a value of the wrong type)."""


class _RaisingParser(argparse.ArgumentParser):
    """For callers that are not a terminal (the launcher): argparse prints usage and exits 2 on a
    bad flag; this raises `TrainArgsError` with argparse's one-line message instead."""

    def error(self, message: str) -> NoReturn:
        raise TrainArgsError(f"{self.prog}: {' '.join(message.split())}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        # --help ends here: the caller's process (a notebook kernel) must not exit with it.
        raise TrainArgsError(f"{self.prog}: {' '.join((message or 'exits here').split())}")


# CLI flag -> TrainConfig field, for the flags whose default comes from the preset.
_OVERRIDES = {"steps": "steps", "seed": "seed", "ckpt_every": "ckpt_every", "val_every": "val_every",
              "batch": "batch", "seq": "seq", "lr": "lr", "profile": "profile", "keep": "keep",
              "warmup": "warmup", "grad_clip": "grad_clip", "deterministic": "deterministic",
              "activation_checkpointing": "activation_checkpointing",
              "expert_stats_every": "expert_stats_every", "tokenizer": "tokenizer",
              "token_cache": "token_cache", "kd_temperature": "kd_temperature",
              "kd_weight": "kd_weight", "ce_weight": "ce_weight", "ep": "ep", "fsdp": "fsdp",
              "skip_nonfinite_steps": "skip_nonfinite_steps"}


def parser(raising: bool = False) -> argparse.ArgumentParser:
    """The trainer's parser; `raising=True`: a bad command line raises TrainArgsError (one line)
    instead of printing usage and exiting with code 2."""
    cls = _RaisingParser if raising else argparse.ArgumentParser
    p = cls(prog="jobs/qat.py", description=_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help="model + training preset (tiny, small, ...); default: the "
                   "--init checkpoint's own model (config.json; also: --preset checkpoint), or tiny "
                   "without --init")
    p.add_argument("--recipe", default="bf16",
                   help="W[:PROFILE][+A[:PROFILE]], e.g. mxfp4, nvfp4:te, mxfp4+mxfp8, "
                        "nvfp4+mxfp8, mxfp8; bf16 / none: no quantization")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", required=True, help="run directory (metrics, checkpoints, export)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --out (no-op if none)")
    p.add_argument("--allow-config-change", type=_allowed_changes, default=(),
                   metavar="FIELD[,FIELD]",
                   help="fields --resume may change from the checkpoint's configuration "
                        f"(any of {','.join(CHANGEABLE)}); others must match")
    p.add_argument("--export", choices=EXPORTS, help="write an HF checkpoint to OUT/export")
    p.add_argument("--init", help="BF16 or packed HF checkpoint to start from")
    p.add_argument("--seed", type=int)
    p.add_argument("--ckpt-every", type=int)
    p.add_argument("--keep", type=int, help="complete checkpoints to keep")
    p.add_argument("--val-every", type=int)
    p.add_argument("--batch", type=int, help="GLOBAL batch in sequences (multiple of world size)")
    p.add_argument("--seq", type=int, help="predicted tokens per sequence")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int)
    p.add_argument("--grad-clip", type=float)
    p.add_argument("--skip-nonfinite-steps", type=int, metavar="N",
                   help="skip up to N steps whose loss or gradient is NaN/Inf (no update, counted "
                        "as skipped_steps); default 0: stop at the first, exit 2")
    p.add_argument("--profile", help="deprecated: the weight format's codec profile; write it in "
                   "the recipe instead (--recipe mxfp4:floor)")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="training text (repeatable): .jsonl, .parquet, .txt or folder, "
                   "datasets.save_to_disk folder, hf:NAME[:CONFIG][:SPLIT]; see docs/data.md")
    p.add_argument("--val-data", action="append", metavar="PATH",
                   help="validation text (repeatable); default: hold out the last train sequences")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the --init folder's)")
    p.add_argument("--token-cache", help="private token cache folder (default: OUT/../.token-cache-UID)")
    p.add_argument("--distill", action="store_true",
                   help="distil from the frozen --init model (KL to its logits)")
    p.add_argument("--kd-temperature", type=float, help="distillation temperature T (default 1)")
    p.add_argument("--kd-weight", type=float, help="weight of T^2 * KL (default 1)")
    p.add_argument("--ce-weight", type=float, help="weight of the CE loss (default 0 with "
                   "--distill; without --distill the loss is CE)")
    p.add_argument("--wandb", default="offline", choices=WANDB_MODES)
    p.add_argument("--run-group", help="wandb group (baseline + QAT runs compared together)")
    p.add_argument("--run-name")
    p.add_argument("--project", default="workbench")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="bitwise-reproducible run: deterministic algorithms and cuBLAS workspace "
                        "(docs/determinism.md); left out: TrainConfig's default")
    p.add_argument("--activation-checkpointing", choices=ACT_CKPT_MODES,
                   help="recompute each decoder layer in backward: full, or selective (keep the "
                        "matmul/attention outputs); default off")
    p.add_argument("--ep", type=int, metavar="N",
                   help="expert-parallel size (default: the world size); N < world needs --fsdp")
    p.add_argument("--fsdp", action="store_true", default=None,
                   help="FSDP2: shard dense parameters over all ranks, experts over the ranks "
                        "that hold the same experts (docs/fsdp.md)")
    p.add_argument("--expert-stats-every", type=int,
                   help="steps between per-expert quantization records in OUT/expert_stats.parquet"
                        " (default: at each validation; 0: off)")
    return p


def _allowed_changes(text: str) -> tuple[str, ...]:
    try:
        return parse_allowed_changes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_from_args(argv: list[str] | None = None, raising: bool = False) -> TrainConfig:
    """The TrainConfig the trainer runs for `argv`. A bad flag exits 2 (argparse), or raises
    TrainArgsError with `raising`; a bad value TrainConfig checks (recipe, preset, export for
    the recipe) raises its ValueError either way (the CLI prints those as one line, exit 2)."""
    a = parser(raising).parse_args(argv)
    overrides: dict[str, Any] = {f: getattr(a, k) for k, f in _OVERRIDES.items()
                                 if getattr(a, k) is not None}
    # "--preset checkpoint" says explicitly what leaving --preset out says with --init (for
    # launchers that always pass a preset): the model is the --init checkpoint's own.
    name = None if a.preset == "checkpoint" else a.preset if a.preset is not None or a.init \
        else "tiny"
    return preset_config(name, a.out, recipe=a.recipe, resume=a.resume, export=a.export,
                         init=a.init, wandb=a.wandb, run_group=a.run_group, run_name=a.run_name,
                         project=a.project, allow_config_change=a.allow_config_change,
                         data=tuple(a.data or ()), val_data=tuple(a.val_data or ()),
                         distill=a.distill, **overrides)


# TrainConfig fields the trainer CLI sets, as (field, flag); booleans and tuples are below.
_VALUE_FLAGS = (("steps", "--steps"), ("seed", "--seed"), ("ckpt_every", "--ckpt-every"),
                ("keep", "--keep"), ("val_every", "--val-every"), ("batch", "--batch"),
                ("seq", "--seq"), ("lr", "--lr"), ("warmup", "--warmup"),
                ("grad_clip", "--grad-clip"), ("profile", "--profile"),
                ("export", "--export"), ("init", "--init"), ("tokenizer", "--tokenizer"),
                ("token_cache", "--token-cache"), ("kd_temperature", "--kd-temperature"),
                ("kd_weight", "--kd-weight"), ("ce_weight", "--ce-weight"),
                ("wandb", "--wandb"), ("run_group", "--run-group"), ("run_name", "--run-name"),
                ("project", "--project"), ("activation_checkpointing", "--activation-checkpointing"),
                ("expert_stats_every", "--expert-stats-every"), ("ep", "--ep"),
                ("skip_nonfinite_steps", "--skip-nonfinite-steps"))


def trainer_argv(cfg: TrainConfig) -> list[str]:
    """The trainer command line (`jobs/qat.py` flags) that `config_from_args` turns back into
    exactly `cfg`; every set field is written out, so a preset's defaults cannot drift in between.
    Raises ValueError for a config the CLI cannot express (a field with no flag, e.g. beta1)."""
    argv = ["--out", str(cfg.out), "--preset", "checkpoint" if cfg.preset is None else cfg.preset,
            "--recipe", str(cfg.recipe)]
    for name, flag in _VALUE_FLAGS:
        v = getattr(cfg, name)
        if v is not None:
            argv += [flag, repr(v) if isinstance(v, float) else str(v)]
    argv.append("--deterministic" if cfg.deterministic else "--no-deterministic")
    for flag, on in (("--resume", cfg.resume), ("--distill", cfg.distill),
                     ("--fsdp", cfg.fsdp)):
        if on:
            argv.append(flag)
    for path in cfg.data:
        argv += ["--data", path]
    for path in cfg.val_data:
        argv += ["--val-data", path]
    if cfg.allow_config_change:
        argv += ["--allow-config-change", ",".join(cfg.allow_config_change)]
    back = config_from_args(argv)
    if back != cfg:
        diff = sorted(k for k, v in cfg.to_dict().items() if back.to_dict()[k] != v)
        raise ValueError(f"the trainer CLI has no flag for TrainConfig field(s) {diff} as set "
                         "here; use the preset's value or pass them through trainer_args")
    return argv
