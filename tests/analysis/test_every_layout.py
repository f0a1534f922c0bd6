"""`workbench inspect` on every layout the reader supports, each checkpoint written by its own
library (the oracle writers of tests/checkpoint), through the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "checkpoint"))

WRITERS = {
    "compressed-tensors-mxfp4": ("compressed_tensors", lambda o, p: o.write_compressed_tensors(p, "MXFP4A16", seed=1)),
    "compressed-tensors-nvfp4": ("compressed_tensors", lambda o, p: o.write_compressed_tensors(p, "NVFP4A16", seed=2)),
    "gpt-oss": ("transformers", lambda o, p: o.write_gpt_oss(p, seed=3)),
    "modelopt-nvfp4": ("modelopt.torch.quantization.qtensor", lambda o, p: o.write_modelopt(p, "nvfp4", seed=4)),
    "modelopt-mxfp8": ("modelopt.torch.quantization.qtensor", lambda o, p: o.write_modelopt(p, "mxfp8", seed=5)),
    "fp8-block": ("torch", lambda o, p: o.write_fp8_block(p, seed=6)),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_inspect_cli_on_every_layout(layout, tmp_path):
    module, write = WRITERS[layout]
    pytest.importorskip(module, reason=f"{module} writes this checkpoint (pip install -e .[dev])")
    import oracles

    o = write(oracles, tmp_path / "ck")
    out = tmp_path / "report"
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "inspect", str(o.path), "--recipe",
                        "mxfp4:floor", "--out", str(out)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_csv(out / "experts.csv")
    routed = df[df.kind == "routed"]
    # every routed expert projection of the checkpoint has its row
    assert len(routed) == o.num_layers * o.num_experts * 3
    assert routed.rel_err.notna().all() and (routed.rel_err >= 0).all()
    assert any(p.suffix == ".png" for p in out.iterdir())
