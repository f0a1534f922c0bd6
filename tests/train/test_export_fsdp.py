"""`--export` under `--fsdp`: the streamed export (workbench.train.export._write_fsdp) writes the
same bytes as the export of the same weights without FSDP at the same EP size.

Oracles: `safetensors.torch.save_file` for the streamed writer's files, and the unchanged
non-FSDP exporter (itself tested against compressed-tensors and transformers in test_export.py)
for whole exports: same file names, same index, same config, same bytes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, env, run

from workbench.train.export_folder import MARKER
from workbench.train.safetensors_stream import StreamedFile


def _entries(tensors):
    return {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}


def test_streamed_file_equals_save_file_in_any_write_order(tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    # every dtype the exports write, plus the ones that sort around them, a 0-dim tensor and a
    # name that sorts between the others only by bytes
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g).bfloat16(),
        "a.weight_packed": torch.randint(0, 256, (4, 3), generator=g, dtype=torch.uint8),
        "a.weight_scale": torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn),
        "a.weight_global_scale": torch.randn(1, generator=g),
        "a.B": torch.randn(2, generator=g).half(),
        "z": torch.tensor(3.0),
        "i": torch.arange(3, dtype=torch.int64),
        "j": torch.arange(5, dtype=torch.int32),
        "k": torch.randn(2, generator=g).to(torch.float8_e5m2),
        "bool": torch.tensor([True, False, True]),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    w = StreamedFile(tmp_path / "s.safetensors", _entries(tensors), {"format": "pt"})
    for name in sorted(tensors, reverse=True):  # not the file's order
        w.write(name, tensors[name])
    w.close()
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    w = StreamedFile(tmp_path / "bad.safetensors", _entries(tensors), {"format": "pt"})
    with pytest.raises(ValueError, match=r"b\.weight is torch\.float32"):
        w.write("b.weight", tensors["b.weight"].float())
    w.write("z", tensors["z"])
    with pytest.raises(KeyError, match="written twice"):
        w.write("z", tensors["z"])
    with pytest.raises(RuntimeError, match="9 tensors never written"):
        w.close()


def _worker(out: Path, nproc: int, ep: int, recipes: str) -> None:
    worker = Path(__file__).with_name("fsdp_export_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={nproc}", str(worker), str(out), str(ep), recipes],
                       env=env(), cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-5000:]


def _same_export(a: Path, b: Path, n_files: int) -> None:
    names = sorted(p.name for p in a.iterdir())
    shards = [f"model-{k + 1:05d}-of-{n_files:05d}.safetensors" for k in range(n_files)]
    # MARKER: the file that makes an export folder the workbench's (export_folder)
    assert names == sorted([MARKER, "config.json", "model.safetensors.index.json", *shards])
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), (a, name)


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2], ids=["ep1xfsdp2", "ep2+fsdp"])
def test_world2_fsdp_export_is_the_export_without_fsdp_byte_for_byte(tmp_path, ep):
    """EP1 x FSDP2 splits every expert between the two ranks (dim 1), so an NVFP4 global amax
    taken over a shard changes the bytes; EP2 + FSDP makes rank 0 write rank 1's experts."""
    _worker(tmp_path, 2, ep, "bf16,nvfp4,mxfp4")
    for tag in ("bf16-bf16", "compressed-tensors-nvfp4", "compressed-tensors-mxfp4"):
        _same_export(tmp_path / f"fsdp-{tag}", tmp_path / f"ref-{tag}", ep)
    if ep == 1:  # the comparison can fail: a shard's own amax gives other NVFP4 bytes
        from safetensors.torch import load_file

        from workbench.formats import quantize
        from workbench.model import MoEForCausalLM, tiny

        w1 = MoEForCausalLM(tiny(), seed=0, dtype=torch.float32).model.layers[0].mlp.experts.w1
        half = w1.detach()[:, : w1.shape[1] // 2]  # rank 0's Shard(1) piece
        q = quantize(half, "nvfp4", global_amax=half.abs().amax(dim=(1, 2), keepdim=True))
        disk = load_file(tmp_path / "ref-compressed-tensors-nvfp4" / "model-00001-of-00001"
                         ".safetensors")
        whole = torch.stack([disk[f"model.layers.0.mlp.experts.{e}.gate_proj.weight_packed"]
                             for e in range(w1.shape[0])])
        assert not torch.equal(q.data, whole[:, : w1.shape[1] // 2])


@pytest.mark.distributed
def test_trainer_exports_under_fsdp_like_a_resume_without_fsdp(tmp_path):
    """The trainer's path (`--ep 1 --fsdp --export`), also over leftovers of a crashed earlier
    export of the run (a stale `.tmp-export`, an `.old-export` left between the renames, each
    with the export marker); the same checkpoint resumed in one process without FSDP exports
    the same bytes."""
    out = tmp_path / "run"
    args = [*TINY, "--recipe", "nvfp4", "--steps", "2", "--val-every", "0", "--ckpt-every", "0",
            "--export", "compressed-tensors", "--out", str(out)]
    run(2, [*args, "--ep", "1", "--fsdp"])
    marker = (out / "export" / MARKER).read_bytes()
    for left in (".tmp-export", ".old-export"):
        (out / left).mkdir()
        (out / left / MARKER).write_bytes(marker)
        (out / left / "stale").write_text("x")
    run(2, [*args, "--ep", "1", "--fsdp", "--resume"])  # step 2 = steps: trains nothing, exports
    assert sorted(p.name for p in out.iterdir() if "export" in p.name) == ["export"]
    assert not (out / "export" / "stale").exists()
    result = json.loads((out / "result.json").read_text())
    assert result["export"] == str(out / "export")
    shutil.move(out / "export", tmp_path / "fsdp-export")
    run(1, [*args, "--resume"])  # resumes step 2 = steps: trains nothing, exports
    _same_export(tmp_path / "fsdp-export", out / "export", 1)
