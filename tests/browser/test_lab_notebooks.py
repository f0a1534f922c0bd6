"""The notebooks as users meet them: JupyterLab in headless Chromium, Run > Run All Cells.

Each test copies a notebook into a fresh JupyterLab root with its parameters cell edited (small
inputs), runs every cell from the menu, checks what the browser shows (rendered PNGs, the expert
picker reacting, live progress of a launch), and saves screenshots: as test artifacts always, and
into WORKBENCH_SCREENSHOTS_DIR once the test has passed (`make screenshots` points it at
``notebooks/screenshots/``, the README walk-through's pictures).
"""

from __future__ import annotations

import dataclasses
import io
import shutil
from pathlib import Path

import pytest
from browser_lab import (
    chromium,
    copy_notebook,
    jupyter_lab,
    open_notebook,
    png_images,
    run_all_from_menu,
    wait_all_executed,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def write_checkpoints(folder: Path) -> tuple[Path, Path]:
    """A small MoE (4 layers x 16 experts, structured like the demo's) as a BF16 reference and
    its compressed-tensors MXFP4 export: the real packed layout, in seconds."""
    from workbench.demo import structure_experts
    from workbench.model import MoEForCausalLM, preset
    from workbench.train.export import export_model

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


def cell(page, cells: list[dict], needle: str, *, exact: bool = False):
    """The DOM cell of the code cell whose source contains (is) ``needle`` (index from the
    notebook model)."""
    hits = [i for i, c in enumerate(cells) if c["type"] == "code"
            and (c["source"].strip() == needle if exact else needle in c["source"])]
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


def run_notebook(page, url: str, name: str, *, timeout_s: float, poll=None,
                 hide_left: bool = False) -> list[dict]:
    """Open ``name``, Run All from the menu as a user does, and wait until every cell ran."""
    open_notebook(page, url, name)
    if hide_left:  # the file browser off: wider outputs for the screenshots
        page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    run_all_from_menu(page)
    return wait_all_executed(page, timeout_s=timeout_s, poll=poll)


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
            cells = run_notebook(page, url, name, timeout_s=180, hide_left=True)
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
            # One figure for all of them: one colour scale across recipes; none is lossless here.
            heat = cell(page, cells, "plots.plot_recipe_heatmaps(")
            heatmaps = png_images(heat)
            assert len(heatmaps) == 1 and is_png(heatmaps[0])
            assert "no recipe reproduces its grid exactly" in heat.locator(
                ".jp-OutputArea").text_content()
            shots.append(shoot(heat.locator(".jp-OutputArea"), artifacts, "01_heatmaps.png"))
            compare = cell(page, cells, "plots.plot_recipe_comparison(")
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
            # It opens on a comparison that means something, and says which.
            picked = cell(page, cells, "expert_picker(ck").locator(".jp-OutputArea").first.text_content()
            assert "comparing: stored vs reference" in picked
            recipe = picker.locator(".widget-dropdown select").nth(1)
            # ipywidgets renders the labels' spaces as no-break spaces
            assert [o.replace("\xa0", " ") for o in recipe.locator("option").all_inner_texts()] == [
                "stored vs reference", "mxfp4:floor on reference", "nvfp4:torchao on reference"]
            recipe.select_option(index=2)
            wait_changed(picker, layer2)
            before = png_images(picker.locator(".widget-output"))[0]
            picker.get_by_role("button", name="down").click()
            wait_changed(picker, before)
            shots.append(shoot(picker, artifacts, "01_expert_picker.png"))
        except BaseException:
            s.on_failure()
            raise
    publish(shots, artifacts, screenshot_dirs)


def test_launch_notebook_live_progress_then_budgets(tmp_path, browser_ready, artifacts,
                                                     screenshot_dirs):
    """02_launch_qat: two EP4 runs on the local executor, watched live in the browser; then
    03_budgets on the runs it made."""
    root = tmp_path / "lab"
    root.mkdir()
    steps = 6
    n02, n03, n04 = "02_launch_qat.ipynb", "03_budgets.ipynb", "04_compare.ipynb"
    copy_notebook(NOTEBOOKS / n02, root / n02, {
        "executor": "local", "ep": 4, "nodes": 1, "steps": steps, "recipes": ["bf16", "mxfp4+mxfp8"],
        "out": "runs/launch", "wandb": "disabled", "timeout_s": 600})
    copy_notebook(NOTEBOOKS / n03, root / n03, {
        "group_dir": "runs/launch", "group": None, "baseline": None, "val_loss_pct": 2.0,
        "divergence_window": 20, "max_step_time_ratio": 2.0, "max_fake_quant_share": 0.5,
        "expert_error": False, "expert_metric": "rel_err"})
    copy_notebook(NOTEBOOKS / n04, root / n04, {
        "a": None, "b": None, "reference": None, "group_dir": "runs/launch", "recipe": None,
        "tol_pct": 1.0, "out_dir": "compare", "demo_steps": 24})
    shots: list[str] = []
    seen: list[str] = []  # status tables shown while the runs were going

    def watch_progress(page) -> None:
        from playwright.sync_api import Error as PlaywrightError

        watch = page.locator(".jp-Notebook .jp-Cell", has_text="final = watch(")
        table = watch.locator(".jp-OutputArea table")
        try:
            if not table.count():
                return
            text = table.first.text_content(timeout=2000)
            if "RUNNING" in text and (not seen or text != seen[-1]):
                seen.append(text)
                # The walk-through's picture: the live table (and curve, once metrics exist) as
                # late in the run as it was seen.
                shoot(watch.locator(".jp-OutputArea"), artifacts, "02_progress.png")
        except PlaywrightError:
            pass  # the output was redrawn under us; the next poll sees the new one

    with jupyter_lab(root, tmp_path / "jupyter") as url, chromium(tmp_path / "profile") as page:
        s = Session(page, artifacts, tmp_path / "jupyter" / "jupyter.log")
        try:
            cells = run_notebook(page, url, n02, timeout_s=600, poll=watch_progress, hide_left=True)
            # Progress appeared while the jobs ran: a live status table with a running job.
            assert seen, "no live status table with a running job was shown"
            assert (artifacts / "02_progress.png").exists()
            shots.append("02_progress.png")
            watched = cell(page, cells, "final = watch(").locator(".jp-OutputArea")
            final = watched.locator("table").first.text_content()
            assert final.count("COMPLETED") == 2 and "RUNNING" not in final, final
            final = watched.text_content().replace("\u2007", " ")  # tqdm's figure spaces
            # tqdm's notebook bar counts the steps of both runs.
            bar = watched.locator(".widget-hprogress, .widget-progress").first
            assert "steps (all runs)" in final and bar.count(), watched.evaluate(
                "e => [...e.querySelectorAll('.jupyter-widgets')].map(w => w.className)")
            assert f"{2 * steps}/{2 * steps}" in final, final
            curve = cell(page, cells, "plot_curves(curves(jobs)")
            imgs = png_images(curve)
            assert len(imgs) == 1 and is_png(imgs[0])
            shots.append(shoot(curve, artifacts, "02_curves.png"))
            launched = sorted(p.parent.name for p in (root / "runs" / "launch").glob("*/launch.json"))
            assert launched == ["tiny-bf16-ep4-s0", "tiny-mxfp4+mxfp8-ep4-s0"], launched

            cells = run_notebook(page, url, n03, timeout_s=180)
            verdicts = cell(page, cells, "chart_data(cmp.budgets").locator(".jp-OutputArea")
            text = verdicts.text_content()
            assert "tiny-mxfp4+mxfp8-ep4-s0" in text and "val_loss within 2%" in text, text[-800:]
            assert "pending" in text and "<NA>" not in text and "% of step time" in text
            shots.append(shoot(verdicts, artifacts, "03_budget_table.png"))
            for needle, name in (('plot_curves(cmp.curves, "loss"', "03_curves.png"),
                                 ('plot_curves(cmp.curves, "step_time_s"', "03_step_time.png"),
                                 ("plot_budgets(verdicts)", "03_budgets.png")):
                c = cell(page, cells, needle)
                imgs = png_images(c)
                assert len(imgs) == 1 and is_png(imgs[0]), needle
                shots.append(shoot(c.locator(".jp-OutputArea"), artifacts, name))

            # 04_compare fed directly by 02's exports: QAT run vs BF16 baseline, per expert.
            cells = run_notebook(page, url, n04, timeout_s=300)
            summary = cell(page, cells, "result = compare(").locator(".jp-OutputArea")
            text = summary.text_content()
            assert "QAT run tiny-mxfp4+mxfp8-ep4-s0 vs BF16 baseline tiny-bf16-ep4-s0" in text
            assert "improved" in text, text[-800:]
            assert (root / "compare" / "compare.csv").exists()
            shots.append(shoot(summary, artifacts, "04_compare_summary.png"))
            for needle, n, name in (('display(figs["compare_heatmap"])', 1, "04_compare_heatmap.png"),
                                    ('display(figs["compare_scatter"])', 2, "04_compare_scatter.png")):
                c = cell(page, cells, needle)
                imgs = png_images(c)
                assert len(imgs) == n and all(is_png(b) for b in imgs), needle
                shots.append(shoot(c.locator(".jp-OutputArea"), artifacts, name))
        except BaseException:
            s.on_failure()
            raise
    publish(shots, artifacts, screenshot_dirs)


def test_telemetry_notebook_heatmaps(tmp_path, browser_ready, artifacts, screenshot_dirs):
    """05_expert_telemetry on two real tiny QAT runs (MXFP4, NVFP4) that recorded per-expert
    statistics at steps 0, 3 and 6: the three expert x step heatmaps, the error-growth bars, the
    run-vs-run map and the budget table render in the browser."""
    from workbench.track import expert_stats as es
    from workbench.train import distributed
    from workbench.train.config import tiny as tiny_config
    from workbench.train.loop import train

    root = tmp_path / "lab"
    group = root / "runs" / "telemetry"
    info = distributed.setup()
    for recipe in ("mxfp4", "nvfp4"):
        train(tiny_config(str(group / f"tiny-{recipe}"), recipe=recipe, steps=6, batch=4, seq=32,
                          wandb="disabled", warmup=2, ckpt_every=0, val_every=3), info)
    steps = sorted(es.read(group / "tiny-mxfp4")["step"].unique())
    assert steps == [0, 3, 6], steps
    name = "05_expert_telemetry.ipynb"
    copy_notebook(NOTEBOOKS / name, root / name, {
        "group_dir": "runs/telemetry", "run_dirs": None, "max_rel_err": 0.2, "max_dead": 0,
        "max_churn": 1.0, "top_n": 10})
    shots: list[str] = []
    with jupyter_lab(root, tmp_path / "jupyter") as url, chromium(tmp_path / "profile") as page:
        s = Session(page, artifacts, tmp_path / "jupyter" / "jupyter.log")
        try:
            cells = run_notebook(page, url, name, timeout_s=180, hide_left=True)
            for needle, shot in (('es.per_expert(df, "rel_err")', "05_error.png"),
                                 ('es.per_expert(df[df.step > 0], "load")', "05_load.png"),
                                 ('es.per_expert(df[df.churn.notna()], "churn")', "05_churn.png"),
                                 ("plot_error_growth(growth, n=top_n", "05_growth.png"),
                                 ("figs = [plot_map_difference(", "05_run_vs_run.png")):
                c = cell(page, cells, needle)
                imgs = png_images(c)
                assert len(imgs) == 1 and is_png(imgs[0]), (needle, len(imgs))
                shots.append(shoot(c.locator(".jp-OutputArea"), artifacts, shot))
            verdicts = cell(page, cells, "budgets = (es.ExpertErrorBelow").locator(".jp-OutputArea")
            text = verdicts.text_content()
            assert "tiny-mxfp4" in text and "tiny-nvfp4" in text, text[-800:]
            assert "worst expert rel_err" in text and "<NA>" not in text, text[-800:]
            shots.append(shoot(verdicts, artifacts, "05_budgets.png"))
        except BaseException:
            s.on_failure()
            raise
    publish(shots, artifacts, screenshot_dirs)
