"""QuantScope: which weights are quantized, in which format, and why.

One policy object shared by analysis, QAT and export so they can never disagree. It is purely
name-based (plus an optional shape per name), so the same object answers for checkpoint tensor
names and for model parameter names.

Matching rules
--------------
A weight name is split into `module.param` at the last dot. Only weight matrices are candidates
(`param` is `weight`, `weight{k}` as in TE GroupedLinear, or a fused/stacked expert parameter
`gate_up_proj`, `down_proj`, `w1`, `w2`, `w3`, `w13`); biases, norms and scalars are never
quantized. Targets follow compressed-tensors (`compressed_tensors.utils.match.is_match`):
  * `re:PATTERN` -> `re.match(PATTERN, module)`: anchored at the start only, not at the end;
  * otherwise the exact module name, or a class name.
A checkpoint stores no classes, so the class is *inferred*: a 2-D `weight`/`weight{k}` whose
module is not an embedding (`embed_tokens`, `wte`, `word_embeddings`, ...) is a `Linear`; the
same holds for a name without a known shape unless its module looks like a norm or embedding.
A 3-D fused expert tensor is not a `Linear` (compressed-tensors would not quantize it either).
Ignore entries use the style of the config they come from: compressed-tensors rules ("ct"),
transformers' `modules_to_not_convert` rule ("hf": regex or prefix up to a module boundary, or a
suffix) or ModelOpt's `exclude_modules` shell globs ("glob"). A weight is quantized when some
target matches and no ignore entry does; an empty include list matches nothing.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

EMBEDDING_LEAVES = ("embed_tokens", "wte", "wpe", "word_embeddings", "embeddings", "embed",
                    "tok_embeddings", "embedding", "embed_in", "position_embeddings")
FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "w1", "w2", "w3", "w13")
_WEIGHT_K = re.compile(r"weight\d*")


def split_name(name: str) -> tuple[str, str]:
    module, _, param = name.rpartition(".")
    return module, param


def is_weight_param(param: str) -> bool:
    return bool(_WEIGHT_K.fullmatch(param)) or param in FUSED_EXPERT_PARAMS


def infer_class(name: str, shape: Sequence[int] | None = None) -> str | None:
    """The module class a checkpoint name stands for, as far as names and shapes tell."""
    module, param = split_name(name)
    leaf = module.rpartition(".")[2]
    if leaf in EMBEDDING_LEAVES:
        return "Embedding"
    if not _WEIGHT_K.fullmatch(param):
        return None
    if shape is not None:
        return "Linear" if len(shape) == 2 else None
    return None if "norm" in leaf else "Linear"


@dataclass(frozen=True)
class Pattern:
    text: str
    style: str = "ct"  # "ct" | "hf" | "glob"
    _rx: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.style not in ("ct", "hf", "glob"):
            raise ValueError(f"pattern style must be ct, hf or glob, got {self.style!r}")
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"pattern must be a non-empty string, got {self.text!r}")
        t, rx = self.text, None
        if self.style == "ct" and t.startswith("re:"):
            rx = re.compile(t[3:])
        elif self.style == "hf":  # transformers.quantizers.quantizers_utils.should_convert_module
            rx = re.compile(rf"(?:{t})(?:(?<=\.)|(?=\.|$))")
        elif self.style == "glob":
            rx = re.compile(fnmatch.translate(t))
        object.__setattr__(self, "_rx", rx)  # compiled once: checkpoints have ~10^5 names

    def matches(self, module: str, cls: str | None) -> bool:
        t, rx = self.text, self._rx
        if self.style == "ct":
            if rx is not None:
                return rx.match(module) is not None
            return t == module or (cls is not None and t == cls)
        if self.style == "hf":
            return rx.match(module) is not None or module.endswith(t)
        return rx.match(module) is not None  # fnmatch.fnmatchcase


@dataclass(frozen=True)
class Rule:
    """Targets that select weights, and the format (a Recipe or format string) they get."""

    name: str
    targets: tuple[Pattern, ...]
    recipe: Any

    def __post_init__(self):
        if not isinstance(self.targets, tuple):
            raise TypeError("Rule.targets must be a tuple of Pattern")


@dataclass(frozen=True)
class Decision:
    name: str
    quantized: bool
    recipe: Any
    reason: str
    rule: str | None = None
    target: str | None = None
    ignored_by: str | None = None


class QuantScope:
    """See the module docstring. Build with `from_config`, `from_patterns` or `preset`."""

    def __init__(self, rules: Sequence[Rule], ignore: Sequence[Pattern] = (), *,
                 label: str = "custom", names: Mapping[str, Sequence[int] | None] | None = None,
                 stored: Mapping[str, Any] | None = None):
        self.rules = tuple(rules)
        self.ignore = tuple(ignore)
        self.label = label
        # stored: name -> recipe for checkpoints whose config lists no targets (DeepSeek fp8):
        # there the tensors on disk are the metadata.
        self._stored = dict(stored) if stored is not None else None
        self._shapes: dict[str, tuple[int, ...] | None] = {}
        self._cache: dict[str, Decision] = {}
        if names is not None:
            self.add_names(names)

    @property
    def stored(self) -> dict[str, Any] | None:
        """name -> recipe when decisions come from stored companions, not patterns."""
        return None if self._stored is None else dict(self._stored)

    # -- construction -----------------------------------------------------------------------
    def add_names(self, names: Mapping[str, Sequence[int] | None] | Iterable[str]) -> None:
        items = names.items() if isinstance(names, Mapping) else ((n, None) for n in names)
        for n, s in items:
            self._shapes[n] = tuple(s) if s is not None else None
            self._cache.pop(n, None)

    @classmethod
    def from_patterns(cls, include: Iterable[str], ignore: Iterable[str] = (), recipe: Any = None,
                      *, label: str = "custom", names=None) -> QuantScope:
        rule = Rule(label, tuple(Pattern(p) for p in include), recipe)
        return cls([rule], [Pattern(p) for p in ignore], label=label, names=names)

    @classmethod
    def from_config(cls, qcfg, names=None, *, stored: Mapping[str, Any] | None = None
                    ) -> QuantScope:
        """From a `workbench.checkpoint.config.QuantConfig` (duck-typed: no import cycle)."""
        rules = [Rule(g.name, tuple(Pattern(t) for t in g.targets), g.codec)
                 for g in qcfg.groups if g.codec is not None]
        ignore = [Pattern(p, qcfg.pattern_style) for p in qcfg.ignore]
        label = f"{qcfg.method}:{qcfg.format}" if qcfg.format else qcfg.method
        return cls(rules, ignore, label=label, names=names, stored=stored)

    @classmethod
    def preset(cls, name: str, recipe: Any = "mxfp4", *, names=None) -> QuantScope:
        """QAT presets: "routed-experts" or "all-linear" (see `PRESETS`)."""
        try:
            include, ignore = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown scope preset {name!r}; choose from {sorted(PRESETS)}"
                             ) from None
        return cls.from_patterns(include, ignore, recipe, label=name, names=names)

    # -- queries ----------------------------------------------------------------------------
    def decide(self, name: str, shape: Sequence[int] | None = None) -> Decision:
        if shape is None and name in self._cache:
            return self._cache[name]
        d = self._decide(name, tuple(shape) if shape is not None else self._shapes.get(name))
        if shape is None:
            self._cache[name] = d
        return d

    def _decide(self, name: str, shape: tuple[int, ...] | None) -> Decision:
        module, param = split_name(name)
        if not is_weight_param(param):
            return Decision(name, False, None, f"{param!r} is not a weight matrix")
        if shape is not None and len(shape) < 2:
            return Decision(name, False, None, f"{len(shape)}-D tensor, not a weight matrix")
        if self._stored is not None:
            if name in self._stored:
                return Decision(name, True, self._stored[name],
                                "stored quantized (scale companion on disk)", "stored")
            return Decision(name, False, None, "stored unquantized (no scale companion on disk)")
        if not self.rules and self.label == "dense":
            return Decision(name, False, None, "no quantization_config: stored dense")
        if not any(r.targets for r in self.rules):
            return Decision(name, False, None, f"scope {self.label!r} has an empty include list:"
                            " it matches nothing")
        cls = infer_class(name, shape)
        for rule in self.rules:
            hit = next((t for t in rule.targets if t.matches(module, cls)), None)
            if hit is None:
                continue
            ign = next((p for p in self.ignore if p.matches(module, cls)), None)
            if ign is not None:
                return Decision(name, False, None, f"target {hit.text!r} of {rule.name!r} "
                                f"matched, but ignore entry {ign.text!r} matched too",
                                rule.name, hit.text, ign.text)
            how = "class" if hit.text == cls and hit.text != module else "name"
            return Decision(name, True, rule.recipe, f"target {hit.text!r} ({how}) of "
                            f"{rule.name!r} matched {module!r}", rule.name, hit.text)
        ign = next((p for p in self.ignore if p.matches(module, cls)), None)
        return Decision(name, False, None, f"no target matched module {module!r}"
                        + (f" (inferred class {cls})" if cls else "")
                        + (f"; ignore entry {ign.text!r} matches it too" if ign else ""),
                        ignored_by=ign.text if ign else None)

    def is_quantized(self, name: str) -> bool:
        return self.decide(name).quantized

    def reason(self, name: str) -> str:
        return self.decide(name).reason

    def recipe(self, name: str) -> Any:
        return self.decide(name).recipe

    def names(self) -> list[str]:
        return list(self._shapes)

    def report(self, names: Iterable[str] | None = None) -> list[dict]:
        """One row per name: name, quantized, recipe, rule, target, ignored_by, reason."""
        rows = []
        for n in (names if names is not None else self._shapes):
            d = self.decide(n)
            rows.append({"name": n, "quantized": d.quantized, "recipe": _fmt(d.recipe),
                         "rule": d.rule, "target": d.target, "ignored_by": d.ignored_by,
                         "reason": d.reason})
        return rows

    def summary(self, names: Iterable[str] | None = None, *, max_rows: int = 20) -> str:
        rows = self.report(names)
        q = [r for r in rows if r["quantized"]]
        lines = [f"QuantScope {self.label!r}: {len(q)} of {len(rows)} tensors quantized"]
        by = {}
        for r in rows:
            if r["quantized"]:
                why = f"target {r['target']!r}" if r["target"] else r["reason"]
            elif r["ignored_by"]:
                why = f"ignore {r['ignored_by']!r}"
            else:
                why = "no target" if r["reason"].startswith("no target") else r["reason"]
            by.setdefault((r["quantized"], r["recipe"], why), []).append(r["name"])
        for (isq, rec, why), ns in sorted(by.items(), key=lambda kv: -len(kv[1])):
            state = f"quantized {rec}" if isq else "kept"
            lines.append(f"  {len(ns):6d}  {state:20s} {why}  (e.g. {ns[0]})")
        if len(rows) <= max_rows:
            lines += [f"    {r['name']}: {r['reason']}" for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"QuantScope({self.label!r}, rules={[r.name for r in self.rules]}, "
                f"ignore={[p.text for p in self.ignore]})")


def _fmt(recipe: Any) -> str | None:
    if recipe is None or isinstance(recipe, str):
        return recipe
    fmt, prof = getattr(recipe, "fmt", None), getattr(recipe, "profile", None)
    return f"{fmt}:{prof}" if prof else str(fmt or recipe)


_ROUTED = [
    r"re:.*\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$",  # HF per-expert Linear
    r"re:.*\.experts$",  # fused / stacked expert parameters (gpt-oss, grouped models)
    r"re:.*\.experts\.(linear_fc1|linear_fc2|fc1|fc2)$",  # TE GroupedLinear weight{k}, Hy3
    r"re:.*\.experts\.local_experts\.\d+\.(linear_fc1|linear_fc2)$",  # Megatron SequentialMLP
]
PRESETS: dict[str, tuple[list[str], list[str]]] = {
    "routed-experts": (_ROUTED, []),
    # every Linear and every routed-expert weight, except the usual full-precision holdouts
    "all-linear": (["Linear", *_ROUTED],
                   [r"re:(.*\.)?lm_head$", r"re:(.*\.)?(embed_tokens|wte|word_embeddings)$",
                    r"re:.*norm[^.]*$", r"re:.*\.(gate|router)$", r"re:.*\.router\.",
                    "Embedding"]),
}
