"""The notebooks as users meet them: JupyterLab in headless Chromium, Run > Run All Cells.

Each test copies a notebook into a fresh JupyterLab root with its parameters cell edited (small
inputs), runs every cell from the menu, checks what the browser shows (rendered PNGs, the expert
picker reacting, live progress of a launch), and saves screenshots: as test artifacts always, and
into ``notebooks/screenshots/`` (the README walk-through's pictures) once the test has passed.
"""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path

import pytest
from browser_lab import (chromium, copy_notebook, jupyter_lab, open_notebook, png_images,
                         run_all_from_menu, wait_all_executed)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def write_checkpoints(folder: Path) -> tuple[Path, Path]:
    """A small MoE (4 layers x 16 experts, structured like the demo's) as a BF16 reference and
    its compressed-tensors MXFP4 export: the real packed layout, in seconds."""
    from workbench.checkpoint.export import export_model
    from workbench.demo import structure_experts
    from workbench.model import MoEForCausalLM, preset

    cfg = preset("tiny", num_layers=4, num_experts=16, expert_ffn=64)
    model = MoEForCausalLM(cfg, seed=0)
    structure_experts(model, seed=0)
    bf16, packed = folder / "small-moe-bf16", folder / "small-moe-mxfp4"
    export_model(model, bf16, fmt="bf16")
    export_model(model, packed, fmt="compressed-tensors", recipe="mxfp4")
    return bf16, packed


def is_png(b: bytes) -> bool:
    import matplotlib.image

    return b[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(io.BytesIO(b)).ndim == 3


def cell(page, cells: list[dict], needle: str):
    """The DOM cell of the code cell whose source contains ``needle`` (index from the model)."""
    hits = [i for i, c in enumerate(cells) if c["type"] == "code" and needle in c["source"]]
    assert len(hits) == 1, f"{needle!r} is in cells {hits}"
    # JupyterLab skips rendering off-screen cells (content-visibility): bring it on screen.
    loc = page.locator(".jp-Notebook .jp-Cell").nth(hits[0])
    loc.scroll_into_view_if_needed()
    return loc


def shoot(target, artifacts: Path, name: str) -> str:
    if hasattr(target, "scroll_into_view_if_needed"):  # a locator, not the whole page
        target.scroll_into_view_if_needed()
    target.screenshot(path=str(artifacts / name), animations="disabled")
    return name


def publish(names: list[str], artifacts: Path, dirs: list[Path]) -> None:
    for d in dirs:
        if d == artifacts:
            continue
        d.mkdir(parents=True, exist_ok=True)
        for n in names:
            tmp = d / f".{n}.tmp"
            shutil.copyfile(artifacts / n, tmp)
            tmp.replace(d / n)


@dataclasses.dataclass
class Session:
    page: object
    artifacts: Path
    log: Path

    def on_failure(self) -> None:
        try:
            self.page.screenshot(path=str(self.artifacts / "failure.png"))
        finally:
            if self.log.exists():
                shutil.copyfile(self.log, self.artifacts / "jupyter.log")


def wait_changed(picker, before: bytes, *, timeout_s: float = 60) -> bytes:
    """The picker's figure once it differs from ``before``."""
    page = picker.page
    for _ in range(int(timeout_s * 4)):
        imgs = png_images(picker.locator(".widget-output"))
        if len(imgs) == 1 and imgs[0] != before:
            return imgs[0]
        page.wait_for_timeout(250)
    raise AssertionError("the expert picker's figure did not change")


def test_inspection_notebook_heatmaps_and_expert_picker(tmp_path, browser_ready, artifacts,
                                                        screenshot_dirs):
    import pandas as pd

    root = tmp_path / "lab"
    root.mkdir()
    write_checkpoints(root / "checkpoints")
    name = "01_inspect_checkpoint.ipynb"
    copy_notebook(NOTEBOOKS / name, root / name, {
        "checkpoint": "checkpoints/small-moe-mxfp4", "reference": "checkpoints/small-moe-bf16",
        "recipes": ["mxfp4:floor", "nvfp4:torchao"], "out_dir": "inspect", "demo_steps": 24})
    shots = []
    with jupyter_lab(root, tmp_path / "jupyter") as url, chromium(tmp_path / "profile") as page:
        s = Session(page, artifacts, tmp_path / "jupyter" / "jupyter.log")
        try:
            open_notebook(page, url, name)
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
            run_all_from_menu(page)
            cells = wait_all_executed(page, timeout_s=180)
            page.locator(".jp-Notebook .jp-Cell").first.evaluate(
                "e => e.scrollIntoView({block: 'start'})")
            shots.append(shoot(page, artifacts, "01_notebook.png"))

            config = cell(page, cells, 'get("quantization_config"')
            assert "compressed-tensors" in config.locator(".jp-OutputArea").text_content()
            shots.append(shoot(config, artifacts, "01_quantization_config.png"))

            # One heatmap per routed recipe of the table the notebook wrote (read from disk here).
            df = pd.read_csv(root / "inspect" / "experts.csv")
            routed = sorted(df[df["kind"] == "routed"]["recipe"].unique())
            assert len(routed) == 3, routed  # the stored grid and the two candidates
            heat = cell(page, cells, "plots.heatmap(")
            heatmaps = png_images(heat)
            assert len(heatmaps) == len(routed) and all(is_png(b) for b in heatmaps)
            assert len(set(heatmaps)) == len(heatmaps), "heatmaps of different recipes are identical"
            shots.append(shoot(heat.locator(".jp-OutputArea"), artifacts, "01_heatmaps.png"))
            compare = cell(page, cells, "plots.recipe_comparison(")
            figs = png_images(compare)
            assert len(figs) == 3 and all(is_png(b) for b in figs)
            shots.append(shoot(compare.locator(".jp-OutputArea-child").first, artifacts,
                               "01_recipe_comparison.png"))

            # The expert picker: its figure follows the controls, and is a function of them.
            picker = cell(page, cells, "expert_picker(ck").locator(".widget-vbox").first
            first = png_images(picker.locator(".widget-output"))
            assert len(first) == 1 and is_png(first[0])
            handle = picker.locator(".widget-slider .noUi-handle").first
            handle.focus()
            handle.press("ArrowRight")
            expert1 = wait_changed(picker, first[0])
            assert picker.locator(".widget-slider .widget-readout").first.inner_text().strip() == "1"
            handle.press("ArrowLeft")
            assert wait_changed(picker, expert1) == first[0], "expert 0 drew a different figure"
            layers = picker.locator(".widget-dropdown select").first
            options = layers.locator("option").all_inner_texts()
            assert len(options) == 4, options
            layers.select_option(label=options[2])
            layer2 = wait_changed(picker, first[0])
            recipe = picker.locator(".widget-dropdown select").nth(1)
            assert recipe.locator("option").all_inner_texts() == ["stored", "mxfp4:floor",
                                                                  "nvfp4:torchao"]
            recipe.select_option(label="nvfp4:torchao")
            wait_changed(picker, layer2)
            before = png_images(picker.locator(".widget-output"))[0]
            picker.get_by_role("button", name="down").click()
            wait_changed(picker, before)
            shots.append(shoot(picker, artifacts, "01_expert_picker.png"))
        except BaseException:
            s.on_failure()
            raise
    publish(shots, artifacts, screenshot_dirs)
