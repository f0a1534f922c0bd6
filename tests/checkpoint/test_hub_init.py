"""--init and LaunchSpec(init=...) with hub ids: from a Hugging Face cache made by hand (offline),
and from the loopback server playing the Hub, where a rank downloads only the shards of its own
experts before it loads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_cache import add_snapshot, commit_of
from range_server import RangeServer
from safetensors.torch import load_file, save_file

from workbench.checkpoint import RemoteReadError
from workbench.model import MoEForCausalLM, tiny
from workbench.model.experts import GroupedExperts
from workbench.train import distributed
from workbench.train.args import config_from_args
from workbench.train.build import build
from workbench.train.export import export_model
from workbench.train.init import load_init
from workbench.train.init_source import init_checkpoint, local_experts

ROOT = Path(__file__).parents[2]
TINY = ["--preset", "tiny", "--batch", "4", "--seq", "32", "--wandb", "disabled", "--warmup", "2"]
C1 = commit_of(11)


@pytest.fixture(scope="module")
def init_folder(tmp_path_factory) -> Path:
    """The tiny model's BF16 export, re-sharded as a large checkpoint is: experts 0-3 of every
    layer in one shard, 4-7 in another, the rest in a third (with its index)."""
    src = export_model(MoEForCausalLM(tiny(), seed=3), tmp_path_factory.mktemp("init") / "x",
                       fmt="bf16")
    out = src.parent / "sharded"
    out.mkdir()
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    def shard_of(name):
        if ".experts." not in name:
            return "model-00003-of-00003.safetensors"
        e = int(name.split(".experts.")[1].split(".")[0])
        return f"model-0000{1 + e // 4}-of-00003.safetensors"
    groups: dict[str, dict] = {}
    for n, t in tensors.items():
        groups.setdefault(shard_of(n), {})[n] = t
    for f, part in groups.items():
        save_file(part, str(out / f))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: shard_of(n) for n in tensors}}))
    (out / "config.json").write_bytes((src / "config.json").read_bytes())
    return out


@pytest.fixture
def home(tmp_path, monkeypatch, init_folder) -> Path:
    home = tmp_path / "hf"
    add_snapshot(home, "org/tiny-moe", init_folder, C1)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WORKBENCH_RANGE_CACHE", "off")
    return home


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_build_with_an_id_loads_what_the_folder_loads(home, init_folder, tmp_path):
    info = distributed.setup()
    by_id = build(config_from_args([*TINY, "--out", str(tmp_path / "a"), "--init",
                                    "org/tiny-moe"]), info).model
    by_folder = build(config_from_args([*TINY, "--out", str(tmp_path / "b"), "--init",
                                        str(init_folder)]), info).model
    a, b = _params(by_id), _params(by_folder)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the weights are the export's (BF16 copies of seed 3's), not a fresh draw
    ref = _params(MoEForCausalLM(tiny(), seed=3))
    assert all(torch.equal(a[k], ref[k].to(torch.bfloat16).to(a[k].dtype)) for k in a)


@pytest.mark.slow
def test_jobs_qat_with_an_id_records_what_it_resolved_to(home, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "jobs" / "qat.py"), *TINY, "--steps", "2",
                        "--init", "org/tiny-moe@main", "--out", str(out), "--ckpt-every", "0",
                        "--val-every", "0"], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["init"] == f"org/tiny-moe@{C1}"  # pinned: every rank and restart reads C1
    src = cfg["init_source"]
    assert (src["kind"], src["repo_id"], src["revision"], src["requested_revision"]) == \
        ("hub", "org/tiny-moe", C1, "main")
    assert src["path"].endswith(f"models--org--tiny-moe/snapshots/{C1}")
    bad = subprocess.run([sys.executable, str(ROOT / "jobs" / "qat.py"), *TINY, "--steps", "2",
                          "--init", "org/none", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
                         check=False)
    lines = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert bad.returncode == 2 and len(lines) == 1 and "org/none is not in the Hugging Face " \
        "cache" in lines[0] and "Traceback" not in bad.stderr, bad.stderr[-2000:]


def test_launch_spec_pins_an_id_to_its_commit(home):
    from workbench.launch import LaunchSpec
    from workbench.launch.spec import LaunchSpecError

    spec = LaunchSpec.build(preset=None, init="org/tiny-moe", ep=1)
    assert spec.train.init == f"org/tiny-moe@{C1}"
    assert f"--init=org/tiny-moe@{C1}" in spec.job_argv()
    assert LaunchSpec.from_json(spec.to_json()) == spec  # a pinned id stays as it is
    with pytest.raises(LaunchSpecError, match="org/none is not in the Hugging Face cache"):
        LaunchSpec.build(preset=None, init="org/none", ep=1)


def _rank1_model() -> MoEForCausalLM:
    """Rank 1 of EP2 without a process group: every layer keeps global experts 4-7."""
    model = MoEForCausalLM(tiny(), seed=0)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.narrow_(4, 4)
    return model


def test_a_rank_downloads_only_its_experts_shards(init_folder, tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants as hc

    with RangeServer(init_folder, hub_repo="org/tiny-moe", commit=C1) as srv:
        monkeypatch.setenv("HF_ENDPOINT", srv.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setenv("WORKBENCH_RANGE_CACHE", "off")
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        model = _rank1_model()
        assert local_experts(model) == range(4, 8)
        ck = init_checkpoint("org/tiny-moe", model, progress=False)
        downloaded = {f for m, f, r, s in srv.log.requests if m == "GET" and r is None
                      and f and f.endswith(".safetensors")}
        assert downloaded == {"model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors"}
        srv.reset()
        load_init(ck, model, distributed.setup())
        assert srv.log.requests == []  # loading touched no network
        # another rank's expert is not on disk: an error naming it, not a download
        with pytest.raises(RemoteReadError, match="fetch_data=False") as e:
            ck.expert_weight(0, 1, "gate").materialize()
        assert ".experts.1.gate_proj" in e.value.tensor and srv.log.requests == []
    ref = _rank1_model()
    load_init(init_folder, ref, distributed.setup())
    a, b = _params(model), _params(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)
