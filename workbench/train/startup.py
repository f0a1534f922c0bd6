"""The trainer's run folder before step 1: one writer, only a folder of its own, no run lost.

`open_run` (collective) has rank 0 check, before anything is written, that `--out` may take
this run (`workbench.train.runfolder`: new, empty, or a run folder of ours with no foreign file
where the run writes; not the `--init` checkpoint; no complete checkpoints of another run unless
`--resume`; a `--resume` configuration the checkpoints accept; an `--export` destination that is
an export of ours), then take the folder's lock for the run's life and name the run's entries in
the manifest. Every rank learns the outcome together, so a refusal is one line per run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from workbench.train import checkpointing as ckpt
from workbench.train import export_folder, runfolder
from workbench.train.config import TrainConfig
from workbench.train.distributed import DistInfo, on_main
from workbench.train.resume_config import check_resume_config
from workbench.train.runfolder import RunFolderError, RunLock


def check_fresh_start(cfg: TrainConfig) -> None:
    """A run without --resume must not start in a folder that holds another run's checkpoints;
    a --resume must keep the configuration its checkpoints were trained with."""
    found = ckpt.list_complete(cfg.out) if not cfg.resume else []
    if found:
        # A later --resume would pick the old run's newest checkpoint over this run's.
        raise RunFolderError(f"--out {cfg.out} already holds checkpoints of a run (newest step "
                             f"{found[-1].step}); pass --resume to continue it, or choose a new "
                             "--out")
    if cfg.resume:  # before anything in the run folder is written
        check_resume_config(cfg)


def _check_not_init(cfg: TrainConfig) -> None:
    if not cfg.init or not Path(cfg.init).exists():
        return  # a hub id or a URL: nothing in --out
    init, out = Path(cfg.init).resolve(), Path(cfg.out).resolve()
    if init == out:
        raise RunFolderError(f"--out {cfg.out} is the --init checkpoint folder: the run would "
                             "write its config.json, checkpoints and export over the model's; "
                             "choose another --out")
    if out in init.parents:
        raise RunFolderError(f"--init {cfg.init} lies inside --out {cfg.out}, which the run "
                             "rewrites; copy it elsewhere or choose another --out")


def _checks(cfg: TrainConfig) -> str:
    """Every refusal, reading only; returns what the folder is (runfolder.check_claimable)."""
    out = Path(cfg.out)
    _check_not_init(cfg)
    kind = runfolder.check_claimable(out, runfolder.TRAINER_ENTRIES, adopt_legacy=cfg.resume)
    check_fresh_start(cfg)
    if cfg.export:
        export_folder.check_replaceable(out / "export")
    return kind


def claim_run_folder(cfg: TrainConfig) -> RunLock:
    """Rank 0: every check (a refused run writes nothing), then the lock, the checks again
    under it (another run may have claimed the folder between), and the manifest."""
    out = Path(cfg.out)
    _checks(cfg)
    what = f"Slurm job {os.environ['SLURM_JOB_ID']}" if os.environ.get("SLURM_JOB_ID") else None
    lock = runfolder.acquire(out, role="trainer", what=what,
                             wait_for_submit_s=runfolder.SUBMIT_WAIT_S)
    try:
        kind = _checks(cfg)
        if lock.stale:
            print(f"[train] {out}: {runfolder.describe(lock.stale)} held this folder and ended "
                  "without releasing it (killed?); this run takes it over", flush=True)
        if kind == "legacy":
            print(f"[train] {out}: a run folder of an older workbench (no {runfolder.MANIFEST});"
                  " adopting what it holds of a run", flush=True)
        runfolder.claim(out, runfolder.TRAINER_ENTRIES, legacy=kind == "legacy")
    except BaseException:
        lock.release()
        raise
    return lock


@dataclass
class OpenRun:
    """A run folder opened by `open_run`, on every rank: rank 0 holds the lock."""

    lock: RunLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def open_run(cfg: TrainConfig, info: DistInfo) -> OpenRun:
    """Collective: `claim_run_folder` on rank 0, its refusal raised on every rank (one line per
    run). Release what it returns when the run ends (rank 0 gives the lock back)."""
    held: list[RunLock] = []
    on_main(info, lambda: held.append(claim_run_folder(cfg)))
    return OpenRun(held[0] if held else None)
