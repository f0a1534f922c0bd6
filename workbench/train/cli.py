"""Command line of the QAT trainer (`jobs/qat.py` and `python -m workbench.train.cli`).

    torchrun --nproc-per-node N jobs/qat.py --preset tiny --recipe mxfp4 --steps S --out DIR \\
        [--resume] [--export compressed-tensors|bf16] [--init CKPT] [--seed N] [--ckpt-every N] \\
        [--wandb offline|online|disabled] [--run-group G] [--val-every N] [--batch B] [--seq S] \\
        [--lr LR] [--profile P] [--keep K] [--[no-]deterministic] \\
        [--activation-checkpointing full|selective] [--expert-stats-every N] \\
        [--ep N] [--fsdp] \\
        [--allow-config-change steps,lr,...]

Runs as one process without torchrun too. Flags left out keep the preset's value.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from workbench._io import atomic_write_json, atomic_write_text
from workbench.arch import ModelConfigError
from workbench.recipe import RecipeError
from workbench.train.checkpointing import CheckpointError
from workbench.train.config import (
    ACT_CKPT_MODES,
    EXPORTS,
    WANDB_MODES,
    TrainConfig,
    preset_config,
)
from workbench.train.datasets import DataError
from workbench.train.init import InitError
from workbench.train.logger import make_logger
from workbench.train.resume_config import CHANGEABLE, ResumeConfigError, parse_allowed_changes
from workbench.train.tokenizer import TokenizerError

WANDB_RUN_ID_FILE = "wandb_run_id"
_RUN_ID_RE = re.compile(r"[a-z0-9]{8,32}")

# CLI flag -> TrainConfig field, for the flags whose default comes from the preset.
_OVERRIDES = {"steps": "steps", "seed": "seed", "ckpt_every": "ckpt_every", "val_every": "val_every",
              "batch": "batch", "seq": "seq", "lr": "lr", "profile": "profile", "keep": "keep",
              "warmup": "warmup", "grad_clip": "grad_clip", "deterministic": "deterministic",
              "activation_checkpointing": "activation_checkpointing",
              "expert_stats_every": "expert_stats_every", "tokenizer": "tokenizer",
              "token_cache": "token_cache", "kd_temperature": "kd_temperature",
              "kd_weight": "kd_weight", "ce_weight": "ce_weight", "ep": "ep", "fsdp": "fsdp"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jobs/qat.py", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--profile", help="deprecated: the weight format's codec profile; write it in "
                   "the recipe instead (--recipe mxfp4:floor)")
    p.add_argument("--data", action="append", metavar="PATH",
                   help="training text (repeatable): .jsonl, .parquet, .txt or folder, "
                   "datasets.save_to_disk folder, hf:NAME[:CONFIG][:SPLIT]; see docs/data.md")
    p.add_argument("--val-data", action="append", metavar="PATH",
                   help="validation text (repeatable); default: hold out the last train sequences")
    p.add_argument("--tokenizer", help="tokenizer folder (default: the --init folder's)")
    p.add_argument("--token-cache", help="token cache folder (default: OUT/../.token-cache)")
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


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    a = parser().parse_args(argv)  # --recipe is parsed by TrainConfig (one line, exit 2 in cli)
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
                ("expert_stats_every", "--expert-stats-every"), ("ep", "--ep"))


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


def _install_signal_handlers() -> dict:
    """SIGTERM (torchrun / Slurm before a kill) and SIGUSR2 (Slurm's preemption warning, as
    submitit requests it) -> checkpoint at the next step boundary and return. Only signals still
    at their default are taken (a launcher's own handler wins); returns what to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    from workbench.train.loop import request_stop

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, lambda signum, frame: request_stop())
    return previous


def _restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def wandb_run_id(out: Path, *, resume: bool) -> str:
    """The wandb run id of the run in `out`: drawn on a fresh start and stored in
    `out/WANDB_RUN_ID_FILE`, read back on --resume, so every attempt of a preempted or
    requeued run logs into one wandb run (offline segments merge by id)."""
    path = out / WANDB_RUN_ID_FILE
    if resume and path.is_file():
        run_id = path.read_text().strip()
        if not _RUN_ID_RE.fullmatch(run_id):
            raise ValueError(f"{path}: {run_id!r} is not a wandb run id (8-32 of [a-z0-9]); "
                             "delete the file to start a new wandb run")
        return run_id
    run_id = secrets.token_hex(8)  # wandb's own ids are lowercase alphanumerics too
    atomic_write_text(path, run_id + "\n")
    return run_id


def final_summary(result: dict, cfg: TrainConfig) -> str:
    """What a user looks for when the trainer ends: how far it got, the last losses, and
    where the export and the metrics are."""
    def num(v):
        return "-" if v is None else f"{v:.4f}"

    out = Path(cfg.out)
    state = "stopped early (checkpointed; --resume continues)" if result.get("stopped") else "done"
    lines = [(f"[train] {state}: step {result.get('step')}/{result.get('steps')}, recipe "
             f"{result.get('recipe')}, world {result.get('world_size')}"),
             (f"[train]   final loss {num(result.get('final_loss'))}, "
             f"val_loss {num(result.get('final_val_loss'))}"),
             f"[train]   export: {result.get('export') or 'none (pass --export)'}",
             f"[train]   checkpoint: {result.get('checkpoint')}",
             f"[train]   metrics: {out / 'metrics.jsonl'}, result: {out / 'result.json'}"]
    if cfg.wandb == "offline":
        lines.append(f"[train]   wandb (offline): wandb sync {out / 'wandb'}/offline-run-*")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from workbench.train import distributed
    from workbench.train.determinism import enable as enable_determinism
    from workbench.train.loop import check_fresh_start, clear_stop, train

    cfg = config_from_args(argv)
    enable_determinism(cfg.deterministic)  # before CUDA / cuBLAS start (set_device, first matmul)
    info = distributed.setup(single_rank_group=cfg.fsdp)
    try:
        cfg.check_world(info.world)
        # Before config.json and a fresh wandb run id replace those a --resume of the run in
        # `out` would need (train() checks again, for callers that skip main).
        check_fresh_start(cfg)
        resolved = {**cfg.to_dict(), "world_size": info.world, "ep_size": cfg.ep_size(info.world),
                    "device": str(info.device)}
        logger = None
        if info.is_main:
            out = Path(cfg.out)
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "config.json", resolved)
            print("[train] config " + json.dumps(resolved, sort_keys=True), flush=True)
            logger = make_logger(cfg.wandb, rank=info.rank, project=cfg.project,
                                 group=cfg.run_group, name=cfg.run_name or Path(cfg.out).name,
                                 dir=str(cfg.out), config=resolved,
                                 run_id=wandb_run_id(out, resume=cfg.resume))
            logger.log_config(resolved)
        previous = _install_signal_handlers()
        try:
            result = train(cfg, info, logger=logger)
            if info.is_main:
                print(final_summary(result, cfg), flush=True)
            # Before finish(): a summary sent to a finished run is dropped.
            if logger is not None and not result["stopped"]:
                logger.summary({k: v for k, v in result.items()
                                if isinstance(v, (int, float, str))})
        finally:
            _restore_signal_handlers(previous)
            # Cleared only now, not at start-up: a stop a launcher requested while this process
            # was still starting (building, loading --init) is honoured at the first step boundary.
            clear_stop()
            if logger is not None:
                logger.finish()
        return result
    finally:
        distributed.teardown(info)


def cli(argv: list[str] | None = None) -> dict:
    """`main` for a terminal: input the user can fix (a refused resume, an unusable checkpoint,
    a bad data file, tokenizer or model config) is one line on stderr naming it and exit code 2,
    not a traceback per rank."""
    try:
        return main(argv)
    except (CheckpointError, ResumeConfigError, DataError, TokenizerError, ModelConfigError,
            InitError, RecipeError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
