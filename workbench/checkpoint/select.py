"""Which expert weights a question is about: ``--layers 30``, ``--layers 0-3,40``,
``--experts 0-7``.

A `Selection` keeps a record when its layer is selected (all layers when ``layers`` is None) and,
when ``experts`` is given, when it is a routed expert of a selected index: asking for experts
leaves shared experts and dense MLPs out. The analysis reads only the selected records' bytes,
so a question about one layer of a remote checkpoint fetches one layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_INDEX = 1 << 20  # no model has a million layers or experts; a larger range is a typo


def parse_ranges(text: str | Iterable[int] | int, what: str = "layers") -> frozenset[int]:
    """``"0-3,40"`` -> {0, 1, 2, 3, 40}; ints and iterables of ints pass through checked."""
    if isinstance(text, bool):  # ValueError, as for "x": the CLI reports both as bad values
        raise ValueError(f"{what}: expected numbers, got {text!r}")  # noqa: TRY004
    if isinstance(text, int):
        items: list[int] = [text]
    elif isinstance(text, str):
        items = []
        for part in text.replace(" ", "").split(","):
            if not part:
                raise ValueError(f"{what} {text!r}: empty item (write e.g. 0-3,40)")
            lo, dash, hi = part.partition("-")
            try:
                a = int(lo)
                b = int(hi) if dash else a
            except ValueError:
                raise ValueError(f"{what} {text!r}: {part!r} is not N or N-M") from None
            if a < 0 or b < a:
                raise ValueError(f"{what} {text!r}: {part!r} is not an increasing range of "
                                 "indices >= 0")
            if b >= MAX_INDEX:
                raise ValueError(f"{what} {text!r}: {b} is past any model's {what}")
            items.extend(range(a, b + 1))
    else:
        items = list(text)
        for i in items:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < MAX_INDEX:
                raise ValueError(f"{what}: {i!r} is not an index >= 0")
    if not items:
        raise ValueError(f"{what}: the selection is empty")
    return frozenset(items)


def _ranges(ix: frozenset[int]) -> str:
    out, run = [], []
    for i in sorted(ix):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class Selection:
    """Layers and routed experts a question covers (None: all)."""

    layers: frozenset[int] | None = None
    experts: frozenset[int] | None = None

    @classmethod
    def of(cls, layers=None, experts=None) -> Selection:
        """From CLI strings (``"0-3,40"``), ints or iterables of ints; None means all."""
        return cls(None if layers is None else parse_ranges(layers, "layers"),
                   None if experts is None else parse_ranges(experts, "experts"))

    @property
    def everything(self) -> bool:
        return self.layers is None and self.experts is None

    def keeps(self, rec) -> bool:
        if self.layers is not None and rec.layer not in self.layers:
            return False
        return self.experts is None or (rec.kind == "routed" and rec.expert in self.experts)

    def filter(self, records: Iterable) -> list:
        return [r for r in records if self.keeps(r)]

    def check(self, records: list, where: str) -> None:
        """Raise ValueError naming what does not exist when the selection keeps nothing of
        ``records`` (a typo must not give an empty table)."""
        if self.everything or any(self.keeps(r) for r in records):
            return
        layers = sorted({r.layer for r in records})
        experts = sorted({r.expert for r in records if r.kind == "routed"})
        have = f"layers {_ranges(frozenset(layers))}" if layers else "no layers"
        if experts:
            have += f", routed experts {_ranges(frozenset(experts))}"
        raise ValueError(f"{where}: {self} selects no expert weight ({have})")

    def __str__(self) -> str:
        if self.everything:
            return "all layers and experts"
        parts = []
        if self.layers is not None:
            parts.append(f"layers {_ranges(self.layers)}")
        if self.experts is not None:
            parts.append(f"routed experts {_ranges(self.experts)}")
        return ", ".join(parts)


ALL = Selection()


def as_selection(select) -> Selection:
    """None -> everything; a Selection as is."""
    if select is None:
        return ALL
    if not isinstance(select, Selection):
        raise TypeError(f"select must be a Selection (Selection.of(layers=..., experts=...)), "
                        f"got {type(select).__name__}")
    return select
