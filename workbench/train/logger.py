"""Experiment loggers: one small protocol, a null logger, and a wandb logger.

The trainer talks only to `Logger`. Tracking must never stop training: a missing wandb, a
failing `wandb.init` or an error inside any wandb call degrades to a warning (once per call
kind) and the run goes on. Only rank 0 logs; `make_logger` hands every other rank a
`NullLogger`, so callers never branch on rank themselves.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:  # only for annotations; importing either at runtime would defeat laziness
    import pandas as pd
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

Mode = Literal["offline", "online", "disabled"]
MODES: tuple[str, ...] = ("offline", "online", "disabled")


class TrackingWarning(UserWarning):
    """Tracking degraded (wandb missing, init failed, a call failed); training continues."""


@runtime_checkable
class Logger(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_table(self, name: str, df: pd.DataFrame, step: int) -> None: ...
    def log_image(self, name: str, fig: Figure, step: int) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def alert(self, title: str, text: str) -> None: ...
    def finish(self) -> None: ...


class NullLogger:
    """Accepts everything, records nothing: tracking off, or a rank other than 0."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_table(self, name: str, df: pd.DataFrame, step: int) -> None:
        pass

    def log_image(self, name: str, fig: Figure, step: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def alert(self, title: str, text: str) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass(frozen=True)
class WandbConfig:
    """What `wandb.init` needs. `mode="offline"` writes `DIR/wandb/offline-run-*` and needs no
    network or account; `online` streams to the server configured in the environment."""

    mode: Mode = "offline"
    project: str = "workbench"
    group: str | None = None
    name: str | None = None
    dir: str | None = None
    run_id: str | None = None
    tags: tuple[str, ...] = ()
    # Offline init takes ~2 s; online on a cluster without egress would otherwise wait 90 s.
    init_timeout_s: float = 60.0
    # The trainer's stdout already goes to the job log; wandb's console redirect would wrap
    # the streams of every process that inherits them, for no gain.
    console: Literal["off", "wrap", "redirect", "auto"] = "off"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"wandb mode {self.mode!r} is not one of {MODES}")
        if not self.project:
            raise ValueError("wandb project must be a non-empty string")
        if self.init_timeout_s <= 0:
            raise ValueError(f"init_timeout_s must be > 0, got {self.init_timeout_s}")
        if not isinstance(self.tags, tuple):
            raise TypeError("tags must be a tuple of strings (frozen config)")


@dataclass
class WandbLogger:
    """Logs to one wandb run. Build it with `WandbLogger.start(cfg, config)`, which returns a
    `NullLogger` instead when wandb is missing or `wandb.init` fails."""

    run: Any
    _wandb: Any
    errors: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, cfg: WandbConfig, config: dict[str, Any] | None = None) -> Logger:
        if cfg.mode == "disabled":
            return NullLogger()
        try:
            import wandb
        except ImportError as exc:
            _warn(f"wandb is not importable ({exc}); tracking is off. "
                  "Install the 'track' extra: pip install 'workbench[track]'")
            return NullLogger()
        try:
            if cfg.dir is not None:
                os.makedirs(cfg.dir, exist_ok=True)
            run = wandb.init(
                mode=cfg.mode, project=cfg.project, group=cfg.group, name=cfg.name,
                dir=cfg.dir, id=cfg.run_id, tags=list(cfg.tags) or None,
                config=dict(config or {}),
                # A resumed job re-uses its run id; offline mode then writes a second segment
                # that `workbench.track.offline.find_runs` merges back into one run.
                resume="allow" if cfg.run_id else None,
                # The trainer may log several runs from one process (tests, sweeps in a notebook).
                reinit="finish_previous",
                settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console=cfg.console),
            )
        # wandb.init raises many types (CommError, UsageError, timeouts): all mean "no tracking".
        except Exception as exc:  # noqa: BLE001
            _warn(f"wandb.init failed ({type(exc).__name__}: {exc}); tracking is off")
            return NullLogger()
        return cls(run=run, _wandb=wandb)

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        # A tracking error must never kill a training step.
        except Exception as exc:  # noqa: BLE001
            n = self.errors.get(what, 0)
            self.errors[what] = n + 1
            if n == 0:
                _warn(f"wandb {what} failed ({type(exc).__name__}: {exc}); later failures of "
                      f"{what} are counted, not reported")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._guard("log", self.run.log, dict(metrics), step=int(step))

    def log_config(self, config: dict[str, Any]) -> None:
        self._guard("log_config", self.run.config.update, dict(config), allow_val_change=True)

    def log_table(self, name: str, df: pd.DataFrame, step: int) -> None:
        # A named index (e.g. layer, expert) is data and becomes columns; a RangeIndex is not.
        unnamed = all(n is None for n in getattr(df.index, "names", [None]))
        self._guard("log_table", lambda: self.run.log(
            {name: self._wandb.Table(dataframe=df.reset_index(drop=unnamed))}, step=int(step)))

    def log_image(self, name: str, fig: Figure, step: int) -> None:
        def send() -> None:
            # wandb.Image recognises figures by comparing against `matplotlib.pyplot`, which
            # must therefore be imported even for a bare `Figure`.
            import matplotlib.pyplot  # noqa: F401

            self.run.log({name: self._wandb.Image(fig)}, step=int(step))

        self._guard("log_image", send)

    def summary(self, values: dict[str, Any]) -> None:
        self._guard("summary", self.run.summary.update, dict(values))

    def alert(self, title: str, text: str) -> None:
        self._guard("alert", self.run.alert, title=title, text=text,
                    level=self._wandb.AlertLevel.WARN)

    def finish(self) -> None:
        if self.errors:
            log.warning("wandb call failures during this run: %s", self.errors)
        self._guard("finish", self.run.finish)


def make_logger(mode: Mode = "offline", rank: int = 0, project: str = "workbench",
                group: str | None = None, name: str | None = None, dir: str | None = None,
                config: dict[str, Any] | None = None, **wandb_options: Any) -> Logger:
    """Rank 0 gets a wandb logger (or a NullLogger when wandb is unusable); other ranks and
    `mode="disabled"` get a NullLogger. Extra keyword options go to `WandbConfig`."""
    cfg = WandbConfig(mode=mode, project=project, group=group, name=name, dir=dir,
                      **wandb_options)
    if rank != 0 or cfg.mode == "disabled":
        return NullLogger()
    return WandbLogger.start(cfg, config)


_warned: set[str] = set()


def _warn(message: str) -> None:
    # Warn once per message per process: a trainer calls the logger every step.
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, TrackingWarning, stacklevel=3)
