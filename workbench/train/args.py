"""The trainer's command line, derived from `TrainConfig`'s declarations: the parser, argv ->
TrainConfig, and its inverse.

    workbench train --preset tiny --recipe mxfp4 --steps 20 --out runs/x          # one process
    torchrun --nproc-per-node 4 -m workbench.train.cli --recipe mxfp4 --out runs/x
    torchrun --nproc-per-node 4 jobs/qat.py --recipe mxfp4 --out runs/x            # the same

Every TrainConfig field is a flag (`--field-name VALUE`, booleans `--x` / `--no-x`, repeatable
tuples `--data A --data B`); `--help` lists them with the help their declaration carries. Flags
left out keep the preset's value (`workbench.train.config.run_config`). Nothing here names a
field: a field added to TrainConfig is a flag, in the job argv the launcher writes, and in what
the trainer parses back, with no edit here.

Torch-free (it imports only `workbench.train.config`, `workbench.arch` and `workbench.recipe`):
the launcher writes each job's argv with `trainer_argv`, and `workbench.train.cli` runs the
trainer on what `config_from_args` returns.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, NoReturn

from workbench.train.config import CHANGEABLE, FREE, Declared, TrainConfig, declared, run_config

PROG = "workbench train"
_DESCRIPTION = ("Runs the QAT trainer: `workbench train` (one process), or under torchrun "
                "`-m workbench.train.cli` / `jobs/qat.py` (one process per rank).")


class TrainArgsError(ValueError):
    """The trainer's parser refused a command line (an unknown flag, a value of the wrong type,
    a configuration TrainConfig refuses); the message is one line."""


class _Parser(argparse.ArgumentParser):
    """For a terminal: a refused command line is one line `PROG: error: ...` on stderr and exit
    code 2 (argparse would print the whole usage first; --help shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


class _RaisingParser(argparse.ArgumentParser):
    """For callers that are not a terminal (tests, notebooks): `TrainArgsError` with argparse's
    one-line message instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise TrainArgsError(f"{self.prog}: {' '.join(message.split())}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        # --help ends here: the caller's process (a notebook kernel) must not exit with it.
        raise TrainArgsError(f"{self.prog}: {' '.join((message or 'exits here').split())}")


def _parse_fn(d: Declared) -> Callable[[str], Any]:
    """Command-line text -> the field's value (argparse's `type`)."""
    base = d.option.parse or {int: int, float: float, str: str, tuple: str}[d.kind]
    none = d.option.none
    if none is None:
        return base

    def parse(text: str) -> Any:
        return None if text == none else base(text)

    parse.__name__ = base.__name__  # argparse names the type in its message: "invalid int value"
    return parse


def _text(d: Declared, v: Any) -> str:
    """The field's value -> command-line text (the inverse of `_parse_fn`)."""
    if v is None:
        return d.option.none
    if d.option.fmt is not None:
        return d.option.fmt(v)
    return repr(v) if d.kind is float else str(v)  # repr: the shortest text float() reads back


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, from its declaration. Defaults are left out of the
    namespace (`argument_default=SUPPRESS` on `p`): what is absent keeps the preset's value."""
    for d in declared(TrainConfig):
        o = d.option
        kw: dict[str, Any] = {"dest": d.name, "help": o.help}
        if d.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _parse_fn(d)
            if o.choices is not None:
                kw["metavar"] = "{" + ",".join(map(str, o.choices)) + "}"
            elif o.metavar is not None:
                kw["metavar"] = o.metavar
            if o.repeat:
                kw["action"] = "append"
        if d.default is dataclasses.MISSING:
            kw["required"] = True
        p.add_argument(d.flag, **kw)


def _epilog() -> str:
    free = sorted(FREE - {"resume", "allow_config_change"})
    return (f"Flags left out keep the preset's value. A --resume may change {', '.join(free)} "
            f"freely, and {', '.join(CHANGEABLE)} when named in --allow-config-change; every "
            "other field must match the run's checkpoints.")


def parser(raising: bool = False, prog: str = PROG) -> argparse.ArgumentParser:
    """The trainer's parser; `raising=True`: a bad command line raises TrainArgsError (one line)
    instead of printing one line and exiting with code 2."""
    cls = _RaisingParser if raising else _Parser
    p = cls(prog=prog, description=_DESCRIPTION, epilog=_epilog(),
            argument_default=argparse.SUPPRESS)
    add_arguments(p)
    return p


def config_from_args(argv: list[str] | None = None, raising: bool = False,
                     prog: str = PROG) -> TrainConfig:
    """The TrainConfig the trainer runs for `argv`. Anything refused (an unknown flag, `--batch
    abc`, a value TrainConfig refuses, an unknown preset) is one line: on stderr with exit code 2,
    or TrainArgsError with `raising`."""
    p = parser(raising, prog)
    given = vars(p.parse_args(argv))
    kinds = {d.name: d.kind for d in declared(TrainConfig)}
    given = {k: tuple(v) if kinds[k] is tuple and isinstance(v, list) else v
             for k, v in given.items()}
    out = given.pop("out")
    try:
        return run_config(out, **given)
    except ValueError as e:  # TrainConfigError, RecipeError: the message names the flag
        p.error(str(e))


def trainer_argv(cfg: TrainConfig) -> list[str]:
    """The trainer command line that `config_from_args` turns back into exactly `cfg`. Every
    field is written out (`--flag=value`, so a value that starts with '-' stays a value), so a
    preset's defaults cannot drift in between."""
    argv = []
    for d in declared(TrainConfig):
        v = getattr(cfg, d.name)
        if d.kind is bool:
            argv.append(d.flag if v else "--no-" + d.flag[2:])
        elif d.option.repeat:
            argv += [f"{d.flag}={x}" for x in v]
        elif v is not None or d.option.none is not None:
            argv.append(f"{d.flag}={_text(d, v)}")
    back = config_from_args(argv, raising=True)
    if back != cfg:  # a declaration whose parse and fmt are not inverses
        diff = sorted(k for k, v in cfg.to_dict().items() if back.to_dict()[k] != v)
        raise ValueError(f"TrainConfig field(s) {diff} do not survive the command line: check "
                         "their option(parse=..., fmt=...) or none=")
    return argv
