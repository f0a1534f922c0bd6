"""The allow-listed reader of DCP's `.metadata` pickle: real DCP metadata reads back equal to
what `pickle.load` gives; crafted pickles are refused before any of their code runs; damaged
or escaping storage entries are refused naming the file."""

from __future__ import annotations

import os
import pickle
import sys
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from workbench.checkpoint.dcp_metadata import (
    SafeFileSystemReader,
    UnsafeMetadataError,
    load_metadata,
)
from workbench.checkpoint.errors import CheckpointError


@pytest.fixture
def ckpt(tmp_path):
    """A real DCP checkpoint of assorted dtypes and shapes (one process)."""
    sd = {"w": torch.randn(4, 6), "b": torch.zeros(3, dtype=torch.bfloat16),
          "step": torch.tensor(7), "mask": torch.ones(2, 2, dtype=torch.bool),
          "fp8": torch.zeros(8, dtype=torch.float8_e4m3fn)}
    path = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    return path, sd


def test_real_metadata_reads_as_pickle_does_and_loads(ckpt):
    path, sd = ckpt
    with open(path / ".metadata", "rb") as f:
        ref = pickle.load(f)
    md = load_metadata(path)
    assert md == ref
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=SafeFileSystemReader(path), no_dist=True)
    for k in sd:
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8)), k


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _crafted(kind: str, marker) -> bytes:
    if kind == "os.system":
        return pickle.dumps(_System(f"touch {marker}"))
    if kind == "inside-metadata":  # a valid Metadata whose planner_data hides the call
        return pickle.dumps(Metadata(state_dict_metadata={}, planner_data=_System(f"touch {marker}"),
                                     storage_data={}))
    if kind == "exec":
        return (b"cbuiltins\nexec\n(Vopen(%r, 'w').close()\ntR." % str(marker).encode())
    if kind == "build-on-class":
        # GLOBAL an allowed class, then BUILD (None, {"__eq__": ...}) would setattr on the class
        # itself for the whole process.
        return (b"ctorch.distributed.checkpoint.metadata\nMetadata\n"
                b"(N}V__eq__\nNstb.")
    if kind == "reduce-allowed-class-with-object":  # torch.Size(<an exec'ing object>)
        return b"ctorch\nSize\n(cbuiltins\neval\n(V1\ntRtR."
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["os.system", "inside-metadata", "exec", "build-on-class",
                                  "reduce-allowed-class-with-object"])
def test_crafted_metadata_is_refused_and_runs_nothing(ckpt, kind):
    path, _ = ckpt
    marker = path.parent / "pwned"
    (path / ".metadata").write_bytes(_crafted(kind, marker))
    eq = Metadata.__eq__
    with pytest.raises(UnsafeMetadataError) as ei:
        load_metadata(path)
    assert ".metadata" in str(ei.value)
    assert not marker.exists()
    assert Metadata.__eq__ is eq


@pytest.fixture
def importable(tmp_path, monkeypatch):
    """(name, marker): a module of a fresh name, in a folder put on `sys.path` for this test,
    whose top-level code writes `marker` when it is imported."""
    site = tmp_path / "site"
    site.mkdir()
    name = f"wb_marker_{uuid.uuid4().hex}"
    marker = tmp_path / f"{name}.imported"
    (site / f"{name}.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(site))  # restored after the test, import caches cleared
    yield name, marker
    sys.modules.pop(name, None)


def _global_only(module: str, name: str) -> bytes:
    """A pickle whose only opcode is GLOBAL `module.name` (then STOP): unpickling it imports
    `module`, running its top-level code, before any check of what it returns."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n."


def test_the_crafted_global_imports_its_module_under_plain_pickle(importable):
    """The attack below is real: `pickle.loads` of those bytes runs the module's code."""
    name, marker = importable
    assert pickle.loads(_global_only(name, "VALUE")) == 7
    assert marker.read_text() == "imported"


def _dcp_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.empty(4, 6)}, storage_reader=SafeFileSystemReader(path),
                 no_dist=True)


@pytest.mark.parametrize("what", ["module-import", "os.system"])
def test_a_global_outside_the_allow_list_is_refused_before_its_module_is_imported(
        ckpt, importable, what):
    """The allow-list of globals is the only guard against a `.metadata` that imports a module:
    no later check can undo an import that already ran its code."""
    path, _ = ckpt
    name, marker = importable
    data = _global_only(name, "VALUE") if what == "module-import" else b"cos\nsystem\n."
    (path / ".metadata").write_bytes(data)
    # the reader the trainer's resume calls first, then DCP's own load through it (which wraps
    # the reader's error in its CheckpointException)
    for read in (lambda: load_metadata(path), SafeFileSystemReader(path).read_metadata):
        with pytest.raises(UnsafeMetadataError, match="not a DCP metadata type") as ei:
            read()
        assert ei.value.path == str(path / ".metadata")
    with pytest.raises(CheckpointException, match="refused, not unpickled further"):
        _dcp_load(path)
    assert not marker.exists()
    assert name not in sys.modules


def test_a_pickled_object_entry_is_refused_for_tensor_only_checkpoints(ckpt):
    """DCP's default planner torch.load(weights_only=False)s BytesStorageMetadata entries."""
    path, _ = ckpt
    md = load_metadata(path)
    md.state_dict_metadata["step"] = BytesStorageMetadata()
    tensor_entry = next(v for k, v in md.storage_data.items() if k.fqn == "step")
    md.storage_data[MetadataIndex("step")] = tensor_entry  # the bytes DCP would torch.load
    (path / ".metadata").write_bytes(pickle.dumps(md))
    load_metadata(path, allow_bytes=True)  # a valid DCP form in general ...
    with pytest.raises(CheckpointError, match="pickled-object entry") as ei:
        load_metadata(path, allow_bytes=False)  # ... but never in the trainer's checkpoints
    assert ei.value.tensor == "step"


@pytest.mark.parametrize("damage, match", [
    ("escape", "not a plain file name"), ("absolute", "not a plain file name"),
    ("truncated", "truncated"), ("missing-file", "file is missing"),
])
def test_storage_entries_stay_inside_the_folder_and_the_file(ckpt, damage, match):
    path, _ = ckpt
    md = load_metadata(path)
    info = next(iter(md.storage_data.values()))
    if damage == "escape":
        info.relative_path = "../outside.distcp"
    elif damage == "absolute":
        info.relative_path = "/etc/passwd"
    elif damage == "truncated":
        with open(path / info.relative_path, "r+b") as f:
            f.truncate(info.offset + info.length - 1)
    else:
        os.unlink(path / info.relative_path)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match=match):
        load_metadata(path)


@pytest.mark.parametrize("what", ["missing", "garbage", "empty", "fifo", "symlink", "list"])
def test_unreadable_metadata_is_a_checkpoint_error_naming_it(ckpt, what):
    path, _ = ckpt
    md_path = path / ".metadata"
    md_path.unlink()
    if what == "garbage":
        md_path.write_bytes(os.urandom(300))
    elif what == "empty":
        md_path.write_bytes(b"")
    elif what == "fifo":
        os.mkfifo(md_path)  # must not block
    elif what == "symlink":
        (path.parent / "elsewhere").write_bytes(pickle.dumps([1]))
        md_path.symlink_to(path.parent / "elsewhere")
    elif what == "list":
        md_path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(CheckpointError) as ei:
        load_metadata(path)
    assert ei.value.path == str(md_path)
