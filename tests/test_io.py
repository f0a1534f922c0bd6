"""workbench._io: the one atomic writer. Readers see the old complete file or the new complete
one, whatever point the writer dies at; and no other module writes files its own way."""

from __future__ import annotations

import ast
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workbench import _io
from workbench._io import atomic_open, atomic_write_bytes, atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[1]


def _leftovers(folder: Path, keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def test_round_trip_and_nothing_left_over(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"x": [1, 2]})
    atomic_write_json(p, {"x": [3]}, indent=None, sort_keys=True)
    assert json.loads(p.read_text()) == {"x": [3]}
    assert p.read_text().endswith("\n")
    atomic_write_text(tmp_path / "t.txt", "héllo")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\xff")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["a.json", "b.bin", "t.txt"]


def test_fsync_file_then_rename_then_fsync_folder(tmp_path, monkeypatch):
    """The durability order: data on disk before the name points at it, the rename on disk after."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(src, dst):
        assert Path(src).parent == Path(dst).parent, "the temp file must be in the same folder"
        assert Path(src).name.startswith("."), "a temp file readers' globs skip"
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(_io.os, "fsync", fsync)
    monkeypatch.setattr(_io.os, "replace", replace)
    atomic_write_json(tmp_path / "a.json", {"k": 1})
    assert events == ["fsync-file", "replace", "fsync-dir"]


@pytest.mark.parametrize("where", ["before-rename", "while-writing", "unserialisable"])
def test_a_failed_write_leaves_the_old_file_intact(tmp_path, monkeypatch, where):
    p = tmp_path / "state.json"
    atomic_write_json(p, {"old": True})
    before = p.read_bytes()
    if where == "before-rename":
        def boom(src, dst):
            raise OSError("disk gone")

        monkeypatch.setattr(_io.os, "replace", boom)
        with pytest.raises(OSError, match="disk gone"):
            atomic_write_json(p, {"new": True})
    elif where == "while-writing":
        with pytest.raises(RuntimeError), atomic_open(p) as f:
            f.write('{"new": ')
            f.flush()
            raise RuntimeError("killed mid-write")
    else:
        with pytest.raises(TypeError):
            atomic_write_json(p, {"new": object()})
    assert p.read_bytes() == before
    assert _leftovers(tmp_path, p.name) == []  # the temp file is cleaned up


def test_sigkill_before_the_rename_keeps_the_old_file(tmp_path):
    """A real crash: the child dies (SIGKILL, no cleanup runs) at the rename. The old file is
    intact; what is left is a dot-named temp file, and the next write succeeds beside it."""
    p = tmp_path / "state.json"
    atomic_write_json(p, {"old": True})
    before = p.read_bytes()
    child = textwrap.dedent(f"""
        import os, signal
        from workbench import _io
        _io.os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)
        _io.atomic_write_json({str(p)!r}, {{"new": list(range(1000))}})
    """)
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert p.read_bytes() == before
    (left,) = _leftovers(tmp_path, p.name)
    assert left.startswith(".state.json.") and left.endswith(".tmp")
    # the temp file was complete and fsynced before the (never done) rename
    assert json.loads((tmp_path / left).read_text()) == {"new": list(range(1000))}
    atomic_write_json(p, {"next": 1})
    assert json.loads(p.read_text()) == {"next": 1}


def test_refuses_append_and_read_modes(tmp_path):
    for mode in ("a", "r+", "w+"):
        with pytest.raises(ValueError, match="whole files"), atomic_open(tmp_path / "x", mode):
            pass
    assert list(tmp_path.iterdir()) == []


# -- no module writes a file its own way ------------------------------------------------------
# Writes of whole files go through workbench._io. Folder swaps (os.rename of a finished .tmp-*
# folder, in the exporter, the checkpointer and the dataset cache) and appends are not file
# writes and stay where they are.
_BANNED = {("os", "replace"), ("json", "dump")}
_BANNED_METHODS = {"write_text", "write_bytes"}


def _own_writes(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        if (owner, f.attr) in _BANNED or f.attr in _BANNED_METHODS:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner or '...'}.{f.attr}")
    return bad


def test_every_writer_uses_the_atomic_helper():
    files = [p for p in sorted((ROOT / "workbench").rglob("*.py")) if p.name != "_io.py"]
    bad = [b for p in files for b in _own_writes(p)]
    assert not bad, "write files through workbench._io:\n" + "\n".join(bad)


def test_the_writer_check_sees_an_own_write(tmp_path, monkeypatch):
    src = tmp_path / "w.py"
    src.write_text("import os, json\nfrom pathlib import Path\n"
                   "def f(p, o):\n    Path(p).write_text(json.dumps(o))\n"
                   "    os.replace(p, p)\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [b.split(" ")[1] for b in _own_writes(src)] == ["....write_text", "os.replace"]


def test_new_files_get_the_umask_mode_and_rewrites_keep_theirs(tmp_path):
    """mkstemp's 0600 must not leak: a shared run folder's files stay readable by the group and
    others as a plain open() would leave them, and a rewrite keeps the file's own mode."""
    old = os.umask(0o027)
    try:
        new = atomic_write_text(tmp_path / "new.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(new.stat().st_mode) == 0o640
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    kept.chmod(0o604)
    atomic_write_text(kept, "new")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o604 and kept.read_text() == "new"


def test_publish_fsyncs_then_renames_within_the_folder(tmp_path, monkeypatch):
    """A file built by appends (a resumable download) becomes visible the way atomic_open's
    temporary does: data durable before the name points at it, the rename durable after."""
    part = tmp_path / "w.bin.incomplete"
    part.write_bytes(b"abc")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(_io.os, "fsync", lambda fd: (events.append(
        "fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file"), real_fsync(fd)))
    monkeypatch.setattr(_io.os, "replace", lambda a, b: (events.append("replace"),
                                                          real_replace(a, b)))
    assert _io.publish(part, tmp_path / "w.bin").read_bytes() == b"abc"
    assert events == ["fsync-file", "replace", "fsync-dir"] and not part.exists()
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / "x"
    other.write_bytes(b"")
    with pytest.raises(ValueError, match="within one folder"):
        _io.publish(other, tmp_path / "x")


# --- read_json: the reading side ------------------------------------------------------------

def test_read_json_reads_a_document(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"a": [1, 2.5, "\\u00e9"]}')
    assert _io.read_json(p) == {"a": [1, 2.5, "é"]}


def test_read_json_refuses_a_file_over_its_cap_reading_no_more_than_the_cap(tmp_path,
                                                                             monkeypatch):
    p = tmp_path / "big.json"
    p.write_text("[" + "0," * 600 + "0]")
    reads = []
    real_read = os.read
    monkeypatch.setattr(_io.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(_io.JSONFileError, match=r"big\.json: the marker is larger than 1000 bytes"):
        _io.read_json(p, cap=1000, what="the marker")
    assert sum(reads) <= 1001  # the cap plus the one byte that tells


@pytest.mark.timeout(20)
def test_read_json_does_not_block_on_a_fifo(tmp_path):
    fifo = tmp_path / "result.json"
    os.mkfifo(fifo)
    with pytest.raises(_io.JSONFileError, match="result.json: JSON file is not a regular file"):
        _io.read_json(fifo)  # a plain open() would wait for a writer forever


@pytest.mark.parametrize(("raw", "reason"), [
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": 1', "is not valid JSON"),
    (b"1" * 5000, "is not valid JSON"),  # int() refuses over 4300 digits
])
def test_read_json_failures_are_one_line_naming_the_file(tmp_path, raw, reason):
    p = tmp_path / "config.json"
    p.write_bytes(raw)
    with pytest.raises(_io.JSONFileError) as e:
        _io.read_json(p, what="config.json")
    assert str(e.value).startswith(f"{p}: config.json ") and reason in str(e.value)
    assert "\n" not in str(e.value) and e.value.path == p


def test_read_json_of_a_missing_file_or_a_folder(tmp_path):
    with pytest.raises(_io.JSONFileError, match="cannot read"):
        _io.read_json(tmp_path / "nope.json")
    with pytest.raises(_io.JSONFileError, match="not a regular file"):
        _io.read_json(tmp_path)
