"""DCP reader: dcp.load fills logical BF16 state dicts by decoding only the requested windows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from oracle_checks import assert_bits_equal

from workbench.checkpoint import open_checkpoint
from workbench.checkpoint.dcp import (
    CheckpointStorageReader,
    LocalChunkLoadPlanner,
    local_expert_state_dict,
    stack_name,
)


def _expected_stack(oracle, layer, proj, experts):
    return torch.stack([oracle.experts[(layer, e, proj)] for e in experts])


def test_metadata_advertises_logical_names_and_expert_stacks(ct_mxfp4):
    ck = open_checkpoint(ct_mxfp4.path)
    md = CheckpointStorageReader(ck).read_metadata().state_dict_metadata
    assert set(ck.logical_names()) <= set(md)
    for layer in range(ct_mxfp4.num_layers):
        for proj in ("gate", "up", "down"):
            m = md[stack_name(layer, proj)]
            out, inp = ct_mxfp4.experts[(layer, 0, proj)].shape
            assert tuple(m.size) == (ct_mxfp4.num_experts, out, inp)
            assert m.properties.dtype == torch.bfloat16
            want = [(e, 0, 0) for e in range(ct_mxfp4.num_experts)]
            assert [tuple(c.offsets) for c in m.chunks] == want
    assert ck.index.stats.bytes_read == 0, "metadata must come from headers only"


def test_single_process_full_load_is_bit_exact(ct_mxfp4):
    ck = open_checkpoint(ct_mxfp4.path)
    reader = CheckpointStorageReader(ck)
    state = {stack_name(1, p): torch.zeros(ct_mxfp4.num_experts, *ct_mxfp4.experts[(1, 0, p)].shape,
                                           dtype=torch.bfloat16) for p in ("gate", "up", "down")}
    q = "model.layers.0.self_attn.q_proj.weight"
    norm = "model.layers.0.input_layernorm.weight"
    state[q] = torch.zeros(tuple(ck.tensor(q).shape), dtype=torch.bfloat16)
    state[norm] = torch.zeros(tuple(ck.tensor(norm).shape), dtype=torch.bfloat16)
    dcp.load(state, storage_reader=reader)
    for p in ("gate", "up", "down"):
        want = _expected_stack(ct_mxfp4, 1, p, range(ct_mxfp4.num_experts))
        assert_bits_equal(state[stack_name(1, p)], want, f"layer 1 {p} stack")
    assert_bits_equal(state[q], ct_mxfp4.meta["decoded"][q], q)
    assert_bits_equal(state[norm], ct_mxfp4.meta["decoded"][norm], norm)
    assert reader.bytes_read > 0 and reader.items_read >= 3 * ct_mxfp4.num_experts


def test_single_process_partial_chunks_read_only_their_window(ct_mxfp4_8):
    """Experts 2..5 of a stack, then a row window (as tensor parallelism would hold it)."""
    oracle = ct_mxfp4_8
    name = stack_name(0, "down")
    out, inp = oracle.experts[(0, 0, "down")].shape

    ck = open_checkpoint(oracle.path)
    full_reader = CheckpointStorageReader(ck)
    full = {name: torch.zeros(oracle.num_experts, out, inp, dtype=torch.bfloat16)}
    dcp.load(full, storage_reader=full_reader)

    ck = open_checkpoint(oracle.path)
    reader = CheckpointStorageReader(ck)
    part = {name: torch.zeros(4, out, inp, dtype=torch.bfloat16)}
    dcp.load(part, storage_reader=reader, planner=LocalChunkLoadPlanner({name: (2, 0, 0)}))
    assert_bits_equal(part[name], _expected_stack(oracle, 0, "down", range(2, 6)), "experts 2..5")
    assert reader.bytes_read * 2 == full_reader.bytes_read  # 4 of 8 equal-size experts

    ck = open_checkpoint(oracle.path)
    reader = CheckpointStorageReader(ck)
    rows = {name: torch.zeros(oracle.num_experts, 40, inp, dtype=torch.bfloat16)}
    dcp.load(rows, storage_reader=reader, planner=LocalChunkLoadPlanner({name: (0, 33, 0)}))
    want = _expected_stack(oracle, 0, "down", range(oracle.num_experts))[:, 33:73]
    assert_bits_equal(rows[name], want, "rows 33..72 of every expert")
    assert reader.bytes_read < full_reader.bytes_read / 2


def test_planner_rejects_a_chunk_outside_the_tensor(ct_mxfp4):
    ck = open_checkpoint(ct_mxfp4.path)
    name = stack_name(0, "gate")
    out, inp = ct_mxfp4.experts[(0, 0, "gate")].shape
    state = {name: torch.zeros(2, out, inp, dtype=torch.bfloat16)}
    planner = LocalChunkLoadPlanner({name: (ct_mxfp4.num_experts - 1, 0, 0)})
    planner.set_up_planner(state, CheckpointStorageReader(ck).read_metadata(), True)
    with pytest.raises(ValueError, match="does not fit"):
        planner.create_local_plan()


@pytest.mark.parametrize("which", ["ct_nvfp4", "gpt_oss", "modelopt_nvfp4", "fp8_block"])
def test_single_process_other_layouts(which, request):
    oracle = request.getfixturevalue(which)
    ck = open_checkpoint(oracle.path)
    reader = CheckpointStorageReader(ck)
    state, offsets = local_expert_state_dict(ck, 1, 2, layers=[0])
    dcp.load(state, storage_reader=reader, planner=LocalChunkLoadPlanner(offsets))
    half = oracle.num_experts // 2
    for p in ("gate", "up", "down"):
        assert_bits_equal(state[stack_name(0, p)],
                          _expected_stack(oracle, 0, p, range(half, 2 * half)), f"{which} {p}")
