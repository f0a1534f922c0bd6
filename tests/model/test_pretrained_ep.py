"""`from_pretrained(path, ep_group=...)` under expert parallelism: each rank builds and reads
only its experts (gpt-oss's MXFP4 layout here: the fused packed stacks are sliced, not read
whole), and the EP model computes the logits of the EP1 model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers writes the checkpoint")

from family_oracle import CASES, write_gpt_oss_mxfp4

from workbench.checkpoint import open_checkpoint
from workbench.model import from_pretrained, load_pretrained_
from workbench.model.pretrained import materialize
from workbench.model.transformer import MoEForCausalLM

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]


def test_ep2_ranks_read_half_the_experts_and_match_ep1(tmp_path):
    path = write_gpt_oss_mxfp4(CASES["gpt_oss"], tmp_path / "oss", seed=2)
    whole = from_pretrained(path)
    fresh = materialize(MoEForCausalLM(whole.config, device="meta"), torch.device("cpu"))
    all_bytes = load_pretrained_(fresh, path)["bytes_read"]
    ck = open_checkpoint(path)
    expert_bytes = sum(e.nbytes for n, e in ck.index.entries.items()
                       if n.endswith(("_blocks", "_scales", "_proj_bias")))

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", str(Path(__file__).with_name("pretrained_ep_worker.py")),
                        str(path), str(tmp_path / "report")], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    x = torch.randint(0, whole.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = whole(x).logits
    E = whole.config.num_experts
    for rank in (0, 1):
        rep = json.loads((tmp_path / f"report.{rank}.json").read_text())
        assert rep["experts"] == [[rank * E // 2, E // 2]] * whole.config.num_layers
        # dense tensors whole, experts (packed bytes, scales, biases) half
        assert rep["bytes_read"] == all_bytes - expert_bytes // 2, (rep, all_bytes, expert_bytes)
        got = torch.load(tmp_path / f"report.{rank}.pt")
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
        for name, w1 in got["w1"].items():
            start = rank * E // 2
            assert torch.equal(w1, whole.get_submodule(name).w1.detach()[start:start + E // 2])
