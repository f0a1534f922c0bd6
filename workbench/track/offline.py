"""Read wandb offline runs back into pandas, without a wandb server.

`read_run` decodes one `run-<id>.wandb` file (one *segment*). A job that is preempted and
resumed with the same wandb run id writes one offline folder per attempt; `find_runs` merges
the segments of an id in start order, cutting each earlier segment at the first step the next
one logged, so the curve is continuous like the trainer's metrics.jsonl.

Reading a run that is still being written is safe: wandb appends records a few seconds after
they are logged (its writer buffers), and keeps the newest step open until the next step is
logged or the run finishes, so a live run shows all but its last few steps.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from workbench.track.wandb_file import CorruptRunFile, scan_records

TESTED_WANDB = "0.31."

__all__ = ["CorruptRunFile", "OfflineRun", "find_runs", "merge_segments", "read_run",
           "run_files"]


@dataclass
class OfflineRun:
    id: str
    name: str
    project: str
    group: str
    tags: tuple[str, ...]
    config: dict[str, Any]
    summary: dict[str, Any]
    history: pd.DataFrame  # one row per step, columns as logged, including `_step`
    alerts: list[dict[str, str]] = field(default_factory=list)
    exit_code: int | None = None  # None: no exit record yet (still running, or killed)
    start_time: float = 0.0
    truncated: bool = False  # the (last) file ended inside a record
    paths: tuple[str, ...] = ()
    wandb_version: str = ""  # of the wandb that wrote the (last) file

    @property
    def finished(self) -> bool:
        return self.exit_code is not None


def _pb():
    try:
        import wandb
        from wandb.proto import wandb_internal_pb2
    except ImportError as exc:
        raise ImportError("reading wandb run files needs wandb: "
                          "pip install 'workbench[track]'") from exc
    # The record schema comes from the installed wandb; the framing and field use were
    # checked against 0.31 only.
    if not wandb.__version__.startswith(TESTED_WANDB):
        warnings.warn(f"the wandb run-file reader was tested with wandb {TESTED_WANDB}x; "
                      f"installed wandb is {wandb.__version__}", stacklevel=3)
    return wandb_internal_pb2


def run_files(path: str | Path) -> list[Path]:
    """All `run-*.wandb` files under `path` (a file, a run folder, or any parent folder)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such wandb file or folder")
    return sorted(p.rglob("run-*.wandb"))


def read_run(path: str | Path) -> OfflineRun:
    """Decode one offline run: a `run-<id>.wandb` file or the `offline-run-*` folder holding it."""
    files = run_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no run-*.wandb file in this folder")
    if len(files) > 1:
        raise ValueError(f"{path}: holds {len(files)} run files; use find_runs() for a folder "
                         "of runs")
    return _decode(files[0])


def find_runs(wandb_dir: str | Path, group: str | None = None,
              corrupt: list[CorruptRunFile] | None = None, *, warn: bool = True
              ) -> list[OfflineRun]:
    """Every run under `wandb_dir` (resumed segments merged by run id), oldest first;
    only those of run group `group` when given. A damaged run file raises CorruptRunFile,
    unless a `corrupt` list is given: then it is appended there (and warned about unless
    `warn` is False, for a caller that says more itself) and the other runs are still read."""
    segments: dict[str, list[OfflineRun]] = {}
    for f in run_files(wandb_dir):
        try:
            seg = _decode(f)
        except CorruptRunFile as exc:
            if corrupt is None:
                raise
            corrupt.append(exc)
            if warn:
                warnings.warn(f"skipped: {exc}", stacklevel=2)
            continue
        if group is None or seg.group == group:
            segments.setdefault(seg.id, []).append(seg)
    runs = [merge_segments(segs) for segs in segments.values()]
    return sorted(runs, key=lambda r: r.start_time)


def merge_segments(segments: list[OfflineRun]) -> OfflineRun:
    """One run from several attempts at it (oldest first by start time): each attempt's
    history is cut at the first step the next attempt logged; config and summary are updated
    in order; id, name and exit code are the newest attempt's."""
    if not segments:
        raise ValueError("merge_segments: no segments given")
    return _merge(sorted(segments, key=lambda s: (s.start_time, s.paths)))


def _key(item) -> tuple[str, ...]:
    return (item.key,) if item.key else tuple(item.nested_key)


def _items(items) -> list[tuple[tuple[str, ...], Any]]:
    """(key path, decoded value) of repeated history/summary/config items. One json.loads
    per record instead of per item: a long run has millions of items."""
    items = list(items)
    raws = [it.value_json for it in items]
    if all(raws):
        values = json.loads("[" + ",".join(raws) + "]")
    else:  # an empty value_json is malformed; decode one by one so the error says so
        values = [json.loads(r) for r in raws]
    return [(_key(it), v) for it, v in zip(items, values)]


def _set(d: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        nxt = d.get(k)
        if not isinstance(nxt, dict):
            nxt = d[k] = {}
        d = nxt
    d[path[-1]] = value


def _drop(d: dict, path: tuple[str, ...]) -> None:
    for k in path[:-1]:
        d = d.get(k)
        if not isinstance(d, dict):
            return
    d.pop(path[-1], None)


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    # wandb shows nested metrics as "a.b"; media objects (dicts with "_type") stay one cell.
    out: dict[str, Any] = {}
    for k, v in row.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and "_type" not in v:
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def _decode(path: Path) -> OfflineRun:
    pb = _pb()
    scan = scan_records(path)
    meta: dict[str, Any] = {"id": "", "name": "", "project": "", "group": "", "tags": ()}
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    alerts: list[dict[str, str]] = []
    exit_code = None
    start_time = 0.0
    producer = ""
    for off, payload in scan.records:
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                row: dict[str, Any] = {}
                for key, value in _items(rec.history.item):
                    _set(row, key, value)
                rows.append(_flatten(row))
            elif kind == "summary":
                for key, value in _items(rec.summary.update):
                    _set(summary, key, value)
                for it in rec.summary.remove:
                    _drop(summary, _key(it))
            elif kind == "config":
                _apply_config(config, rec.config)
            elif kind == "run":
                r = rec.run
                meta = {"id": r.run_id, "name": r.display_name or r.run_id,
                        "project": r.project, "group": r.run_group, "tags": tuple(r.tags)}
                start_time = r.start_time.seconds + r.start_time.nanos * 1e-9
                _apply_config(config, r.config)
            elif kind == "alert":
                alerts.append({"title": rec.alert.title, "text": rec.alert.text,
                               "level": rec.alert.level})
            elif kind == "exit":
                exit_code = rec.exit.exit_code
            elif kind == "header":
                producer = rec.header.version_info.producer.split("+")[0]
                if producer and not producer.startswith(TESTED_WANDB):
                    warnings.warn(f"{path}: written by wandb {producer}; this reader was "
                                  f"tested with files of wandb {TESTED_WANDB}x", stacklevel=3)
        except (ValueError, TypeError) as exc:  # DecodeError and JSONDecodeError are ValueErrors
            raise CorruptRunFile(path, off, f"undecodable record: {exc}") from exc
    config.pop("_wandb", None)
    summary.pop("_wandb", None)
    history = pd.DataFrame(rows) if rows else pd.DataFrame({"_step": pd.Series([], dtype="int64")})
    if "_step" in history.columns:
        history = history.sort_values("_step", kind="stable").reset_index(drop=True)
    return OfflineRun(config=config, summary=summary, history=history, alerts=alerts,
                      exit_code=exit_code, start_time=start_time, truncated=scan.truncated,
                      paths=(str(path),), wandb_version=producer, **meta)


def _apply_config(config: dict[str, Any], rec) -> None:
    for key, value in _items(rec.update):
        _set(config, key, value)
    for it in rec.remove:
        _drop(config, _key(it))


def _merge(segs: list[OfflineRun]) -> OfflineRun:
    if len(segs) == 1:
        return segs[0]
    parts = []
    for seg, nxt in zip(segs, segs[1:] + [None]):
        h = seg.history
        if nxt is not None and "_step" in h.columns and "_step" in nxt.history.columns \
                and len(nxt.history):
            # Steps an attempt logged after its last checkpoint are redone by the next one.
            h = h[h["_step"] < nxt.history["_step"].min()]
        parts.append(h)
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for s in segs:
        config.update(s.config)
        summary.update(s.summary)
    last = segs[-1]
    return OfflineRun(
        id=last.id, name=last.name, project=last.project, group=last.group, tags=last.tags,
        config=config, summary=summary,
        history=pd.concat(parts, ignore_index=True),
        alerts=[a for s in segs for a in s.alerts], exit_code=last.exit_code,
        start_time=segs[0].start_time, truncated=last.truncated,
        paths=tuple(p for s in segs for p in s.paths), wandb_version=last.wandb_version)
