"""4 gloo ranks load an expert-parallel state dict through the DCP reader.

Each rank holds only its E/4 experts (plain tensors with LocalChunkLoadPlanner, then DTensors
sharded on the expert dim), reads only the stored tensors of those experts (counted by the
checkpoint index), about a quarter of all expert bytes, and gets values bit-equal to the
third-party decode.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import re

import dcp_worker
import pytest
import torch
from oracle_checks import assert_bits_equal
from safetensors import safe_open
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed
WORLD = 4


SAFETENSORS_BYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


def _headers(path):
    """name -> (dtype, shape) for every stored tensor, from the safetensors headers themselves."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for n in f.keys():  # noqa: SIM118 - safe_open is not a dict
                sl = f.get_slice(n)
                out[n] = (sl.get_dtype(), sl.get_shape())
    return out


def _stored_bytes(path, names):
    """Bytes of the named stored tensors, from the safetensors headers (not from workbench)."""
    heads = _headers(path)
    return sum(torch.Size(heads[n][1]).numel() * SAFETENSORS_BYTES[heads[n][0]] for n in names)


def _expert_tensors(path):
    """Stored tensors that carry routed-expert weights (biases are not part of expert_weight)."""
    return [n for n in _headers(path) if ".mlp.experts." in n and not n.endswith("_bias")]


@pytest.mark.timeout(300)
def test_four_ranks_read_only_their_experts(tmp_path, ct_mxfp4_8, gpt_oss):
    assert ct_mxfp4_8.num_experts == 8 and gpt_oss.num_experts == 4
    assert len(list(ct_mxfp4_8.path.glob("*.safetensors"))) > 1  # sharded, with an index
    assert (ct_mxfp4_8.path / "model.safetensors.index.json").exists()
    oracles = [ct_mxfp4_8, gpt_oss]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=dcp_worker.run,
                         args=(r, WORLD, str(tmp_path), [str(o.path) for o in oracles]))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0] * WORLD, f"worker exit codes {codes}"

    reports = [json.loads((tmp_path / f"report-rank{r}.json").read_text()) for r in range(WORLD)]
    for i, oracle in enumerate(oracles):
        expert_names = _expert_tensors(oracle.path)
        all_expert_bytes = _stored_bytes(oracle.path, expert_names)
        per_rank = oracle.num_experts // WORLD
        for r, rep in enumerate(reports):
            own = range(r * per_rank, (r + 1) * per_rank)
            for mode in ("plain", "dtensor"):
                got = rep[f"ck{i}-{mode}"]
                # no expert of another rank was touched, and nothing else was read
                for name in got["touched"]:
                    assert ".mlp.experts." in name, (mode, r, name)
                    m = re.search(r"experts\.(\d+)\.", name)
                    if m:  # per-expert layouts: the expert index is in the name
                        assert int(m.group(1)) in own, (mode, r, name)
                assert got["reader_bytes"] == got["index_bytes"]
                if oracle.layout == "compressed-tensors":
                    own_names = [n for n in expert_names
                                 if int(re.search(r"experts\.(\d+)\.", n).group(1)) in own]
                    assert got["reader_bytes"] == _stored_bytes(oracle.path, own_names)
                assert got["reader_bytes"] == pytest.approx(all_expert_bytes / WORLD, rel=0.05)
                local = load_file(tmp_path / f"ck{i}-{mode}-rank{r}.safetensors")
                assert len(local) == 3 * oracle.num_layers
                for name, value in local.items():
                    assert value.shape[0] == per_rank  # never all experts on one rank
                    _, layer, _, proj = name.split(".")
                    want = torch.stack([oracle.experts[(int(layer), e, proj)] for e in own])
                    assert_bits_equal(value, want, f"{oracle.layout} rank {r} {mode} {name}")
