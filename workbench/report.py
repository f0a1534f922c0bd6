"""Analysis results drawn: the figure sets the CLI writes and the notebooks show.

This module sits above ``workbench.analysis`` (numbers) and ``workbench.plots`` (pictures from
tables), which never import each other. It decides which figures a result deserves: a recipe
that reproduces its grid exactly is named in one line, never drawn as an empty plot.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from workbench import plots
from workbench._io import atomic_open
from workbench.analysis import expert_detail, reference_detail
from workbench.analysis.compare import CompareResult
from workbench.analysis.inspect import InspectResult
from workbench.checkpoint import open_checkpoint
from workbench.checkpoint.grid import stored_grid
from workbench.track import load_runs
from workbench.track.compare import pick_baseline
from workbench.track.experts import export_path, group_weight_recipes

__all__ = [
    "compare_figures", "exact_recipes", "expert_picker", "group_sides", "inspect_figures",
    "lossless_lines", "picker_choices", "save_figures", "source_lines", "write_compare_report",
]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def source_lines(ck, reference=None, select=None, *, names=("checkpoint", "reference")
                 ) -> list[str]:
    """Summary lines saying what each checkpoint resolved to (folder, hub id and commit, URL),
    which layers / experts were read, and, for remote ones, how many bytes came over the
    network and from the range cache."""
    lines = []
    for name, c in zip(names, (ck, reference)):
        if c is None:
            continue
        src = getattr(c, "source", None)
        if src is not None:
            lines.append(f"{name} {src.describe()}")
        st = getattr(c, "fetch_stats", None)
        if st is not None:
            lines.append(f"{name} fetched {_bytes(st.fetched)} in {st.requests} requests "
                         f"({st.retries} retried), {_bytes(st.cached)} from the range cache")
    if select is not None and not select.everything:
        lines.append(f"selection: {select}")
    return lines


def exact_recipes(df, metric: str = "rel_err", kind: str = "routed") -> list[str]:
    """Recipes whose every ``kind`` weight has ``metric`` exactly 0 (the grid reproduces)."""
    d = df[df.kind == kind]
    return sorted(r for r, g in d.groupby("recipe") if len(g) and bool((g[metric] == 0).all()))


def lossless_lines(df, metric: str = "rel_err", kind: str = "routed") -> list[str]:
    d = df[df.kind == kind]
    return [f"{r} reproduces exactly: {metric} 0 on all {int((d.recipe == r).sum())} {kind} "
            "weights (nothing to draw)" for r in exact_recipes(df, metric, kind)]


def inspect_figures(result: InspectResult, metric: str = "rel_err") -> dict:
    """File stem -> Figure for an inspect result. Recipes that reproduce exactly are left
    out; every heatmap shares one colour scale across the recipes drawn."""
    df = result.tables.experts
    figs: dict = {}
    routed = df[df.kind == "routed"]
    if routed.empty:
        return figs
    exact = set(exact_recipes(df, metric))
    lossy = [r for r in sorted(routed.recipe.unique()) if r not in exact]
    if lossy:
        vmin, vmax = plots.value_range(routed[routed.recipe.isin(lossy)][metric])
    for rec in lossy:
        safe = rec.replace(":", "_")
        figs[f"heatmap_{metric}_{safe}"] = plots.plot_heatmap(df, metric, recipe=rec, vmin=vmin,
                                                              vmax=vmax)
        figs[f"worst_{safe}"] = plots.plot_worst_experts(df, metric, recipe=rec)
        figs[f"experts_{safe}"] = plots.plot_expert_distribution(df, metric, recipe=rec)
    finite = routed[routed.recipe.isin(lossy)]
    if len(lossy) > 1 and np.isfinite(finite["sqnr_db"].to_numpy(float)).any():
        figs["recipes_sqnr_db"] = plots.plot_recipe_comparison(finite, "sqnr_db")
    if not result.tables.scales.empty:
        figs["scale_exponents"] = plots.plot_scale_histogram(result.tables.scales)
    return figs


def compare_figures(result: CompareResult) -> dict:
    """File stem -> Figure for a comparison; none when A and B are identical (the summary
    says so)."""
    t = result.table
    routed = t[t.kind == "routed"]
    if routed.empty or result.identical:
        return {}
    kw = {"metric": result.metric, "a_label": result.a_label, "b_label": result.b_label}
    return {"compare_heatmap": plots.plot_compare_heatmap(t, "change_pct", **kw),
            "compare_scatter": plots.plot_compare_scatter(t, **kw),
            "compare_extremes": plots.plot_compare_extremes(t, **kw)}


def save_figures(figures: dict, out: str | os.PathLike, *, dpi: int = 110) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for stem, fig in figures.items():
        with atomic_open(out / f"{stem}.png", "wb") as f:
            fig.savefig(f, dpi=dpi, format="png")
        paths.append(out / f"{stem}.png")
    return paths


def write_compare_report(result: CompareResult, out: str | os.PathLike) -> tuple[Path, list[Path]]:
    """compare.csv, summary.txt and the comparison figures under ``out``."""
    folder = result.save(out)
    return folder, save_figures(compare_figures(result), folder)


def expert_picker(ck, recipes=(), *, reference=None, kind: str = "routed"):
    """Layer / expert / projection / comparison controls that redraw ``plots.plot_expert_detail``.

    Every choice compares something with something else, and its label says what:
    ``stored vs reference`` (the packed grid against the BF16 reference; the default when a
    reference is given), ``RECIPE on reference`` (post-training quantization of the reference),
    or, without a reference, ``RECIPE vs stored`` (re-quantizing the decoded stored weights).
    The stored grid is never compared with itself.
    """
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError as e:  # pragma: no cover
        raise ImportError("the expert picker needs ipywidgets: pip install 'workbench[notebooks]'") from e
    choices = picker_choices(ck, recipes, reference=reference, kind=kind)
    recs = ck.expert_records(kind)
    layers = sorted({r.layer for r in recs})
    n_exp = max(r.expert for r in recs) + 1
    layer = w.Dropdown(options=layers, value=layers[0], description="layer")
    expert = w.IntSlider(min=0, max=n_exp - 1, value=0, description="expert", continuous_update=False)
    proj = w.ToggleButtons(options=["gate", "up", "down"], value="gate", description="proj")
    what = w.Dropdown(options=[c[0] for c in choices], value=choices[0][0],
                      description="compare", style={"description_width": "initial"},
                      layout=w.Layout(width="28em"))
    out = w.Output()
    by_label = dict(choices)

    def show(*_):
        source, recipe = by_label[what.value]
        args = (layer.value, expert.value, proj.value)
        d = (reference_detail(ck, reference, *args, recipe=recipe, kind=kind)
             if source == "reference" else expert_detail(ck, *args, recipe, kind))
        with out:
            out.clear_output(wait=True)
            display(plots.plot_expert_detail(d))

    for c in (layer, expert, proj, what):
        c.observe(show, names="value")
    show()
    return w.VBox([w.HBox([layer, expert]), w.HBox([proj, what]), out])


def picker_choices(ck, recipes=(), *, reference=None, kind: str = "routed") -> list[tuple]:
    """(label, (source, recipe)) of the picker's comparisons, the default first."""
    recs = ck.expert_records(kind)
    if not recs:
        raise ValueError(f"{ck.path} has no {kind} expert weights")
    packed = stored_grid(ck, recs[0]) is not None
    out = []
    if reference is not None:
        if packed:
            out.append(("stored vs reference", ("reference", None)))
        out += [(f"{r} on reference", ("reference", str(r))) for r in recipes]
    elif packed:
        out += [(f"{r} vs stored (decoded)", ("stored", str(r))) for r in recipes]
    else:
        out += [(f"{r} on these BF16 weights", ("stored", str(r))) for r in recipes]
    if not out:
        raise ValueError("nothing to compare: pass recipes= (or reference= for a packed "
                         "checkpoint)")
    return out


def group_sides(group_dir, recipe: str | None = None) -> tuple[str, str, str | None, str]:
    """(A, B, reference, what) for ``compare`` from a run group (notebook 02's folder): A is
    the (first) QAT run's export, B the BF16 baseline's, both shipped with the QAT run's weight
    format (``recipe`` overrides it). With BF16 exports (02 asks for ``--export bf16``) each
    side is quantized and measured against its own masters: quantization error only, no
    training drift. A packed QAT export is measured against the baseline's BF16 export."""
    runs = load_runs(group_dir)
    qat = [r for r in runs if not r.is_baseline and export_path(r) is not None]
    if not qat:
        raise FileNotFoundError(f"{group_dir}: no QAT run with an export (train with --export)")
    base = pick_baseline(qat[0], runs)
    if base is None or export_path(base) is None:
        raise FileNotFoundError(f"{group_dir}: no BF16 baseline run with an export for "
                                f"{qat[0].name}")
    recipe = recipe or (group_weight_recipes([qat[0]]) or [None])[0]
    if recipe is None:
        raise ValueError(f"{qat[0].name}: recipe {qat[0].recipe!r} has no weight format; pass "
                         "recipe=")
    qa, qb = export_path(qat[0]), export_path(base)
    b = f"ptq:{recipe}@{qb}"
    what = (f"QAT run {qat[0].name} vs BF16 baseline {base.name}, each exported and shipped "
            f"as {recipe}")
    if open_checkpoint(qa).layout == "dense":
        return f"ptq:{recipe}@{qa}", b, None, what + " (each against its own BF16 weights)"
    return str(qa), b, str(qb), what + " (both against the baseline's BF16 weights)"
