"""MoEConfig validation, presets, and the round trip through transformers' Qwen3MoeConfig."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench.arch import PRESETS
from workbench.model import MoEConfig, MoEForCausalLM, from_hf_config, preset, tiny, to_hf_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_block_reduction_dims_and_build_on_meta(name):
    cfg = preset(name)
    # Every expert GEMM reduces over hidden (w1, w3) or expert FFN (w2): whole MX/NVFP4 blocks.
    assert cfg.hidden_size % 32 == 0 and cfg.expert_ffn % 32 == 0
    model = MoEForCausalLM(cfg, device="meta")  # the GPU-sized presets cost nothing here
    first_moe = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    w1 = model.model.layers[first_moe].mlp.experts.w1
    assert tuple(w1.shape) == (cfg.num_experts, cfg.expert_ffn, cfg.hidden_size)


def test_gpu_presets_have_the_advertised_expert_shapes():
    q = preset("qwen3_30b_a3b_like")
    assert (q.hidden_size, q.expert_ffn, q.num_experts, q.top_k) == (2048, 768, 128, 8)
    k = preset("k3_like")
    assert (k.hidden_size, k.expert_ffn) == (3584, 3072)


@pytest.mark.parametrize("changes, message", [
    ({"num_heads": 6, "num_kv_heads": 4}, "multiple of num_kv_heads"),
    ({"top_k": 9}, "exceeds num_experts"),
    ({"head_dim": 15}, "even"),
    ({"hidden_size": 0}, "positive int"),
    ({"mlp_only_layers": [0]}, "tuple"),
    ({"mlp_only_layers": (5,)}, "outside"),
    ({"mlp_only_layers": (0,), "dense_ffn": 0}, "dense_ffn"),
    ({"shared_expert_gate": True}, "shared_expert_ffn"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
])
def test_invalid_configs_say_what_is_wrong(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny(**changes)


def test_config_is_frozen_and_unknown_preset_is_named():
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny().hidden_size = 128
    with pytest.raises(ValueError, match="'huge'.*tiny"):
        preset("huge")


def test_hf_config_round_trip():
    pytest.importorskip("transformers")
    cfg = tiny(num_layers=4, mlp_only_layers=(2,), decoder_sparse_step=1, norm_topk_prob=False,
               tie_embeddings=True, aux_loss_coef=0.01, rope_theta=5e5)
    hf = to_hf_config(cfg)
    assert type(hf).__name__ == "Qwen3MoeConfig"
    assert from_hf_config(hf) == cfg
    assert from_hf_config(hf.to_dict()) == cfg


def test_from_hf_config_rejects_what_the_model_cannot_run():
    transformers = pytest.importorskip("transformers")
    base = to_hf_config(tiny()).to_dict()
    with pytest.raises(ValueError, match="sliding"):
        from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="rope_type 'llama3'"):
        from_hf_config({**base, "rope_parameters": {
            "rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    with pytest.raises(ValueError, match="qwen3_moe"):
        from_hf_config(transformers.LlamaConfig().to_dict())
    with pytest.raises(ValueError, match="shared expert"):
        to_hf_config(tiny(shared_expert_ffn=32))


def test_init_is_seeded_per_tensor_and_leaves_global_rng_alone():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = MoEForCausalLM(tiny(), seed=1)
    after = torch.rand(1)
    b = MoEForCausalLM(tiny(), seed=1)
    c = MoEForCausalLM(tiny(), seed=2)
    assert torch.equal(before, after)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    experts = a.model.layers[0].mlp.experts.w1
    assert not torch.equal(experts[0], experts[1])
    assert isinstance(a.config, MoEConfig)


def test_register_preset_adds_and_refuses():
    from workbench import arch

    def two_layers(**kw):
        return arch.tiny(**{"num_layers": 2, **kw})

    name = "tiny-two-layers-test"
    try:
        assert arch.register_preset(name, two_layers) == name
        assert arch.preset(name).num_layers == 2
        assert arch.preset(name, num_layers=3).num_layers == 3  # overrides still reach it
        with pytest.raises(ValueError, match="already registered"):
            arch.register_preset(name, two_layers)
        with pytest.raises(ValueError, match="already registered"):
            arch.register_preset("tiny", two_layers)  # a built-in is never replaced
        for bad in ("", "a b", "x;rm -rf", "-leading", "a" * 65, "../up"):
            with pytest.raises(ValueError, match="preset name"):
                arch.register_preset(bad, two_layers)
    finally:
        arch.PRESETS.pop(name, None)
    assert arch.PRESETS["tiny"] is arch.tiny


def test_arch_and_its_presets_import_without_torch():
    """The launcher reads presets and their blocks from workbench.arch without loading torch."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, workbench.arch as a\n"
            "cfgs = [a.preset(n) for n in a.PRESETS]\n"
            "assert cfgs[0].replace(num_layers=3).num_layers == 3\n"
            "assert 'torch' not in sys.modules, 'workbench.arch imported torch'\n")
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
