"""EP2: every rank writes its own experts + one merged index (== the EP1 export, tensor for
tensor), and --init from a packed checkpoint reads only the rank's experts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, env

pytestmark = pytest.mark.distributed


def test_ep2_export_equals_ep1_and_init_reads_local_experts(tmp_path):
    from safetensors import safe_open

    from workbench.model import MoEForCausalLM, tiny
    from workbench.qat import prepare
    from workbench.train.distributed import setup
    from workbench.train.export import export_model
    from workbench.train.init import load_init

    ep1 = tmp_path / "ep1"
    model = MoEForCausalLM(tiny(), seed=0)
    prepare(model, recipe="mxfp4", scope="routed-experts")
    export_model(model, ep1, fmt="compressed-tensors", recipe="mxfp4")
    whole = load_init(ep1, MoEForCausalLM(tiny(), seed=7), setup())

    ep2 = tmp_path / "ep2"
    worker = Path(__file__).with_name("ep_export_worker.py")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", str(worker), str(ep2), str(ep1),
                        str(tmp_path / "report")], env=env(), cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-5000:]

    idx1 = json.loads((ep1 / "model.safetensors.index.json").read_text())["weight_map"]
    idx2 = json.loads((ep2 / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(idx1) == set(idx2)
    assert set(idx2.values()) == {"model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"}
    # rank 1 wrote exactly the upper half of the experts of every layer
    e_of = {k: int(k.split(".")[5]) for k in idx2 if ".experts." in k}
    assert all((e_of[k] >= 4) == (idx2[k].startswith("model-00002")) for k in e_of)
    assert all(idx2[k].startswith("model-00001") for k in idx2 if ".experts." not in k)
    for name in idx1:
        with safe_open(str(ep1 / idx1[name]), "pt") as a, safe_open(str(ep2 / idx2[name]), "pt") as b:
            ta, tb = a.get_tensor(name), b.get_tensor(name)
            assert ta.dtype == tb.dtype and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))
    assert json.loads((ep1 / "config.json").read_text()) == \
        json.loads((ep2 / "config.json").read_text())

    reports = [json.loads((tmp_path / f"report.{r}.json").read_text()) for r in (0, 1)]
    assert all(r["experts_equal"] and r["dense_equal"] for r in reports)
    assert [r["local_experts"][0] for r in reports] == [0, 4]
    expert_bytes = 0
    for name, shard in idx1.items():
        if ".experts." in name:
            with safe_open(str(ep1 / shard), "pt") as f:
                t = f.get_slice(name)
                expert_bytes += torch.Size(t.get_shape()).numel()  # uint8 parts: 1 byte each
    # each rank reads what EP1 reads minus the other rank's half of the experts
    for r in reports:
        assert r["bytes_read"] == whole["bytes_read"] - expert_bytes // 2, (r, whole, expert_bytes)
