"""The offline reader recovers exactly what was logged to real wandb offline runs."""

from __future__ import annotations

import math
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from track_runs import big_run, curve_rows, exact_run

from workbench.track import CorruptRunFile, find_runs, read_run
from workbench.track.wandb_file import BLOCK_SIZE, FILE_HEADER, RECORD_HEADER, scan_records


def _one(wandb_dir, group):
    runs = find_runs(wandb_dir, group=group)
    assert len(runs) == 1, [r.name for r in runs]
    return runs[0]


def _same(logged, read) -> bool:
    # JSON keeps no int/float distinction (1.0 is written "1"), but bools and strings stay.
    if isinstance(logged, float) and math.isnan(logged):
        return isinstance(read, float) and math.isnan(read)
    if isinstance(logged, bool) != isinstance(read, (bool, np.bool_)):
        return False
    return logged == read


def test_history_config_summary_exact(wandb_dir):
    spec = exact_run()
    run = _one(wandb_dir, "exact")
    assert (run.name, run.group, run.tags, run.project) == ("exact", "exact", ("qat", "tiny"),
                                                            "wb-tests")
    assert run.finished and run.exit_code == 0 and not run.truncated
    assert run.config == {**spec["config"], **spec["config_update"]}
    h = run.history.set_index("_step")
    assert list(h.index) == [r["step"] for r in spec["rows"]]
    for row in spec["rows"]:
        got = h.loc[row["step"]]
        for k, v in row["metrics"].items():
            if isinstance(v, dict):  # nested metrics come back flattened as "a.b"
                for kk, vv in v.items():
                    assert got[f"{k}.{kk}"] == vv
            else:
                assert _same(v, got[k]), (row["step"], k, v, got[k])
    # summary: the explicit values, and the last logged value of each metric
    assert run.summary["best_loss"] == 0.125
    assert run.summary["verdict"] == {"ok": True, "n": 3}
    assert run.summary["third"] == spec["rows"][-1]["metrics"]["third"]
    assert run.summary["loss"] == -math.inf
    assert [(a["title"], a["text"]) for a in run.alerts] == [tuple(x) for x in spec["alerts"]]


def test_media_logged_as_wandb_objects(wandb_dir):
    run = _one(wandb_dir, "exact")
    h = run.history.set_index("_step")
    table, image = h.loc[2, "errors"], h.loc[3, "curve"]
    assert table["_type"] == "table-file" and table["nrows"] == 3 and table["ncols"] == 3
    # a named (multi-)index is kept as columns
    assert h.loc[2, "errors_by_expert"]["ncols"] == 3
    assert image["_type"] == "image-file" and image["format"] == "png"
    run_dir = wandb_dir.glob(f"offline-run-*-{run.id}")
    png = next(run_dir) / "files" / image["path"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_records_span_blocks(wandb_dir):
    run = _one(wandb_dir, "big")
    scan = scan_records(run.paths[0])
    sizes = [len(p) for _, p in scan.records]
    assert max(sizes) > 2 * BLOCK_SIZE  # the 100 kB string: first, middle(s) and last fragment
    assert max(off for off, _ in scan.records) > 4 * BLOCK_SIZE
    spec = big_run()
    h = run.history.set_index("_step")
    assert h.loc[100, "blob"] == spec["rows"][100]["metrics"]["blob"]
    for s in (0, 57, 199):
        for k, v in spec["rows"][s]["metrics"].items():
            assert h.loc[s, k] == v


def test_resumed_segments_merge_into_one_curve(wandb_dir):
    run = _one(wandb_dir, "resume")
    assert len(run.paths) == 2 and run.id == "resume01"
    # steps 0-2 from the first attempt, 3-7 redone by the second
    expected = [10.0 + s for s in range(3)] + [20.0 + s for s in range(3, 8)]
    assert list(run.history["_step"]) == list(range(8))
    assert list(run.history["loss"]) == expected
    assert run.config == {"attempt": 2}
    first = read_run(run.paths[0])  # paths are in attempt order
    assert first.config == {"attempt": 1}
    assert list(first.history["loss"]) == [10.0 + s for s in range(6)]


def test_find_runs_filters_group(wandb_dir):
    names = {r.name for r in find_runs(wandb_dir, group="cmp")}
    assert names == {"bf16-s0", "mxfp4-s0", "nvfp4-s0", "nan-s0", "bf16-s1", "mxfp4-s1"}
    assert find_runs(wandb_dir, group="no-such-group") == []
    bf16 = next(r for r in find_runs(wandb_dir, group="cmp") if r.name == "bf16-s0")
    assert list(bf16.history["loss"]) == [r["metrics"]["loss"] for r in curve_rows()]


def _copy(run, tmp_path):
    dst = tmp_path / "run-copy.wandb"
    shutil.copy(run.paths[0], dst)
    return dst


def test_flipped_byte_is_a_typed_error(wandb_dir, tmp_path):
    src = _copy(_one(wandb_dir, "exact"), tmp_path)
    data = bytearray(src.read_bytes())
    scan = scan_records(src)
    off, payload = scan.records[len(scan.records) // 2]
    data[off + RECORD_HEADER.size + len(payload) // 2] ^= 0x01
    src.write_bytes(bytes(data))
    with pytest.raises(CorruptRunFile) as e:
        read_run(src)
    assert e.value.offset == off and "crc32" in str(e.value) and str(src) in str(e.value)


def test_bad_header_and_bad_length(wandb_dir, tmp_path):
    src = _copy(_one(wandb_dir, "exact"), tmp_path)
    data = src.read_bytes()
    src.write_bytes(b":W&B\x00\x00\x00" + data[7:])
    with pytest.raises(CorruptRunFile, match="file header"):
        read_run(src)
    # a record whose (crc-unprotected) length runs past its block
    bad = bytearray(data)
    crc, _, rtype = RECORD_HEADER.unpack_from(bad, len(FILE_HEADER))
    RECORD_HEADER.pack_into(bad, len(FILE_HEADER), crc, BLOCK_SIZE, rtype)
    src.write_bytes(bytes(bad))
    with pytest.raises(CorruptRunFile, match="runs past") as e:
        read_run(src)
    assert e.value.offset == len(FILE_HEADER)


def test_truncated_file_reads_prefix(wandb_dir, tmp_path):
    src = _copy(_one(wandb_dir, "big"), tmp_path)
    full = read_run(src)
    scan = scan_records(src)
    cut = scan.records[len(scan.records) // 2][0] + 20  # inside a record
    src.write_bytes(src.read_bytes()[:cut])
    part = read_run(src)
    assert part.truncated and not part.finished
    assert 0 < len(part.history) < len(full.history)
    pd.testing.assert_frame_equal(part.history, full.history.iloc[: len(part.history)]
                                  [part.history.columns], check_dtype=False)


def test_crc_is_plain_crc32_over_type_and_data(wandb_dir):
    # Independent re-derivation of the framing for the first record.
    data = Path(_one(wandb_dir, "exact").paths[0]).read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"
    crc, length, rtype = struct.unpack_from("<IHB", data, 7)
    assert rtype in (1, 2) and zlib.crc32(bytes([rtype]) + data[14:14 + length]) == crc


def test_read_run_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_run(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no run-"):
        read_run(tmp_path)


@pytest.mark.slow
def test_live_run_is_readable_while_written(tmp_path):
    import json
    import subprocess
    import sys
    import time

    from track_runs import WRITER, wandb_env
    hold = tmp_path / "release"
    rows = [{"step": s, "metrics": {"loss": 1.0 / (s + 1)}} for s in range(30)]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"dir": str(tmp_path), "runs": [
        {"name": "live", "group": "live", "rows": rows, "live_hold": str(hold)}]}))
    proc = subprocess.Popen([sys.executable, str(WRITER), str(spec)], env=wandb_env(tmp_path),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, seen = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            runs = find_runs(tmp_path) if list(tmp_path.rglob("run-*.wandb")) else []
            if runs and len(runs[0].history) >= 29:  # the newest step stays open until finish
                seen = runs[0]
                break
            time.sleep(0.5)
        assert seen is not None, "no history appeared in the live run file within 90 s"
        assert not seen.finished
        assert list(seen.history["loss"][:29]) == [r["metrics"]["loss"] for r in rows[:29]]
    finally:
        hold.touch()
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    done = find_runs(tmp_path)[0]
    assert done.finished and list(done.history["loss"]) == [r["metrics"]["loss"] for r in rows]


def test_version_pin(wandb_dir, monkeypatch):
    import wandb

    run = read_run(_one(wandb_dir, "exact").paths[0])
    assert run.wandb_version == wandb.__version__  # written by the installed wandb
    monkeypatch.setattr(wandb, "__version__", "0.40.0")
    with pytest.warns(UserWarning, match=r"tested with wandb 0\.31\.x; installed wandb is 0\.40"):
        read_run(run.paths[0])


def test_file_from_other_wandb_version_warns(tmp_path):
    from wandb.proto import wandb_internal_pb2 as pb

    recs = [pb.Record(header=pb.HeaderRecord(version_info=pb.VersionInfo(producer="0.99.1+x"))),
            pb.Record(run=pb.RunRecord(run_id="abc", display_name="n", run_group="g")),
            pb.Record(history=pb.HistoryRecord(item=[
                pb.HistoryItem(key="_step", value_json="0"),
                pb.HistoryItem(key="loss", value_json="2.5")]))]
    body = b""
    for r in recs:  # small records: one FULL (type 1) physical record each
        data = r.SerializeToString()
        body += struct.pack("<IHB", zlib.crc32(bytes([1]) + data), len(data), 1) + data
    f = tmp_path / "run-abc.wandb"
    f.write_bytes(FILE_HEADER + body)
    with pytest.warns(UserWarning, match=r"written by wandb 0\.99\.1"):
        run = read_run(f)
    assert (run.id, run.name, run.group, run.wandb_version) == ("abc", "n", "g", "0.99.1")
    assert run.history.to_dict("records") == [{"_step": 0, "loss": 2.5}]
    assert not run.finished and not run.truncated
