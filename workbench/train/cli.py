"""Runs the QAT trainer: `workbench train`, `torchrun ... -m workbench.train.cli`, `jobs/qat.py`
(`--help` lists the flags).

The command line itself (the parser, argv -> TrainConfig and back) is `workbench.train.args`, which
the launcher imports without torch; this module adds what running needs: distributed set-up,
the run logger, signal handlers, and one-line errors with exit code 2, printed once per run (not
once per rank: `workbench.train.distributed.failure_line`). `main(argv)` is what a launched job
calls in every rank (`workbench.launch`'s default target).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from workbench._io import (
    NoSpaceError,
    atomic_write_json,
    atomic_write_text,
    is_no_space,
    no_space,
)
from workbench.arch import ModelConfigError
from workbench.checkpoint import CheckpointError as ReaderError
from workbench.recipe import RecipeError
from workbench.source import SourceError
from workbench.train.args import PROG, TrainArgsError, config_from_args
from workbench.train.checkpointing import CheckpointError
from workbench.train.config import TrainConfig, TrainConfigError
from workbench.train.datasets import DataError
from workbench.train.determinism import enable as enable_determinism
from workbench.train.distributed import (
    PeerFailed,
    RankTimeout,
    exit_process,
    failure_line,
    is_collective_failure,
    on_main,
    setup,
    teardown,
)
from workbench.train.export import ExportError
from workbench.train.export_folder import ExportFolderError
from workbench.train.init import InitError
from workbench.train.init_source import pin_init
from workbench.train.logger import make_logger
from workbench.train.loop import NonFiniteStep, clear_stop, request_stop, train
from workbench.train.resume_config import ResumeConfigError
from workbench.train.runfolder import RunFolderError
from workbench.train.startup import open_run
from workbench.train.tokenizer import TokenizerError

WANDB_RUN_ID_FILE = "wandb_run_id"
_RUN_ID_RE = re.compile(r"[a-z0-9]{8,32}")
# What a user can fix: a refused configuration, run folder, resume, checkpoint, data file,
# tokenizer, model config or export; a full disk; a rank that stopped answering. One line each
# (exit 2), never a traceback. A ReaderError is the --init checkpoint's (a missing shard, ...).
USER_ERRORS = (CheckpointError, ResumeConfigError, DataError, TokenizerError, ModelConfigError,
               InitError, RecipeError, NonFiniteStep, SourceError, TrainConfigError,
               RunFolderError, ExportError, ExportFolderError, NoSpaceError, RankTimeout,
               PeerFailed, ReaderError)


def _message(e: BaseException) -> str:
    if isinstance(e, ReaderError) and not isinstance(e, CheckpointError):
        return f"--init: {e.one_line()}"
    return " ".join(str(e).split())


def _install_signal_handlers() -> dict:
    """SIGTERM (torchrun / Slurm before a kill) and SIGUSR2 (Slurm's preemption warning, as
    submitit requests it) -> checkpoint at the next step boundary and return. Only signals still
    at their default are taken (a launcher's own handler wins); returns what to restore."""
    if threading.current_thread() is not threading.main_thread():
        return {}
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
    """The trainer on the command line `argv` (a refused one: one line, exit code 2)."""
    return run(config_from_args(argv))


def _write_run_files(cfg: TrainConfig, resolved: dict) -> str:
    """Rank 0, once the run folder is claimed: config.json and the wandb run id."""
    out = Path(cfg.out)
    atomic_write_json(out / "config.json", resolved)
    print("[train] config " + json.dumps(resolved, sort_keys=True), flush=True)
    return wandb_run_id(out, resume=cfg.resume)


def run(cfg: TrainConfig) -> dict:
    """The trainer on `cfg` in this process (one rank of a torchrun or submitit job, or alone).
    A failure the user can fix (USER_ERRORS, a collective a rank stopped answering in) is raised
    on every rank with `report_line` set: the one line this rank prints, or None when another
    rank of the run prints it."""
    cfg, init_source = pin_init(cfg)
    enable_determinism(cfg.deterministic)  # before CUDA / cuBLAS start (set_device, first matmul)
    info = setup(single_rank_group=cfg.fsdp, timeout_min=cfg.dist_timeout)
    opened = None
    failed = False
    try:
        cfg.check_world(info.world)
        # The run folder is claimed and locked before config.json and a fresh wandb run id
        # replace those a --resume of the run in `out` would need.
        opened = open_run(cfg, info)
        resolved = {**cfg.to_dict(), "world_size": info.world, "ep_size": cfg.ep_size(info.world),
                    "device": str(info.device), "init_source": init_source}
        run_id = on_main(info, lambda: _write_run_files(cfg, resolved))
        logger = None
        if info.is_main:
            logger = make_logger(cfg.wandb, rank=info.rank, project=cfg.project,
                                 group=cfg.run_group, name=cfg.run_name or Path(cfg.out).name,
                                 dir=str(cfg.out), config=resolved, run_id=run_id)
            logger.log_config(resolved)
        previous = _install_signal_handlers()
        try:
            result = train(cfg, info, logger=logger, opened=opened)
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
    except BaseException as e:
        failed = True  # the other ranks may never reach teardown's barrier
        shown = e
        if isinstance(e, OSError) and not isinstance(e, NoSpaceError) and is_no_space(e):
            # a full disk under a writer that does not name its file: the run folder's device
            shown = no_space(e, e.filename or cfg.out)
            if hasattr(e, "reporter"):
                shown.reporter = e.reporter
        elif not (isinstance(e, USER_ERRORS) or is_collective_failure(e)):
            raise
        # Before the group goes: the ranks elect the one that prints (or name a silent rank).
        line = failure_line(info, shown, timeout_min=cfg.dist_timeout)
        e.report_line = _message(shown) if line == " ".join(str(shown).split()) else line
        raise
    finally:
        if opened is not None:
            opened.release()
        teardown(info, failed=failed)


def _rank_from_env() -> int:
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def cli(argv: list[str] | None = None, prog: str = PROG) -> dict:
    """`main` for a terminal: a refused command line, and input the user can fix (a refused
    run folder or resume, an unusable checkpoint, a bad data file, tokenizer or model config, a
    full disk, a rank that stopped answering), is one line on stderr naming it and exit code 2,
    printed by one rank of the run, not a traceback per rank."""
    if _rank_from_env() != 0:  # every rank parses the same argv: rank 0 says what is wrong
        try:
            cfg = config_from_args(argv, raising=True, prog=prog)
        except TrainArgsError:
            raise SystemExit(2) from None
    else:
        cfg = config_from_args(argv, prog=prog)
    try:
        return run(cfg)
    except Exception as e:
        if not hasattr(e, "report_line"):
            if not isinstance(e, USER_ERRORS):
                raise
            # failed before the process group (resolving --init): every rank fails alike and,
            # as for the command line, rank 0 says why
            e.report_line = _message(e) if _rank_from_env() == 0 else None
        if e.report_line is not None:
            print(f"error: {e.report_line}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def console(argv: list[str] | None = None, prog: str = PROG) -> NoReturn:
    """`cli`, then leave the process without finalisation while gloo threads live (FSDP; see
    `distributed.exit_process`): the end of `workbench train`, `-m workbench.train.cli` and
    `jobs/qat.py`."""
    try:
        cli(argv, prog)
    except SystemExit as e:
        exit_process(e.code if isinstance(e.code, int) else 1)
    exit_process(0)


if __name__ == "__main__":
    console(prog="python -m workbench.train.cli")
