"""TrainConfig validation, CLI parsing, the shipped corpus and deterministic batch sampling."""

from __future__ import annotations

import hashlib
import json
import lzma

import pytest
import torch

from workbench.train.args import config_from_args
from workbench.train.config import TrainConfig, preset_config
from workbench.train.data import CORPUS_DIR, global_batch, load_corpus, rank_slice


@pytest.mark.parametrize("bad, match", [
    ({"batch": 0}, "batch"), ({"recipe": "fp8"}, "recipe"), ({"steps": -1}, "steps"),
    ({"recipe": "bf16", "profile": "floor"}, "profile"), ({"lr": 0.0}, "lr"),
    ({"recipe": "bf16", "export": "compressed-tensors"}, "export"), ({"wandb": "on"}, "wandb"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio"), ({"out": ""}, "out"),
])
def test_config_rejects(bad, match):
    kw = {"out": "x", **bad}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_cli_overrides_and_preset_defaults(tmp_path):
    cfg = config_from_args(["--preset", "tiny", "--recipe", "mxfp4", "--steps", "7", "--out",
                            str(tmp_path), "--profile", "floor", "--batch", "16", "--keep", "3",
                            "--resume", "--export", "compressed-tensors", "--seed", "5"])
    base = preset_config("tiny", str(tmp_path))
    assert (cfg.steps, cfg.profile, cfg.batch, cfg.keep, cfg.seed) == (7, "floor", 16, 3, 5)
    assert cfg.resume and cfg.export == "compressed-tensors" and cfg.recipe == "mxfp4"
    assert (cfg.seq, cfg.lr, cfg.warmup) == (base.seq, base.lr, base.warmup)
    with pytest.raises(ValueError, match="multiple of the world size"):
        cfg.replace(batch=6).check_world(4)
    with pytest.raises(ValueError, match="TrainConfig.recipe 'int3'"):
        config_from_args(["--recipe", "int3", "--out", str(tmp_path)], raising=True)


def test_corpus_matches_manifest_and_licence():
    # Independent decode of the shipped files: the loader must give exactly these bytes.
    manifest = json.loads((CORPUS_DIR / "manifest.json").read_text())
    blob = lzma.decompress((CORPUS_DIR / "cpython311_stdlib.txt.xz").read_bytes())
    assert hashlib.sha256(blob).hexdigest() == manifest["sha256"]
    assert len(blob) > 3_000_000  # "a few MB of real text/code"
    train = b"".join(blob[f["offset"]:f["offset"] + f["length"]] for f in manifest["files"]
                     if f["split"] == "train")
    val = b"".join(blob[f["offset"]:f["offset"] + f["length"]] for f in manifest["files"]
                   if f["split"] == "val")
    c = load_corpus()
    assert bytes(c.train.numpy()) == train and bytes(c.val.numpy()) == val
    names = {f["split"]: set() for f in manifest["files"]}
    for f in manifest["files"]:
        names[f["split"]].add(f["name"])
    assert not names["train"] & names["val"] and len(names["val"]) >= 10
    assert "asyncio" not in names["train"] and "argparse.py" in names["train"] | names["val"]
    licence = (CORPUS_DIR / "LICENSE-PSF.txt").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence


def test_corpus_rejects_tampering(tmp_path):
    for name in ("cpython311_stdlib.txt.xz", "manifest.json"):
        (tmp_path / name).write_bytes((CORPUS_DIR / name).read_bytes())
    m = json.loads((tmp_path / "manifest.json").read_text())
    m["files"][3]["sha256"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(RuntimeError, match=m["files"][3]["name"]):
        load_corpus(str(tmp_path))


def test_global_batch_deterministic_and_sliced_by_rank():
    c = load_corpus()
    kw = {"seed": 3, "batch": 8, "seq": 16}
    a = global_batch(c.train, index=5, **kw)
    assert a.shape == (8, 17) and a.dtype == torch.int64
    assert torch.equal(a, global_batch(c.train, index=5, **kw))
    assert not torch.equal(a, global_batch(c.train, index=6, **kw))
    assert not torch.equal(a, global_batch(c.train, index=5, seed=4, batch=8, seq=16))
    # Every row is a contiguous window of the split's bytes.
    text = bytes(c.train.numpy())
    assert all(bytes(row.to(torch.uint8).tolist()) in text for row in a)
    for world in (1, 2, 4, 8):
        assert torch.equal(torch.cat([rank_slice(a, r, world) for r in range(world)]), a)
    with pytest.raises(ValueError, match="multiple"):
        rank_slice(a, 0, 3)


def test_allow_config_change_names_only_fields_safe_to_change(tmp_path):
    cfg = config_from_args(["--out", str(tmp_path), "--resume", "--allow-config-change",
                            "steps, lr"])
    assert cfg.allow_config_change == ("steps", "lr")
    for bad in (("preset",), ("seed", "lr"), ("batch",), ("recipe",)):
        with pytest.raises(ValueError, match="only steps, lr"):
            TrainConfig(out="x", allow_config_change=bad)
    with pytest.raises(ValueError, match="allow_config_change must be a tuple"):
        TrainConfig(out="x", allow_config_change="steps")
    with pytest.raises(SystemExit):
        config_from_args(["--out", str(tmp_path), "--allow-config-change", "seed"])
