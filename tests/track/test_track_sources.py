"""A run group whose runs' two records disagree: the reader never loses a run silently.

Each trainer run folder holds `metrics.jsonl` and (normally) a wandb offline run file under
`wandb/`. The files here are real: wandb 0.31 writes them (tests/track/wandb_writer.py), then
this test damages them the way a full disk or a failed wandb set-up leaves them.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from notebook_run import run_notebook
from track_runs import write_runs

from workbench.track import compare, find_runs, load_runs, read_metrics
from workbench.track.compare import UnreadableRun
from workbench.track.wandb_file import CorruptRunFile, scan_records

N = 30
CONFIG = {"recipe": "mxfp4", "seed": 0, "run_group": "g"}


def _rows(n: int = N) -> list[dict]:
    # trainer steps start at 1
    return [{"step": s, "metrics": {"loss": 5.0 - s / 10, "step_time_s": 1.0}}
            for s in range(1, n + 1)]


def _metrics_file(folder: Path, n: int, config: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": r["step"], **r["metrics"]}) + "\n" for r in _rows(n))
    (folder / "config.json").write_text(json.dumps(config))


def _cut_history(run_file: Path, keep: int) -> None:
    """Truncate a wandb run file inside the history record after the first `keep` steps, as a
    full disk leaves it (the writer stopped mid-record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    seen = 0
    for off, payload in scan_records(run_file).records:
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history":
            seen += 1
            if seen == keep + 1:
                data = run_file.read_bytes()
                run_file.write_bytes(data[: off + 9])  # a record header and two payload bytes
                return
    raise AssertionError(f"{run_file}: fewer than {keep + 1} history records")


def _flip_a_byte(run_file: Path) -> None:
    data = bytearray(run_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a record: its crc32 no longer matches
    run_file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sources") / "group dir"
    wandb_runs = {"both": N, "diskfull": N, "wandb-longer": N, "recovered": N, "lost": N,
                  "other-group": N}
    spec = []
    for name, n in wandb_runs.items():
        grp = "other" if name == "other-group" else "g"
        spec.append({"name": name, "group": grp, "config": {**CONFIG, "run_group": grp},
                     "rows": _rows(n), "dir": str(root / name)})
    write_runs(root.parent, spec)
    for name in ("both", "diskfull", "recovered", "nowandb"):
        _metrics_file(root / name, N, CONFIG)
    _metrics_file(root / "wandb-longer", 20, CONFIG)  # metrics.jsonl cut short (its disk)
    _metrics_file(root / "other-group", N, {**CONFIG, "run_group": "other"})
    # a folder with metrics whose config cannot be read, and no wandb run
    _metrics_file(root / "badconfig", N, CONFIG)
    (root / "badconfig" / "config.json").write_text("{not json")
    files = {name: next((root / name).rglob("run-*.wandb")) for name in wandb_runs}
    _cut_history(files["diskfull"], 26)
    _flip_a_byte(files["recovered"])
    _flip_a_byte(files["lost"])
    return root


def _load(group: Path, **kw):
    unreadable: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = load_runs(group, group="g", corrupt=unreadable, **kw)
    return {r.name: r for r in runs}, unreadable, [str(w.message) for w in caught]


def test_every_run_is_read_from_its_longer_record(group):
    runs, _, _ = _load(group)
    assert set(runs) == {"both", "diskfull", "wandb-longer", "recovered", "nowandb"}
    steps = {name: list(r.metrics["step"]) for name, r in runs.items()}
    assert all(s == list(range(1, N + 1)) for s in steps.values()), steps
    # the loss values are the logged ones, whichever file they came from
    for r in runs.values():
        assert r.metrics["loss"].tolist() == [5.0 - s / 10 for s in range(1, N + 1)]
        assert r.recipe == "mxfp4" and r.seed == 0
    # the disk-full run's wandb file really holds fewer steps
    (diskfull,) = [r for r in find_runs(group / "diskfull") if r.name == "diskfull"]
    assert diskfull.truncated and len(diskfull.history) == 26


def test_each_disagreement_is_one_line_naming_the_run_and_both_lengths(group):
    _, _, said = _load(group)
    by_run = {name: [m for m in said if f"run {name} " in m]
              for name in ("both", "diskfull", "wandb-longer", "recovered", "nowandb")}
    assert by_run["both"] == []  # the records agree: nothing to say
    (line,) = by_run["diskfull"]
    assert "metrics.jsonl has 30 steps" in line and "wandb run file 26" in line
    assert "using metrics.jsonl" in line
    (line,) = by_run["wandb-longer"]
    assert "metrics.jsonl has 20 steps" in line and "wandb run file 30" in line
    assert "using the wandb run file" in line
    (line,) = by_run["nowandb"]
    assert "no wandb run file" in line and "metrics.jsonl has 30 steps" in line
    (line,) = by_run["recovered"]
    assert "corrupt wandb run file" in line and "metrics.jsonl has 30 steps" in line
    assert all("\n" not in m for m in said)


def test_unreadable_runs_are_listed(group):
    _, unreadable, said = _load(group)
    paths = sorted(Path(u.path).relative_to(group).parts[0] for u in unreadable)
    assert paths == ["badconfig", "lost"]
    lost = next(u for u in unreadable if "lost" in u.path)
    assert isinstance(lost, CorruptRunFile)
    bad = next(u for u in unreadable if "badconfig" in u.path)
    assert isinstance(bad, UnreadableRun) and "config.json" in str(bad)
    assert any("lost" in m and "unreadable" in m for m in said)
    # without a list to put them in, an unreadable run is an error, not a quiet omission
    with pytest.raises((CorruptRunFile, UnreadableRun)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_runs(group, group="g")


def test_group_filter_keeps_a_runs_records_together(group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = load_runs(group, group="other", corrupt=[])
    assert [r.name for r in runs] == ["other-group"]
    assert len(runs[0].metrics) == N


def test_explicit_sources_read_only_that_record(group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wb = {r.name: r for r in load_runs(group, group="g", source="wandb", corrupt=[])}
        mj = {r.name: r for r in load_runs(group, group="g", source="metrics", corrupt=[])}
    assert len(wb["diskfull"].metrics) == 26 and "nowandb" not in wb
    assert len(mj["wandb-longer"].metrics) == 20 and "nowandb" in mj
    assert len(read_metrics(group / "diskfull")) == N


def test_compare_lists_unreadable_runs_and_judges_the_rest(group):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmp = compare(group, group="g")
    assert {r.name for r in cmp.runs} == {"both", "diskfull", "wandb-longer", "recovered",
                                          "nowandb"}
    assert sorted(Path(u.path).relative_to(group).parts[0] for u in cmp.corrupt) == \
        ["badconfig", "lost"]
    failed = cmp.budgets[cmp.budgets.budget == "run file readable"]
    assert len(failed) == 2 and not failed.passed.any()


@pytest.mark.slow
def test_budgets_notebook_shows_the_disagreement_and_the_unreadable_runs(group, tmp_path):
    pytest.importorskip("papermill", reason="needs the 'notebooks' extra")
    import nbformat
    from track_runs import REPO

    out = tmp_path / "03.out.ipynb"
    run_notebook(
        str(REPO / "notebooks" / "03_budgets.ipynb"), str(out), cwd=str(REPO),
        parameters={"group_dir": str(group), "group": "g", "expert_error": False},
        kernel_name="python3", progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "\n".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "run diskfull" in text and "wandb run file 26" in text
    assert "run nowandb" in text and "no wandb run file" in text
    shown = [line for line in text.splitlines() if line.startswith("NOT READ: ")]
    assert len(shown) == 2 and any("badconfig" in s for s in shown) and \
        any("lost" in s for s in shown)
    html = "\n".join(o["data"].get("text/html", "") for o in outputs if "data" in o)
    for name in ("both", "diskfull", "wandb-longer", "recovered", "nowandb"):
        assert f"<td>{name}</td>" in html, name
