"""Every bad input gives its CheckpointError subclass, naming the file and the tensor; none
hangs, crashes the interpreter or returns garbage (fuzzed headers run in a subprocess)."""

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
from safetensors.torch import load_file, save_file
from writers import write_ct, write_gpt_oss

from workbench.checkpoint import (
    CheckpointError,
    ConfigError,
    CorruptShardError,
    DtypeMismatchError,
    FormatMismatchError,
    MissingCompanionError,
    MissingFileError,
    ShapeMismatchError,
    UncoveredTensorError,
    UnknownFormatError,
    UnsafePathError,
    ValidationError,
    open_checkpoint,
)

EXPERT = "model.layers.1.mlp.experts.2.up_proj"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return {"mxfp4": write_ct(root / "mxfp4", "mxfp4"), "nvfp4": write_ct(root / "nvfp4", "nvfp4"),
            "gpt-oss": write_gpt_oss(root / "gpt-oss")}


@pytest.fixture
def ck_copy(pristine, tmp_path):
    def make(kind="mxfp4") -> Path:
        dst = tmp_path / kind
        shutil.copytree(pristine[kind], dst)
        return dst
    return make


def weight_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def edit_tensors(folder: Path, fn) -> None:
    """Rewrite every shard through fn(dict) -> dict and keep the index consistent."""
    wmap = {}
    for f in sorted(folder.glob("*.safetensors")):
        t = fn(load_file(str(f)))
        save_file(t, str(f))
        wmap.update({n: f.name for n in t})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))


def expect(err_type, folder, *, file=None, tensor=None):
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(folder)
    e = ei.value
    assert isinstance(e, err_type), f"{type(e).__name__}: {e}"
    if file is not None:
        assert e.path is not None and Path(e.path).name == Path(file).name, (e.path, file)
        assert str(Path(file).name) in str(e)
    if tensor is not None:
        assert e.tensor == tensor, (e.tensor, tensor)
        assert tensor in str(e)
    return e


def shard_of(folder: Path, tensor: str) -> Path:
    return folder / weight_map(folder)[tensor]


def test_truncated_shard(ck_copy):
    d = ck_copy()
    f = shard_of(d, f"{EXPERT}.weight_packed")
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    e = expect(CorruptShardError, d, file=f)
    assert e.tensor is not None and "truncated" in str(e)


def test_empty_shard(ck_copy):
    d = ck_copy()
    f = shard_of(d, f"{EXPERT}.weight_packed")
    f.write_bytes(b"")
    e = expect(CorruptShardError, d, file=f)
    assert e.tensor in weight_map(d) and weight_map(d)[e.tensor] == f.name


@pytest.mark.parametrize("how", ["json", "length", "offsets", "overlap", "dtype"])
def test_corrupt_header(ck_copy, how):
    d = ck_copy()
    f = shard_of(d, f"{EXPERT}.weight_packed")
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    name = f"{EXPERT}.weight_packed" if f"{EXPERT}.weight_packed" in header else next(
        k for k in header if k != "__metadata__")
    if how == "json":
        hb = raw[8:8 + n].replace(b"{", b"[", 1)
        f.write_bytes(raw[:8] + hb + body)
        expect(CorruptShardError, d, file=f)
        return
    if how == "length":
        f.write_bytes(struct.pack("<Q", len(raw) * 3) + raw[8:])
        expect(CorruptShardError, d, file=f)
        return
    if how == "offsets":
        b, e = header[name]["data_offsets"]
        header[name]["data_offsets"] = [b, e + 2]
    elif how == "overlap":
        names = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
        name = names[1][1]
        b, e = header[name]["data_offsets"]
        sz = e - b
        header[name]["data_offsets"] = [b - 1, b - 1 + sz]
    elif how == "dtype":
        header[name]["dtype"] = "Q7"
    hb = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + body)
    expect(CorruptShardError, d, file=f, tensor=name)


def test_index_points_to_missing_file(ck_copy):
    d = ck_copy()
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"][f"{EXPERT}.weight_scale"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect(MissingFileError, d, file="model-00009-of-00009.safetensors",
           tensor=f"{EXPERT}.weight_scale")


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x",
                                    "symlink"])
def test_index_points_outside_the_folder(ck_copy, tmp_path, target):
    d = ck_copy()
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    victim = f"{EXPERT}.weight_scale"
    if target == "symlink":
        outside = tmp_path / "elsewhere.safetensors"
        shutil.copy(shard_of(d, victim), outside)
        (d / "link.safetensors").symlink_to(outside)
        target = "link.safetensors"
    idx["weight_map"][victim] = target
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    e = expect(UnsafePathError, d, tensor=victim)
    assert "model.safetensors.index.json" in str(e)


def test_symlink_inside_folder_and_hub_cache_are_fine(pristine, tmp_path):
    # hub cache layout: snapshots/<rev>/* are links into ../../blobs
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in pristine["mxfp4"].iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert open_checkpoint(snap).layout == "compressed-tensors"


def test_missing_scale_companion(ck_copy):
    d = ck_copy()
    edit_tensors(d, lambda t: {k: v for k, v in t.items() if k != f"{EXPERT}.weight_scale"})
    expect(MissingCompanionError, d, tensor=f"{EXPERT}.weight_scale")


def test_missing_global_scale(ck_copy):
    d = ck_copy("nvfp4")
    edit_tensors(d, lambda t: {k: v for k, v in t.items() if k != f"{EXPERT}.weight_global_scale"})
    expect(MissingCompanionError, d, tensor=f"{EXPERT}.weight_global_scale")


def test_scale_shape_does_not_fit(ck_copy):
    d = ck_copy()
    edit_tensors(d, lambda t: {k: (v[:, :1].clone() if k == f"{EXPERT}.weight_scale" else v)
                               for k, v in t.items()})
    e = expect(ShapeMismatchError, d, tensor=f"{EXPERT}.weight_scale")
    assert "[32, 1]" in str(e) and "[32, 2]" in str(e)


def test_packed_shape_does_not_fit_gpt_oss(ck_copy):
    d = ck_copy("gpt-oss")
    n = "model.layers.0.mlp.experts.down_proj_scales"
    edit_tensors(d, lambda t: {k: (v[:, :-1].clone() if k == n else v) for k, v in t.items()})
    expect(ShapeMismatchError, d, tensor=n)


@pytest.mark.parametrize("role,dtype", [("weight_scale", torch.float32),
                                        ("weight_packed", torch.int8)])
def test_dtype_does_not_fit(ck_copy, role, dtype):
    d = ck_copy()
    edit_tensors(d, lambda t: {k: (v.to(dtype) if k == f"{EXPERT}.{role}" else v)
                               for k, v in t.items()})
    expect(DtypeMismatchError, d, tensor=f"{EXPERT}.{role}")


def test_config_names_a_format_the_tensors_do_not_carry(ck_copy):
    d = ck_copy("mxfp4")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["format"] = "nvfp4-pack-quantized"
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        {"group_size": 16, "strategy": "tensor_group"})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValidationError) as ei:
        open_checkpoint(d)
    assert all(isinstance(e, FormatMismatchError) for e in ei.value.errors)
    assert len(ei.value.errors) == 24 + 8  # every expert and attention weight
    assert "carry mxfp4" in str(ei.value.errors[0])


def test_packed_tensors_not_covered_by_config(ck_copy):
    d = ck_copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("re:.*experts")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValidationError) as ei:
        open_checkpoint(d)
    assert len(ei.value.errors) == 24
    assert all(isinstance(e, UncoveredTensorError) for e in ei.value.errors)
    d2 = ck_copy("nvfp4")
    (d2 / "config.json").write_text(json.dumps({"model_type": "x"}))  # no quantization_config
    with pytest.raises(ValidationError) as ei:
        open_checkpoint(d2)
    assert "no quantization_config" in str(ei.value)


def test_all_problems_reported_at_once(ck_copy):
    d = ck_copy()
    other = "model.layers.0.mlp.experts.1.gate_proj"
    edit_tensors(d, lambda t: {k: (v[:, :1].clone() if k == f"{other}.weight_scale" else v)
                               for k, v in t.items() if k != f"{EXPERT}.weight_scale"})
    with pytest.raises(ValidationError) as ei:
        open_checkpoint(d)
    kinds = {(type(e).__name__, e.tensor) for e in ei.value.errors}
    assert kinds == {("MissingCompanionError", f"{EXPERT}.weight_scale"),
                     ("ShapeMismatchError", f"{other}.weight_scale")}
    assert all(e.path for e in ei.value.errors)


@pytest.mark.parametrize("method", ["awq", None, "bitsandbytes"])
def test_unknown_quant_method(ck_copy, method):
    d = ck_copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = method
    (d / "config.json").write_text(json.dumps(cfg))
    expect(UnknownFormatError, d, file="config.json")


def test_unknown_ct_format_and_modelopt_algo(ck_copy):
    d = ck_copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["format"] = "marlin-24"
    (d / "config.json").write_text(json.dumps(cfg))
    expect(UnknownFormatError, d, file="config.json")
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}
    (d / "config.json").write_text(json.dumps(cfg))
    expect(UnknownFormatError, d, file="config.json")


@pytest.mark.parametrize("fname", ["config.json", "model.safetensors.index.json",
                                   "hf_quant_config.json"])
def test_malformed_json(ck_copy, fname):
    d = ck_copy()
    if fname == "hf_quant_config.json":
        (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    (d / fname).write_text('{"quantization_config": {"quant_method": ')
    expect(ConfigError, d, file=fname)


def test_missing_folder_and_no_weights(tmp_path):
    expect(MissingFileError, tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    expect(MissingFileError, tmp_path)


FUZZ = r"""
import json, os, random, shutil, struct, sys, traceback
from pathlib import Path
from workbench.checkpoint import open_checkpoint, CheckpointError
src, work, n, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
out = []
for i in range(n):
    d = work / f"c{i}"
    shutil.copytree(src, d)
    f = rng.choice(sorted(d.glob("*.safetensors")))
    raw = bytearray(f.read_bytes())
    hlen = struct.unpack("<Q", raw[:8])[0]
    mode = rng.choice(["flip", "truncate", "length"])
    if mode == "flip":
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(0, 8 + hlen)] = rng.randrange(256)
    elif mode == "truncate":
        raw = raw[: rng.randrange(0, len(raw))]
    else:
        raw[:8] = struct.pack("<Q", rng.randrange(0, 2 ** 64))
    f.write_bytes(bytes(raw))
    try:
        ck = open_checkpoint(d)
        for r in ck.experts():
            ck.expert_weight(r.layer, r.expert, r.proj).materialize()
        out.append("ok")
    except CheckpointError as e:
        assert e.path, e
        out.append(type(e).__name__)
    except Exception:
        out.append("UNEXPECTED " + traceback.format_exc())
    shutil.rmtree(d)
print(json.dumps(out))
"""


def test_fuzzed_headers_only_raise_checkpoint_errors(pristine, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", FUZZ, str(pristine["mxfp4"]), str(tmp_path), "40",
                        "7"], check=False, capture_output=True, text=True, timeout=240,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]  # a segfault or abort would show here
    outcomes = json.loads(p.stdout.strip().splitlines()[-1])
    bad = [o for o in outcomes if o.startswith("UNEXPECTED")]
    assert not bad, bad[0]
    assert len(outcomes) == 40 and sum(o != "ok" for o in outcomes) >= 30


def test_integer_buffers_are_not_mistaken_for_packed_weights(tmp_path):
    from writers import gen, save_sharded

    save_sharded(tmp_path, {"model.layers.0.mlp.down_proj.weight": gen((8, 4)),
                            "model.position_ids": torch.arange(8, dtype=torch.int32),
                            "model.layers.0.attn.mask": torch.zeros(4, 4, dtype=torch.uint8)})
    ck = open_checkpoint(tmp_path)
    assert not ck.scope.is_quantized("model.position_ids")
    save_sharded(tmp_path, {"model.layers.0.mlp.down_proj.weight":
                            torch.zeros(8, 2, dtype=torch.uint8)})
    expect(UncoveredTensorError, tmp_path, tensor="model.layers.0.mlp.down_proj.weight")
