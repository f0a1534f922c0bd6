"""Hostile checkpoint folders: every one raises a typed CheckpointError naming the file, never
hangs, never exhausts memory, never reads outside the folder.

Cases that would hang (a FIFO) or eat memory (/dev/zero, 10^7 empty experts) on a regression run
in a child process (probe_open.py) with a capped address space and a timeout, so a regression
fails the test instead of stalling the suite or the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from writers import gen, save_sharded, write_ct, write_gpt_oss

from workbench.checkpoint import (
    CheckpointError,
    ConfigError,
    CorruptShardError,
    ShapeMismatchError,
    UnsafePathError,
    open_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("probe_open.py")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return {"mxfp4": write_ct(root / "mxfp4", "mxfp4"), "int4": write_ct(root / "int4", "int4"),
            "gpt-oss": write_gpt_oss(root / "gpt-oss")}


@pytest.fixture
def copy(pristine, tmp_path):
    def make(kind="mxfp4", name=None) -> Path:
        dst = tmp_path / (name or kind)
        shutil.copytree(pristine[kind], dst)
        return dst
    return make


def probe(*dirs: Path, records: bool = False) -> list[dict]:
    """open_checkpoint in a child (address space capped at 8 GiB): one dict per folder."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__import__("workbench").__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, str(PROBE), *map(str, dirs)] + (["--records"] if records else [])
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def expect(err_type, folder, *, file: str | None = None):
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(folder)
    e = ei.value
    assert isinstance(e, err_type), f"{type(e).__name__}: {e}"
    if file is not None:
        assert e.path is not None and Path(e.path).name == file, (e.path, file)
    return e


# -- files that are not what they claim: symlink out, FIFO, devices, folders ------------------

HOSTILE_FILES = ["config.json", INDEX, "hf_quant_config.json", "model-00001-of-00002.safetensors"]


def _plant(d: Path, fname: str, kind: str, outside: Path) -> None:
    target = d / fname
    if fname == "hf_quant_config.json":
        # ModelOpt's file is read only when config.json has no quantization_config
        (d / "config.json").write_text(json.dumps({"model_type": "x"}))
        good = json.dumps({"quantization": {"quant_algo": "MXFP4"}})
    else:
        good = target.read_bytes() if target.exists() else b""
    if target.exists():
        target.unlink()
    if kind == "outside":  # a valid copy, outside the folder: today it is read
        outside.mkdir(exist_ok=True)
        src = outside / fname
        src.write_bytes(good if isinstance(good, bytes) else good.encode())
        target.symlink_to(src)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind in ("zero", "urandom"):
        target.symlink_to(f"/dev/{kind}")
    elif kind == "folder":
        target.mkdir()


@pytest.mark.parametrize("kind", ["outside", "fifo", "zero", "urandom", "folder"])
def test_non_regular_or_outside_files_are_refused(copy, tmp_path, kind):
    dirs = []
    for i, fname in enumerate(HOSTILE_FILES):
        d = copy(name=f"ck{i}")
        _plant(d, fname, kind, tmp_path / f"outside{i}")
        dirs.append(d)
    results = probe(*dirs)
    assert len(results) == len(HOSTILE_FILES), results
    for fname, r in zip(HOSTILE_FILES, results):
        assert "error" in r and not r["error"].startswith("UNEXPECTED"), (fname, r)
        assert r["error"] in ("UnsafePathError", "MissingFileError"), (fname, r)
        # the error names the hostile file (the shard error may name the index that sent us)
        assert fname in r["message"], (fname, r)
        if kind == "outside":
            assert "outside" in r["message"], r
        if kind == "fifo":
            assert "FIFO" in r["message"], r


def test_oversized_config_is_refused_unread(copy):
    d = copy()
    with open(d / "config.json", "wb") as f:  # valid JSON, 16 MiB of whitespace
        f.write(b" " * (16 * 1024 * 1024) + b"{}")
    e = expect(ConfigError, d, file="config.json")
    assert "limit" in str(e)


def test_dangling_config_link_is_an_error_not_a_default(copy):
    d = copy()
    (d / "config.json").unlink()
    (d / "config.json").symlink_to(d / "gone.json")
    expect(CheckpointError, d, file="config.json")


def _hub(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    return snap, blobs


def test_hub_blobs_link_to_root_cannot_reach_outside(pristine, tmp_path):
    # a fake hub cache whose blobs/ is a link to "/": every snapshot link then resolves to any
    # absolute path; here to a valid copy of the checkpoint outside the repository
    outside = tmp_path / "outside"
    shutil.copytree(pristine["mxfp4"], outside)
    snap, blobs = _hub(tmp_path)
    blobs.symlink_to("/")
    for f in outside.iterdir():
        (snap / f.name).symlink_to(Path("../../blobs") / str(f).lstrip("/"))
    assert (snap / "config.json").read_text() == (outside / "config.json").read_text()
    e = expect(UnsafePathError, snap)
    assert "outside" in str(e)
    # the real layout (links into the repository's own blobs/) still opens
    snap2, blobs2 = _hub(tmp_path / "good")
    blobs2.mkdir()
    for f in pristine["mxfp4"].iterdir():
        shutil.copy(f, blobs2 / f.name)
        (snap2 / f.name).symlink_to(Path("../../blobs") / f.name)
    assert open_checkpoint(snap2).layout == "compressed-tensors"


# -- quantization_config values of the wrong type ---------------------------------------------

def _edit_qc(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def _raw_qc(d: Path, key_path: list[str], raw: str) -> None:
    """Put `raw` JSON text (not expressible through json.dumps) at a path in the config."""
    marker = "__RAW_VALUE__"

    def put(q):
        node = q
        for k in key_path[:-1]:
            node = node[k]
        node[key_path[-1]] = marker
    _edit_qc(d, put)
    text = (d / "config.json").read_text().replace(json.dumps(marker), raw)
    (d / "config.json").write_text(text)


GROUP = ["config_groups", "group_0"]
WEIGHTS = [*GROUP, "weights"]


@pytest.mark.parametrize("case", [
    "format-list", "format-dict", "format-infinity", "group-format-list", "group_size-5000-digits",
    "format-deep-nesting", "num_bits-string", "targets-bad-regex", "ignore-bad-regex",
    "targets-empty-string", "weights-list", "symmetric-string", "quant_method-list",
])
def test_wrong_typed_compressed_tensors_config(copy, case):
    d = copy()
    if case == "format-list":
        _edit_qc(d, lambda q: q.update(format=["mxfp4-pack-quantized"]))
    elif case == "format-dict":
        _edit_qc(d, lambda q: q.update(format={"a": 1}))
    elif case == "format-infinity":
        _raw_qc(d, ["format"], "Infinity")
    elif case == "group-format-list":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"].update(format=[1]))
    elif case == "group_size-5000-digits":
        _raw_qc(d, [*WEIGHTS, "group_size"], "9" * 5000)
    elif case == "format-deep-nesting":
        _raw_qc(d, ["format"], "[" * 100_000 + "]" * 100_000)
    elif case == "num_bits-string":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits="4"))
    elif case == "targets-bad-regex":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"].update(targets=["re:(unclosed"]))
    elif case == "ignore-bad-regex":
        _edit_qc(d, lambda q: q.update(ignore=["re:*oops"]))
    elif case == "targets-empty-string":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"].update(targets=[""]))
    elif case == "weights-list":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"].update(weights=[4]))
    elif case == "symmetric-string":
        _edit_qc(d, lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric="no"))
    elif case == "quant_method-list":
        _edit_qc(d, lambda q: q.update(quant_method=["compressed-tensors"]))
    e = expect(ConfigError, d, file="config.json")
    assert "\n" not in e.one_line() and len(e.one_line()) <= 400


def test_wrong_typed_gpt_oss_and_modelopt_config(copy):
    d = copy("gpt-oss")
    _edit_qc(d, lambda q: q.update(modules_to_not_convert=["*.self_attn"]))  # not a regex
    e = expect(ConfigError, d, file="config.json")
    assert "modules_to_not_convert[0]" in str(e)
    d = copy(name="modelopt")
    (d / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "modelopt", "quant_algo": {"NVFP4": 1}}}))
    expect(ConfigError, d, file="config.json")


@pytest.mark.parametrize("group_size", ["abc", 0.5, 0, -32, True])
def test_int4_group_size_must_be_a_positive_integer(copy, group_size):
    d = copy("int4")
    _edit_qc(d, lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=group_size))
    e = expect(ConfigError, d, file="config.json")
    assert "group_size" in str(e)


def _ct_fp8_block(folder: Path, block_structure, data_shape=(128, 128), scale_shape=(1, 1),
                  targets=("Linear",)):
    name = "model.layers.0.self_attn.q_proj"
    w = gen(data_shape, 1, torch.float32).clamp(-1, 1).to(torch.float8_e4m3fn)
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": [],
          "config_groups": {"group_0": {"targets": list(targets), "weights": {
              "num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
              "block_structure": block_structure}}}}
    return save_sharded(folder, {f"{name}.weight": w,
                                 f"{name}.weight_scale": torch.ones(scale_shape)},
                        config={"model_type": "x", "quantization_config": qc})


@pytest.mark.parametrize("bs", [[0, 0], [128, 0], [128], "128x128"])
def test_fp8_block_structure_must_be_two_positive_integers(tmp_path, bs):
    d = _ct_fp8_block(tmp_path / "ck", bs)
    e = expect(ConfigError, d, file="config.json")
    assert "block_structure" in str(e)
    assert open_checkpoint(_ct_fp8_block(tmp_path / "ok", [128, 128])).layout == \
        "compressed-tensors"


@pytest.mark.parametrize("entry", [".", "./", "sub/", ["model-00001-of-00002.safetensors"],
                                   {"a": 1}, 7])
def test_index_entry_that_is_no_file_name(copy, entry):
    d = copy()
    idx = json.loads((d / INDEX).read_text())
    victim = next(iter(idx["weight_map"]))
    idx["weight_map"][victim] = entry
    (d / INDEX).write_text(json.dumps(idx))
    e = expect(UnsafePathError, d, file=INDEX)
    assert e.tensor == victim


def test_index_with_huge_integer_or_deep_nesting(copy):
    for raw in ("9" * 5000, "[" * 100_000 + "]" * 100_000):
        d = copy(name=f"ck{len(raw)}")
        (d / INDEX).write_text('{"metadata": ' + raw + ', "weight_map": {}}')
        expect(ConfigError, d, file=INDEX)


# -- headers that lie ---------------------------------------------------------------------------

def _raw_shard(path: Path, header: dict, data: bytes) -> None:
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def test_ten_million_empty_experts_are_refused_at_once(tmp_path):
    # a 248-byte gpt-oss shard: 10^7 experts of 0 rows hold 0 bytes, so the byte-size checks
    # pass; building an expert record for each took minutes and unbounded memory
    E = 10**7
    base = "model.layers.0.mlp.experts.gate_up_proj"
    q = tmp_path / "quantized"
    q.mkdir()
    _raw_shard(q / "model.safetensors", {
        f"{base}_blocks": {"dtype": "U8", "shape": [E, 0, 2, 16], "data_offsets": [0, 0]},
        f"{base}_scales": {"dtype": "U8", "shape": [E, 0, 2], "data_offsets": [0, 0]}}, b"")
    (q / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": {
        "quant_method": "mxfp4"}}))
    assert (q / "model.safetensors").stat().st_size < 300
    dense = tmp_path / "dense"
    dense.mkdir()
    _raw_shard(dense / "model.safetensors", {
        base: {"dtype": "BF16", "shape": [E, 64, 0], "data_offsets": [0, 0]}}, b"")
    (dense / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    for r in probe(q, dense, records=True):
        assert r.get("error") == "ShapeMismatchError", r
        assert "model.safetensors" in r["message"] and "no elements" in r["message"], r


def test_hole_between_tensors_is_found_at_open(tmp_path):
    a, b = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.up_proj.weight"
    save_sharded(tmp_path, {a: gen((4, 4)), b: gen((4, 4))})
    _raw_shard(tmp_path / "model.safetensors", {
        a: {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]},
        b: {"dtype": "BF16", "shape": [4, 4], "data_offsets": [40, 72]}}, bytes(72))
    e = expect(CorruptShardError, tmp_path, file="model.safetensors")
    assert e.tensor == b and "hole of 8 bytes" in str(e)


def test_fp8_block_data_and_scale_ranks_must_fit_at_open(tmp_path):
    name = "model.layers.0.mlp.experts.0.up_proj.weight"
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    w = gen((2, 128, 128), 1, torch.float32).to(torch.float8_e4m3fn)
    save_sharded(tmp_path / "ds", {name: w, name + "_scale_inv": torch.ones(())},
                 config={"model_type": "deepseek_v3", "quantization_config": qc})
    e = expect(ShapeMismatchError, tmp_path / "ds", file="model.safetensors")
    assert e.tensor == name and "2-D" in str(e)
    # compressed-tensors' FP8 block strategy: 3-D data with a per-row-looking scale (a regex
    # target: a 3-D tensor is no Linear)
    d = _ct_fp8_block(tmp_path / "ct", [128, 128], data_shape=(2, 128, 128), scale_shape=(2, 1),
                      targets=["re:.*q_proj$"])
    expect(ShapeMismatchError, d, file="model.safetensors")


def test_shard_header_with_huge_integer_is_a_corrupt_shard(tmp_path):
    save_sharded(tmp_path, {"model.layers.0.mlp.down_proj.weight": gen((4, 4))})
    hb = b'{"x": {"dtype": "BF16", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb)
    expect(CorruptShardError, tmp_path, file="model.safetensors")


def test_cli_reports_a_fifo_config_in_one_line(copy):
    d = copy()
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(d), "--out",
                        str(d.parent / "out")], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, check=False)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json" in lines[0] and "FIFO" in lines[0], r.stderr


def test_save_file_roundtrip_still_opens(tmp_path):
    # the contiguity rule is safetensors' own: what save_file writes always passes
    save_file({"a.weight": gen((3, 5)), "b.weight": gen((2, 2)), "c": torch.zeros(0)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    assert set(open_checkpoint(tmp_path).index.names()) == {"a.weight", "b.weight", "c"}
