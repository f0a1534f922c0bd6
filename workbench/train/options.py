"""How a trainer option is declared: `option(default, help, ...)` on a `TrainConfig` field.

The declaration carries what every consumer of the option needs, so none of them names a field:
the command line (`workbench.train.args`: flag, help, parse/format), the field checks in
`TrainConfig.__post_init__` (type, bounds, choices), the resume rules (`FREE`, `CHANGEABLE`) and
the launcher (which fields are paths). `declared(cls)` reads them back, in declaration order.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RESUME_RULES = ("fixed", "free", "changeable")
# "checkpoint" and "tokenizer": what workbench.source resolves (a folder, a hub id, a URL).
PATH_KINDS = ("read", "source", "write", "checkpoint", "tokenizer")
_KINDS = (bool, int, float, str, tuple)


class TrainConfigError(ValueError):
    """A TrainConfig value the trainer cannot run; the message names the field and its flag."""


@dataclass(frozen=True)
class Option:
    """What one TrainConfig field declares besides its type and default.

    `help`: the --help text. `flag`: the command-line flag (default: `--field-name`). `ge`, `gt`,
    `le`, `lt`: numeric bounds; `choices`: the allowed values (None stays allowed for an optional
    field). `none`: the command-line word that means None where the preset's value is not None
    (`--preset checkpoint`). `parse` / `fmt`: text -> value and value -> text where the type's
    own (int(), float(), str(), repr()) do not fit; they must be inverses. `repeat`: a tuple given
    as a repeated flag (`--data A --data B`). `path`: a local path the job reads (`read`), reads or
    fetches as `hf:NAME` (`source`), or writes (`write`), or a checkpoint or tokenizer that may
    also be a hub id or a URL (`checkpoint`, `tokenizer`: `workbench.source`): the launcher makes
    local paths absolute, pins hub ids to their commit, and checks at submit that what the job
    reads exists. `resume`: what a `--resume` may do with the
    field: `fixed` (must match the checkpoint's run), `free` (bookkeeping: where the run lives,
    how often it logs, its layout), `changeable` (allowed when named in --allow-config-change)."""

    help: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    none: str | None = None
    parse: Callable[[str], Any] | None = None
    fmt: Callable[[Any], str] | None = None
    repeat: bool = False
    path: str | None = None
    resume: str = "fixed"

    def __post_init__(self) -> None:
        if self.resume not in RESUME_RULES:
            raise ValueError(f"Option.resume {self.resume!r} is not one of {RESUME_RULES}")
        if self.path is not None and self.path not in PATH_KINDS:
            raise ValueError(f"Option.path {self.path!r} is not one of {PATH_KINDS}")
        if (self.parse is None) != (self.fmt is None):
            raise ValueError("Option: give parse and fmt together (each is the other's inverse)")


def option(default: Any, help: str, **kw: Any) -> Any:
    """A TrainConfig field: `default` (dataclasses.MISSING: required) and its `Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **kw)})


@dataclass(frozen=True)
class Declared:
    """One field as declared: its name, its kind (bool, int, float, str or tuple of str), whether
    None is allowed, its default (dataclasses.MISSING: required) and its Option."""

    name: str
    kind: type
    optional: bool
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return self.option.flag or "--" + self.name.replace("_", "-")

    def describe(self) -> str:
        """What a valid value is, in words, for error messages."""
        o = self.option
        if o.choices is not None:
            text = f"one of {o.choices}"
        elif self.kind is bool:
            text = "a bool"
        elif self.kind is tuple:
            text = "a tuple of non-empty strings"
        elif self.kind is str:
            text = "a string"
        else:
            noun = "an int" if self.kind is int else "a finite number"
            if self.kind is int and o.ge == 1 and o.le is None and o.lt is None:
                text = "a positive int"
            else:
                bounds = [f"{op} {v:g}" for op, v in ((">=", o.ge), (">", o.gt), ("<=", o.le),
                                                      ("<", o.lt)) if v is not None]
                text = " ".join([noun, " and ".join(bounds)]).strip()
        return text + (" or None" if self.optional else "")

    def check(self, v: Any) -> None:
        """TrainConfigError unless `v` is a valid value of this field (type, bounds, choices)."""
        if v is None and self.optional:
            return
        o = self.option
        if self.kind is bool:
            ok = isinstance(v, bool)
        elif self.kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif self.kind is float:
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
        elif self.kind is str:
            ok = isinstance(v, str)
        else:
            ok = isinstance(v, tuple) and all(isinstance(x, str) and x for x in v)
        if ok and self.kind in (int, float):
            ok = ((o.ge is None or v >= o.ge) and (o.gt is None or v > o.gt)
                  and (o.le is None or v <= o.le) and (o.lt is None or v < o.lt))
        if ok and o.choices is not None:
            ok = v in o.choices
        if not ok:
            raise TrainConfigError(f"TrainConfig.{self.name} must be {self.describe()} "
                                   f"({self.flag}), got {v!r}")


def _kind(annotation: Any, cls: type, name: str) -> tuple[type, bool]:
    """(kind, optional) of a field annotation: `int`, `str | None`, `tuple[str, ...]`..."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and \
        type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        annotation = rest[0] if len(rest) == 1 else annotation
    base = typing.get_origin(annotation) or annotation
    if base not in _KINDS or (base is tuple and typing.get_args(annotation) != (str, ...)):
        raise TypeError(f"{cls.__name__}.{name}: type {annotation!r} is not one the command line "
                        "carries (bool, int, float, str, tuple[str, ...], optionally | None)")
    return base, optional


def declared(cls: type) -> tuple[Declared, ...]:
    """Every field of `cls` (TrainConfig) as declared, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if not isinstance(opt, Option):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with option(...): every "
                            "trainer field carries its help, flag and resume rule")
        kind, optional = _kind(hints[f.name], cls, f.name)
        out.append(Declared(f.name, kind, optional, f.default, opt))
    return tuple(out)
