"""Notebook 01 with a hub id and a layer selection as its parameters, from a Hugging Face cache
made by hand (offline): the same table as the folder, and its source printed."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from hub_cache import add_snapshot, commit_of
from notebook_run import run_notebook
from writers import write_ct

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_inspection_notebook_takes_a_hub_id_and_layers(tmp_path, monkeypatch):
    pytest.importorskip("papermill")
    import nbformat

    folder = write_ct(tmp_path / "ck", "nvfp4", layers=3, experts=4, shards=2)
    commit = commit_of(5)
    add_snapshot(tmp_path / "hf", "org/nb", folder, commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the kernel inherits the environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WORKBENCH_RANGE_CACHE", "off")
    runs = {}
    for name, spec in (("id", "org/nb@main"), ("folder", str(folder))):
        out = tmp_path / f"{name}.ipynb"
        run_notebook(
            str(ROOT / "notebooks" / "01_inspect_checkpoint.ipynb"), str(out),
            parameters={"checkpoint": spec, "out_dir": str(tmp_path / name), "layers": "1-2",
                        "experts": "0,3", "recipes": ["mxfp4:floor"]},
            cwd=str(ROOT), kernel_name="python3", progress_bar=False)
        runs[name] = nbformat.read(out, as_version=4)
    a = pd.read_csv(tmp_path / "id" / "experts.csv")
    b = pd.read_csv(tmp_path / "folder" / "experts.csv")
    assert len(a) and a.equals(b)
    assert set(zip(a.layer, a.expert)) == {(1, 0), (1, 3), (2, 0), (2, 3)}
    text = "".join(o.get("text", "") for c in runs["id"].cells for o in c.get("outputs", []))
    assert f"source: hub org/nb commit {commit} (asked for main)" in text
