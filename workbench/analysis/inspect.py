"""``workbench inspect``: the question a checkpoint invites, answered as tables, figures and a summary.

- BF16/dense checkpoint: what would each candidate recipe cost? (question 1)
- packed checkpoint with ``reference``: how far is it from the BF16 reference? (question 2), and,
  when recipes are given, what those recipes would cost on the reference (question 1 on it).
- packed checkpoint alone: does its stored grid match re-quantizing with each recipe? (question 3)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench._io import atomic_open, atomic_write_text
from workbench.formats import parse_recipe

from .metrics import nonfinite_rows
from .session import Session
from .tables import ErrorTables, candidate_errors, reference_errors, stored_vs_recipes

DENSE_DEFAULT = ("mxfp4:rceil", "mxfp4:floor", "nvfp4:torchao")
STORED_DEFAULT = {"mxfp4": ("mxfp4:rceil", "mxfp4:floor", "mxfp4:even"),
                  "nvfp4": ("nvfp4:torchao", "nvfp4:te", "nvfp4:compressed-tensors"),
                  "mxfp8_e4m3": ("mxfp8_e4m3:rceil", "mxfp8_e4m3:floor")}


@dataclass
class InspectResult:
    question: str
    tables: ErrorTables
    summary: str
    figures: dict = field(default_factory=dict)  # file stem -> Figure

    def __repr__(self) -> str:
        # the dataclass repr would print both tables and the summary
        df = self.tables.experts
        parts = [f"{self.question!r}", f"{len(df)} rows"]
        if not df.empty:
            means = df[df.kind == "routed"].groupby("recipe")["rel_err"].mean()
            parts.append("mean routed rel_err " + ", ".join(f"{r} {v:.4g}" for r, v in means.items()))
            n_bad = len(nonfinite_weights(df))
            if n_bad:
                parts.append(f"{n_bad} weights with NaN/Inf values")
        parts.append(f"{len(self.figures)} figures")
        return f"InspectResult({', '.join(parts)})"


class InspectArgError(ValueError):
    """A `workbench inspect` argument that cannot work; raised before any checkpoint is read."""


def check_args(recipes, device: str | None, out) -> tuple[list[str] | None, str | None, Path]:
    """Validate the CLI's recipes, device and output folder *before* the analysis runs, so a
    typo costs nothing: (recipes, device, out). The output folder is created and a probe file
    written in it (an existing file, a read-only folder or a path under a file fails here)."""
    for r in recipes or ():
        try:
            parse_recipe(r)
        except ValueError as e:
            raise InspectArgError(f"--recipe {r!r}: {e}") from None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, ValueError) as e:
            raise InspectArgError(f"--device {device!r} is not a device ({e}); use cpu, cuda "
                                  "or cuda:N") from None
        if dev.type not in ("cpu", "cuda"):
            raise InspectArgError(f"--device {device!r}: only cpu and cuda are supported")
        if dev.type == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n == 0:
                raise InspectArgError(f"--device {device!r}: CUDA is not available here")
            if dev.index is not None and dev.index >= n:
                raise InspectArgError(f"--device {device!r}: only {n} CUDA device(s) here")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InspectArgError(f"--out {str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise InspectArgError(f"--out {str(out)!r} is not a writable folder: "
                              f"{e.strerror or e}") from None
    return (list(recipes) if recipes else None), device, out


def _stored_formats(ck) -> list[str]:
    fmts = []
    for r in ck.expert_records():
        rec = ck.recipe_of(r.name)
        f = getattr(rec, "fmt", None)
        if f and f not in fmts:
            fmts.append(f)
    return fmts


def inspect_checkpoint(ck, recipes=None, reference=None, *, progress: bool = True,
                       device: str | None = None, select=None,
                       session: Session | None = None) -> InspectResult:
    """The question ``ck`` invites (see the module docstring), over the layers / experts
    ``select`` keeps (a ``Selection``; None: all). ``session``: what compiled graphs this
    process already has (hold one across calls, e.g. in a notebook); one per call by default."""
    import pandas as pd

    kw = {"progress": progress, "device": device, "select": select,
          "session": Session() if session is None else session}
    fmts = _stored_formats(ck)
    if reference is not None:
        t = reference_errors(ck, reference, **kw)
        question = "stored weights vs BF16 reference"
        if recipes:
            c = candidate_errors(reference, recipes, **kw)
            t = ErrorTables(pd.concat([t.experts, c.experts], ignore_index=True),
                            pd.concat([t.scales, c.scales], ignore_index=True))
            question += " (and candidate recipes on the reference)"
    elif fmts:
        recipes = list(recipes or [r for f in fmts for r in STORED_DEFAULT.get(f, ())])
        t = stored_vs_recipes(ck, recipes, **kw)
        question = f"stored {'/'.join(fmts)} grid vs re-quantizing with {', '.join(recipes)}"
    else:
        recipes = list(recipes or DENSE_DEFAULT)
        t = candidate_errors(ck, recipes, **kw)
        question = f"candidate recipes {', '.join(recipes)} on BF16 weights"
    return InspectResult(question, t, summarize(t.experts, question, ck.path))


def nonfinite_weights(df):
    """One row per weight (kind, layer, expert, proj) holding NaN/Inf values, with ``nonfinite``
    (how many; empty without the column, e.g. a table saved by an older workbench)."""
    if "nonfinite" not in df or df.empty:
        return df.iloc[0:0]
    bad = df[df.nonfinite > 0]
    return bad.drop_duplicates(["kind", "layer", "expert", "proj"]).sort_values(
        ["kind", "layer", "expert", "proj"], kind="stable")


def _weight_name(r) -> str:
    kind = "" if r.kind == "routed" else f"{r.kind} "
    return f"{kind}layer {r.layer} expert {r.expert} {r.proj}"


def nonfinite_line(df, limit: int = 8) -> str | None:
    """One line naming the weights that hold NaN/Inf values (None when there are none): the
    summary's warning, and what `workbench inspect` prints on stderr."""
    w = nonfinite_weights(df)
    if w.empty:
        return None
    names = [f"{_weight_name(r)} ({r.nonfinite} value{'s' if r.nonfinite != 1 else ''})"
             for r in w.head(limit).itertuples()]
    more = f", and {len(w) - limit} more" if len(w) > limit else ""
    return (f"{len(w)} expert weights hold non-finite values (NaN/Inf, as stored or decoded): "
            f"{', '.join(names)}{more}; their rows have NaN metrics and are left out of the "
            "means and ranks")


def summarize(df, question: str, path, worst: int = 5) -> str:
    lines = [f"workbench inspect {path}", f"question: {question}"]
    if df.empty:
        return "\n".join(lines + ["no quantizable expert weights found"])
    warn = nonfinite_line(df)
    if warn:
        lines.append(f"WARNING: {warn}")
    cols = [c for c in ("rel_err", "sqnr_db", "max_abs_err", "clip_frac", "zero_frac",
                        "scale_mismatch_frac", "code_mismatch_frac") if c in df]
    # rows whose sums met a NaN/Inf would make every mean NaN (or vanish from it unsaid)
    bad = nonfinite_rows(df)
    finite = df[~bad]
    # recipes that reproduce their grid exactly get one line below, not a row of zeros
    exact = {r for r, g in df[df.kind == "routed"].groupby("recipe") if bool((g.rel_err == 0).all())}
    shown = finite[~finite.recipe.isin(exact)] if len(exact) < df.recipe.nunique() else \
        finite.iloc[0:0]
    means = shown.replace([float("inf")], float("nan")).groupby(["kind", "recipe"])[cols].mean()
    if len(means):
        excluded = f"{int(bad.sum())} non-finite rows excluded; " if bad.any() else ""
        head = f"per-recipe means over finite rows ({excluded}SQNR mean ignores exact rows):"
        lines += ["", head, means.to_string(float_format=lambda v: f"{v:.4g}")]
    routed = df[df.kind == "routed"]
    for rec, g in routed.groupby("recipe"):
        if bool((g.rel_err == 0).all()):  # the lossless case is named, not listed
            lines += ["", f"{rec} reproduces exactly: rel_err 0 on all {len(g)} routed weights"]
            continue
        lines.append("")
        g_bad = g[nonfinite_rows(g)]
        if len(g_bad):
            lines.append(f"non-finite routed experts for {rec} (not ranked):")
            lines += [f"  layer {r.layer:3d} expert {r.expert:4d} {r.proj:4s}  "
                      f"{getattr(r, 'nonfinite', 0)} non-finite values, rel_err {r.rel_err:.4g}"
                      for r in g_bad.itertuples()]
        top = g[~nonfinite_rows(g)].nlargest(worst, "rel_err")
        lines.append(f"worst {len(top)} routed experts for {rec} (rel_err):")
        lines += [f"  layer {r.layer:3d} expert {r.expert:4d} {r.proj:4s}  rel_err {r.rel_err:.4g}  "
                  f"sqnr {r.sqnr_db:.2f} dB  clip {r.clip_frac:.3g}" for r in top.itertuples()]
    return "\n".join(lines)


def write_report(result: InspectResult, out: str | os.PathLike, *, dpi: int = 110) -> Path:
    """Tables, summary and ``result.figures`` (drawn by ``workbench.report.inspect_figures``:
    analysis does not draw) under ``out``."""
    out = Path(out)
    result.tables.save(out)
    for stem, fig in result.figures.items():
        with atomic_open(out / f"{stem}.png", "wb") as f:
            fig.savefig(f, dpi=dpi, format="png")
    atomic_write_text(out / "summary.txt", result.summary + "\n")
    return out
