"""Two checkpoints of one architecture, expert by expert: did A help, and where?

``compare(a, b, reference)`` measures each side's error against a BF16 reference, per expert
weight (layer x expert x projection), and their difference:

- a side is a checkpoint folder (any layout ``open_checkpoint`` reads, packed or BF16), an open
  ``Checkpoint``, or ``"ptq:RECIPE"``: post-training quantization of the reference with that
  recipe (``ptq:mxfp4``, ``ptq:nvfp4:te``), made on the fly;
- ``"ptq:RECIPE@PATH"`` quantizes PATH instead and measures it against PATH itself
  (quantization error only), so two runs' BF16 exports can be compared as if each were shipped
  with RECIPE: ``compare("ptq:mxfp4@qat/export", "ptq:mxfp4@bf16/export")``.

The result's ``table`` has one row per weight: ``a_<m>`` / ``b_<m>`` for the error metrics,
``delta`` = A - B of ``metric``, ``change_pct`` = 100 * delta / B, and ``verdict``: improved
when A has more than ``tol_pct`` percent less error than B (``change_pct < -tol_pct``), worse
when more than ``tol_pct`` percent more (``change_pct > tol_pct``), same otherwise: a change of
exactly ``tol_pct`` percent is within the tolerance, and at ``tol_pct=0`` any difference counts
while equal errors stay "same". A weight whose values hold NaN/Inf on either side (counted in
``a_nonfinite`` / ``b_nonfinite``), or whose error is NaN, has no change to judge: its verdict
is non-finite, never same. Lower is better for the metrics offered (``rel_err``,
``max_abs_err``); ``sqnr_gain_db`` = A - B in dB (higher: A better).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench._io import atomic_write_text
from workbench.checkpoint import Checkpoint, open_checkpoint
from workbench.checkpoint.grid import stored_grid
from workbench.formats import dequantize, parse_recipe, quantize

from .metrics import error_metrics, scale_exponents
from .session import Session
from .tables import (
    ErrorTables,
    ExpertDetail,
    _pd,
    _stored_label,
    candidate_errors,
    reference_errors,
)

KEYS = ["kind", "layer", "expert", "proj"]
SIDE_METRICS = ("rel_err", "sqnr_db", "max_abs_err", "clip_frac", "nonfinite")
VERDICTS = ("improved", "same", "worse", "non-finite")
COMPARE_METRICS = ("rel_err", "max_abs_err")
# config.json fields that fix the expert grid; a mismatch in any is a different architecture
ARCH_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
               "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
               "n_shared_experts", "num_experts_per_tok")


class CompareError(ValueError):
    """The two sides cannot be compared (architecture, missing reference, bad side spec); the
    message is one line naming what differs."""


@dataclass(frozen=True)
class Side:
    """One side of a comparison: what is measured, and against which reference."""

    label: str
    checkpoint: object | None  # the Checkpoint measured (None for a ptq side)
    recipe: str | None  # ptq sides: the recipe applied to the reference
    reference: object  # the BF16 Checkpoint this side's error is measured against


def _name(path: Path) -> str:
    # trainer exports are all called "export": the run folder says which
    return f"{path.parent.name}/{path.name}" if path.name == "export" else path.name


def _open(ck):
    return ck if isinstance(ck, Checkpoint) else open_checkpoint(ck)


def resolve_side(spec, reference, which: str) -> Side:
    """A side from a path / Checkpoint / ``ptq:RECIPE[@PATH]`` and the shared reference."""
    if isinstance(spec, (str, os.PathLike)) and str(spec).startswith("ptq:"):
        body = str(spec)[len("ptq:"):]
        recipe, _, own = body.partition("@")
        try:
            r = str(parse_recipe(recipe))
        except (ValueError, KeyError) as e:
            raise CompareError(f"{which} = {spec!r}: {e}") from None
        ref = _open(own) if own else reference
        if ref is None:
            raise CompareError(f"{which} = {spec!r} quantizes the reference: pass --reference "
                               f"BF16 (or write ptq:{recipe}@PATH)")
        return Side(f"ptq {r} of {_name(ref.path)}", None, r, ref)
    ck = _open(spec)
    if reference is None:
        raise CompareError(f"{which} = {ck.path} needs a BF16 reference to measure its error "
                           "against: pass --reference BF16")
    return Side(_name(ck.path), ck, None, reference)


def architecture(ck) -> tuple[dict, dict]:
    """(config fields of ARCH_FIELDS present in config.json, {(kind, layer, expert, proj):
    logical [out, in]} of every expert weight)."""
    cfg = ck.config if isinstance(ck.config, dict) else {}
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    fields = {k: text[k] for k in ARCH_FIELDS if k in text}
    recs = {(r.kind, r.layer, r.expert, r.proj): tuple(r.shape) for r in ck.expert_records()}
    return fields, recs


def check_same_architecture(named: list[tuple[str, object]]) -> None:
    """Raise CompareError naming the first difference between the checkpoints' architectures."""
    first_name, first = named[0]
    fa, ra = architecture(first)
    for name, ck in named[1:]:
        if ck is first:
            continue
        fb, rb = architecture(ck)
        for k in ARCH_FIELDS:
            if k in fa and k in fb and fa[k] != fb[k]:
                raise CompareError(f"architecture mismatch: {k} is {fa[k]!r} in {first_name} "
                                   f"({first.path}) but {fb[k]!r} in {name} ({ck.path})")
        only_a, only_b = sorted(set(ra) - set(rb)), sorted(set(rb) - set(ra))
        if only_a or only_b:
            k, where = (only_a[0], name) if only_a else (only_b[0], first_name)
            raise CompareError(
                f"architecture mismatch: {first_name} has {len(ra)} expert weights, {name} "
                f"{len(rb)}; {where} lacks {k[0]} layer {k[1]} expert {k[2]} {k[3]}_proj "
                f"({first.path} vs {ck.path})")
        for k in ra:
            if ra[k] != rb[k]:
                raise CompareError(
                    f"architecture mismatch: {k[0]} layer {k[1]} expert {k[2]} {k[3]}_proj is "
                    f"{list(ra[k])} in {first_name} but {list(rb[k])} in {name}")


def side_errors(side: Side, *, kinds, device, progress, select=None,
                session=None) -> ErrorTables:
    if side.recipe is not None:
        return candidate_errors(side.reference, [side.recipe], kinds=kinds, device=device,
                                progress=progress, select=select, session=session)
    return reference_errors(side.checkpoint, side.reference, kinds=kinds, device=device,
                            progress=progress, select=select, session=session)


@dataclass
class CompareResult:
    a_label: str
    b_label: str
    metric: str
    tol_pct: float
    table: object  # pandas.DataFrame, one row per expert weight (see the module docstring)
    a: ErrorTables
    b: ErrorTables
    # what was measured: "A", "B" (each side's checkpoint, or for ptq the one it quantizes)
    # and "reference", for the report's source lines
    checkpoints: dict = field(default_factory=dict, repr=False)
    notes: list = field(default_factory=list, repr=False)  # lines the summary starts with

    @property
    def identical(self) -> bool:
        """A and B have exactly the same error on every weight (e.g. the same grid)."""
        return bool(len(self.table)) and bool((self.table["delta"] == 0).all())

    def exact(self, side: str) -> bool:
        """``side`` ("a" or "b") reproduces its reference exactly on every weight."""
        return bool(len(self.table)) and bool((self.table[f"{side}_{self.metric}"] == 0).all())

    def counts(self, kind: str | None = "routed") -> dict[str, int]:
        t = self.table if kind is None else self.table[self.table.kind == kind]
        return {v: int((t.verdict == v).sum()) for v in VERDICTS}

    def summary(self, worst: int = 5) -> str:
        t, m = self.table, self.metric
        lines = [*self.notes, f"A = {self.a_label}", f"B = {self.b_label}",
                 f"metric: {m} against each side's BF16 reference; verdicts at {self.tol_pct:g}%"]
        if t.empty:
            return "\n".join(lines + ["no expert weights to compare"])
        for side, label in (("a", "A"), ("b", "B")):
            if self.exact(side):
                lines.append(f"{label} reproduces its reference exactly ({m} 0 on all "
                             f"{len(t)} weights)")
        if self.identical:
            lines.append(f"A and B have the same {m} on all {len(t)} weights: nothing differs, "
                         "no difference plots drawn")
            return "\n".join(lines)
        for kind, g in t.groupby("kind", sort=False):
            c = {v: int((g.verdict == v).sum()) for v in VERDICTS}
            fin = g[g.verdict != "non-finite"]  # means over the weights both sides hold finite
            mean_a, mean_b = float(fin[f"a_{m}"].mean()), float(fin[f"b_{m}"].mean())
            rel = 100 * (mean_a - mean_b) / mean_b if mean_b else math.nan
            bad = f", NON-FINITE {c['non-finite']} (left out of the means)" \
                if c["non-finite"] else ""
            lines.append(f"{kind:6s} {len(g):5d} weights: mean {m} A {mean_a:.4g} vs B "
                         f"{mean_b:.4g} ({rel:+.2f}%); improved {c['improved']}, same "
                         f"{c['same']}, worse {c['worse']}{bad}")
        nonfinite = t[t.verdict == "non-finite"]
        if len(nonfinite):
            lines.append("non-finite weights (NaN/Inf in A or B: no change to judge):")
            lines += [f"  {'' if r.kind == 'routed' else r.kind + ' '}layer {r.layer:3d} expert "
                      f"{r.expert:4d} {r.proj:4s} A {_nonfinite_of(r, 'a')}, B "
                      f"{_nonfinite_of(r, 'b')}" for r in nonfinite.head(20).itertuples()]
            if len(nonfinite) > 20:
                lines.append(f"  and {len(nonfinite) - 20} more (compare.csv lists them)")
        routed = t[t.kind == "routed"]
        fin = routed[routed.change_pct.map(math.isfinite)]
        for title, part in (("most improved", fin.nsmallest(worst, "change_pct")),
                            ("most worsened", fin.nlargest(worst, "change_pct"))):
            part = part[part.change_pct < 0] if title == "most improved" else \
                part[part.change_pct > 0]
            if len(part):
                lines.append(f"{title} routed experts (change of {m}, A vs B):")
                lines += [f"  layer {r.layer:3d} expert {r.expert:4d} {r.proj:4s} "
                          f"{getattr(r, 'a_' + m):.4g} vs {getattr(r, 'b_' + m):.4g} "
                          f"({r.change_pct:+.2f}%)" for r in part.itertuples()]
        return "\n".join(lines)

    def save(self, folder: str | os.PathLike) -> Path:
        """``compare.csv`` (the per-weight table) and ``summary.txt``, written atomically."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        for name, text in (("compare.csv", self.table.to_csv(index=False)),
                           ("summary.txt", self.summary() + "\n")):
            atomic_write_text(out / name, text)
        return out

    def __repr__(self) -> str:
        c = self.counts(None)
        state = "identical" if self.identical else \
            f"improved {c['improved']}, same {c['same']}, worse {c['worse']}" + \
            (f", non-finite {c['non-finite']}" if c["non-finite"] else "")
        return (f"CompareResult(A={self.a_label!r}, B={self.b_label!r}, {self.metric}, "
                f"{len(self.table)} weights: {state})")


def compare(a, b, reference=None, *, metric: str = "rel_err", tol_pct: float = 1.0,
            kinds=("routed", "shared", "dense"), device: str | None = None,
            progress: bool = True, select=None) -> CompareResult:
    """Compare A and B expert by expert against ``reference`` (see the module docstring),
    over the layers / experts ``select`` keeps (a ``Selection``; None: all)."""
    if metric not in COMPARE_METRICS:
        raise CompareError(f"metric must be one of {COMPARE_METRICS}, got {metric!r}")
    if not (isinstance(tol_pct, (int, float)) and math.isfinite(tol_pct) and tol_pct >= 0):
        raise CompareError(f"tol_pct must be a finite number >= 0, got {tol_pct!r}")
    ref = _open(reference) if reference is not None else None
    sa, sb = resolve_side(a, ref, "A"), resolve_side(b, ref, "B")
    named = [(f"A ({sa.label})", sa.checkpoint or sa.reference),
             (f"B ({sb.label})", sb.checkpoint or sb.reference),
             ("A's reference", sa.reference), ("B's reference", sb.reference)]
    check_same_architecture(named)
    session = Session()  # B's side finds the graphs A's compiled
    ta = side_errors(sa, kinds=kinds, device=device, progress=progress, select=select,
                     session=session)
    tb = side_errors(sb, kinds=kinds, device=device, progress=progress, select=select,
                     session=session)
    sides = {"A": sa.checkpoint or sa.reference, "B": sb.checkpoint or sb.reference}
    if ref is not None:
        sides["reference"] = ref
    return CompareResult(sa.label, sb.label, metric, float(tol_pct),
                         combine(ta.experts, tb.experts, metric, tol_pct), ta, tb, sides)


def combine(a, b, metric: str = "rel_err", tol_pct: float = 1.0):
    """The per-weight comparison table from two ``ErrorTables.experts`` frames."""
    pd = _pd()
    cols = [c for c in SIDE_METRICS if c in a.columns and c in b.columns]
    left = a[KEYS + cols].rename(columns={c: f"a_{c}" for c in cols})
    right = b[KEYS + cols].rename(columns={c: f"b_{c}" for c in cols})
    t = left.merge(right, on=KEYS, how="inner", validate="one_to_one")
    va, vb = t[f"a_{metric}"].astype(float), t[f"b_{metric}"].astype(float)
    t["delta"] = va - vb
    t["change_pct"] = [100 * d / y if y else (0.0 if d == 0 else math.copysign(math.inf, d))
                       for d, y in zip(t["delta"], vb)]
    if "a_sqnr_db" in t and "b_sqnr_db" in t:
        # inf - inf (both exact) is no gain
        t["sqnr_gain_db"] = [0.0 if x == y else x - y for x, y in zip(t.a_sqnr_db, t.b_sqnr_db)]
    bad = va.isna() | vb.isna()
    for side in ("a", "b"):
        if f"{side}_nonfinite" in t:
            bad |= t[f"{side}_nonfinite"] > 0
    # strict: a change of exactly tol_pct is "same", so tol_pct=0 never calls equal errors better
    t["verdict"] = ["non-finite" if b else
                    ("improved" if c < -tol_pct else ("worse" if c > tol_pct else "same"))
                    for c, b in zip(t["change_pct"], bad)]
    order = {"routed": 0, "shared": 1, "dense": 2}
    t = t.sort_values(["kind", "layer", "expert", "proj"], key=lambda s: s.map(order)
                      if s.name == "kind" else s, kind="stable").reset_index(drop=True)
    return pd.DataFrame(t)


def _nonfinite_of(r, side: str) -> str:
    n = getattr(r, f"{side}_nonfinite", None)
    if n is not None and n > 0:
        return f"{int(n)} NaN/Inf value{'s' if n != 1 else ''}"
    return "finite" if math.isfinite(getattr(r, f"{side}_rel_err")) else "NaN error"


def reference_detail(ck, reference, layer: int, expert: int, proj: str, *,
                     recipe: str | None = None, kind: str = "routed") -> ExpertDetail:
    """One expert weight against the BF16 ``reference``: ``ck``'s stored weights (recipe None),
    or the reference quantized with ``recipe`` (post-training quantization)."""

    w = reference.view_of(reference.record(layer, expert, proj, kind)).materialize()
    if recipe is None:
        rec = ck.record(layer, expert, proj, kind)
        deq, q = ck.view_of(rec).materialize(), stored_grid(ck, rec)
        if deq.shape != w.shape:
            raise CompareError(f"{rec.key}: shape {tuple(deq.shape)} in {ck.path} but "
                               f"{tuple(w.shape)} in the reference {reference.path}")
        label = f"{_stored_label(ck, rec)} vs reference"
    else:
        r = parse_recipe(recipe)
        q = quantize(w, r, pad=True)
        deq, label = dequantize(q, torch.float32), f"{r} on reference"
    exps = scale_exponents(q) if q is not None else torch.zeros(0, dtype=torch.int32)
    return ExpertDetail(f"L{layer} E{expert} {proj}", label, w, deq, exps,
                        error_metrics(w, deq, q))
