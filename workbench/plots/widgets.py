"""Notebook widgets (ipywidgets, imported lazily): an expert picker over a checkpoint."""

from __future__ import annotations


def expert_picker(ck, recipes=(), *, kind: str = "routed"):
    """Layer / expert / projection / recipe controls that redraw ``plots.expert_detail``.

    The recipe list starts with ``stored`` when the checkpoint holds packed experts.
    """
    try:
        import ipywidgets as w
        from IPython.display import display
    except ImportError as e:  # pragma: no cover
        raise ImportError("the expert picker needs ipywidgets: pip install 'workbench[notebooks]'") from e
    from workbench.analysis import expert_detail
    from workbench.checkpoint.grid import stored_grid

    from .experts import expert_detail as plot_detail

    recs = ck.expert_records(kind)
    if not recs:
        raise ValueError(f"{ck.path} has no {kind} expert weights")
    layers = sorted({r.layer for r in recs})
    n_exp = max(r.expert for r in recs) + 1
    packed = stored_grid(ck, recs[0]) is not None
    choices = (["stored"] if packed else []) + [str(r) for r in recipes]
    if not choices:
        raise ValueError("pass recipes= for a checkpoint stored in BF16")
    layer = w.Dropdown(options=layers, value=layers[0], description="layer")
    expert = w.IntSlider(min=0, max=n_exp - 1, value=0, description="expert", continuous_update=False)
    proj = w.ToggleButtons(options=["gate", "up", "down"], value="gate", description="proj")
    recipe = w.Dropdown(options=choices, value=choices[0], description="recipe")
    out = w.Output()

    def show(*_):
        d = expert_detail(ck, layer.value, expert.value, proj.value,
                          None if recipe.value == "stored" else recipe.value, kind)
        with out:
            out.clear_output(wait=True)
            display(plot_detail(d))

    for c in (layer, expert, proj, recipe):
        c.observe(show, names="value")
    show()
    return w.VBox([w.HBox([layer, expert]), w.HBox([proj, recipe]), out])
