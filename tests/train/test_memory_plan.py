"""The memory planner against what the model and the trainer really hold.

Oracles: parameter counts of the built model (ours on the meta device, and transformers' own
Qwen3-MoE for the real Qwen3-30B-A3B config); activations measured by `SavedTensorMeter` on a
real forward; per-rank bytes the trainer itself logs at its first step, at EP1 and EP2 (gloo).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from tests.train.conftest import REPO, TINY, env, metrics, run
from workbench.arch import MoEConfig
from workbench.launch import LaunchSpec
from workbench.launch.fits import check_fits
from workbench.launch.spec import LaunchSpecError
from workbench.launch.submit import submit
from workbench.model import MoEForCausalLM, small, tiny, tiny_deepseek, tiny_glm, tiny_gpt_oss
from workbench.train.act_ckpt import apply_activation_checkpointing
from workbench.train.memory import (
    SavedTensorMeter,
    activation_floats_per_token,
    mask_floats,
    param_counts,
    rank_memory,
)
from workbench.train.plan import plan

# The planner's activation count is derived from the model's code; the measured forward agrees
# to within 2.5% on the configs below (the count leaves out a few per-token scalars of the loss
# head). 5% is the margin the tests hold it to.
MARGIN = 0.05

CONFIGS = {
    "tiny": tiny(),
    "small": small(),
    "top4": tiny(top_k=4),
    "shared_gated": tiny(shared_expert_ffn=48, shared_expert_gate=True),
    "dense_layer": tiny(num_layers=3, mlp_only_layers=(1,)),
    "mha": tiny(num_kv_heads=4),
    "tied_vocab1k": tiny(vocab_size=1024, tie_embeddings=True),
    # the other families' blocks: sinks and windows, MLA, biases, routers, clamped SwiGLU
    "gpt_oss": tiny_gpt_oss(),
    "deepseek_v3": tiny_deepseek(),
    "deepseek_v3_plain_q": tiny_deepseek(attention=dataclasses.replace(
        tiny_deepseek().attention, q_lora_rank=0)),
    "glm4_moe": tiny_glm(),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_param_counts_equal_the_built_model(name):
    cfg = CONFIGS[name]
    with torch.device("meta"):
        model = MoEForCausalLM(cfg, seed=0, device="meta")
    built = sum(p.numel() for p in model.parameters())  # tied weights are one parameter
    assert param_counts(cfg).total(cfg.num_experts) == built


def test_param_counts_of_the_real_qwen3_30b_a3b_config_equal_transformers():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, moe_intermediate_size=768, num_experts=128,
                        num_experts_per_tok=8, max_position_embeddings=40960,
                        tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf)
    expected = sum(p.numel() for p in model.parameters())
    from workbench.model import from_hf_config

    cfg = from_hf_config(hf)
    assert param_counts(cfg).total(cfg.num_experts) == expected
    assert round(param_counts(cfg).dense / 1e9, 2) == 1.54  # the 1.5B non-expert


def _measured_saved_bytes(cfg: MoEConfig, mode: str = "off", B: int = 4, S: int = 64) -> int:
    model = MoEForCausalLM(cfg, seed=0)
    apply_activation_checkpointing(model, mode)
    tok = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(model) as meter:
        out = model(tok, labels_BS=tok)
    out.loss.backward()
    return meter.bytes


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_activation_count_matches_the_measured_forward(name):
    cfg = CONFIGS[name]
    words = activation_floats_per_token(cfg, "off")
    planned = (words["layers"] + words["head"]) * 4 * 4 * 64 + mask_floats(cfg, 64) * 4
    measured = _measured_saved_bytes(cfg)
    assert abs(measured - planned) <= MARGIN * measured, (measured, planned)


@pytest.mark.parametrize("name", ["tiny", "small", "dense_layer"])
def test_full_checkpointing_keeps_what_the_plan_says(name):
    # Under `full`, what stays saved across the step is each layer's input plus the head; the
    # meter sees exactly that (the recomputation's working set lives inside backward). The kept
    # part is small, so the head's few uncounted words weigh more: 10% here (measured 4-8%).
    cfg = CONFIGS[name]
    words = activation_floats_per_token(cfg, "full")
    planned = (words["layers"] + words["head"]) * 4 * 4 * 64
    measured = _measured_saved_bytes(cfg, "full")
    assert abs(measured - planned) <= 2 * MARGIN * measured, (measured, planned)
    assert measured < 0.5 * _measured_saved_bytes(cfg, "off")


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", ["tiny", "gpt_oss", "deepseek_v3", "glm4_moe"])
def test_checkpointing_leaves_loss_and_gradients_unchanged(mode, name):
    cfg = CONFIGS[name]
    tok = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))
    grads = {}
    for m in ("off", mode):
        torch.manual_seed(0)
        model = MoEForCausalLM(cfg, seed=0)
        assert apply_activation_checkpointing(model, m) == (0 if m == "off" else cfg.num_layers)
        out = model(tok, labels_BS=tok)
        out.loss.backward()
        grads[m] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(grads["off"][0], grads[mode][0])
    for n, g in grads["off"][1].items():
        if g is None:  # a parameter without gradient (e_score_correction_bias)
            assert grads[mode][1][n] is None, n
            continue
        torch.testing.assert_close(grads[mode][1][n], g, rtol=1e-6, atol=1e-9, msg=n)


def test_checkpointing_twice_is_refused_and_unknown_mode_is_an_error():
    model = MoEForCausalLM(tiny(), seed=0)
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="already"):
        apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="not one of"):
        apply_activation_checkpointing(MoEForCausalLM(tiny(), seed=0), "sometimes")


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,recipe", [(1, "bf16"), (2, "mxfp4")])
def test_trainer_logged_memory_matches_the_plan(tmp_path, nproc, recipe):
    out = tmp_path / "run"
    run(nproc, [*TINY, "--recipe", recipe, "--steps", "2", "--out", str(out), "--ckpt-every", "0",
                "--val-every", "0"])
    first = metrics(out)[0]
    cfg = tiny()
    want = rank_memory(cfg, world=nproc, ep=nproc, batch=4, seq=32, device="cpu",
                       qat=recipe != "bf16")
    # Parameters, gradients and AdamW state are exact (fp32 masters, nothing else per parameter).
    assert first["mem_masters_bytes"] == want.masters
    assert first["mem_grads_bytes"] == want.grads
    assert first["mem_optimizer_bytes"] == want.optimizer
    # The trainer feeds seq+1 tokens per sequence (inputs and the shifted labels).
    want_tok = rank_memory(cfg, world=nproc, ep=nproc, batch=4, seq=33, device="cpu",
                           qat=recipe != "bf16")
    got = first["mem_activations_bytes"]
    assert abs(got - want_tok.saved) <= MARGIN * got, (got, want_tok.saved)
    assert "mem_activations_bytes" not in metrics(out)[1]  # measured once, not every step


def test_activation_checkpointing_flag_reaches_the_trainer(tmp_path):
    runs = {}
    for mode in ("off", "full"):
        out = tmp_path / mode
        run(1, [*TINY, "--recipe", "mxfp4", "--steps", "2", "--out", str(out),
                "--ckpt-every", "0", "--val-every", "0", "--activation-checkpointing", mode])
        runs[mode] = metrics(out)
    assert [r["loss"] for r in runs["off"]] == [r["loss"] for r in runs["full"]]
    assert runs["full"][0]["mem_activations_bytes"] < 0.5 * runs["off"][0]["mem_activations_bytes"]


def test_plan_rows_add_up_and_the_verdict_follows_the_budget():
    cfg = CONFIGS["small"]
    p = plan(cfg, 1, 2, 80.0, batch=4, seq=64, device="cpu")
    m = p.memory
    n_local = param_counts(cfg).dense + param_counts(cfg).experts_total * cfg.num_experts // 2
    assert m.masters == 4 * n_local and m.grads == 4 * n_local and m.optimizer == 8 * n_local
    assert m.total == m.states + m.activations + m.qat_copies + m.fsdp_buffers
    assert p.fits
    tight = plan(cfg, 1, 2, p.reserve_gib + m.total / 2**30 * 0.99, batch=4, seq=64,
                 device="cpu")
    assert not tight.fits
    assert "does NOT fit" in str(tight)


def test_smallest_layouts_fit_and_one_node_fewer_does_not():
    cfg = MoEConfig(vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64,
                    num_kv_heads=4, head_dim=128, expert_ffn=1536, num_experts=128, top_k=8,
                    dense_ffn=12288, max_seq_len=40960)  # Qwen3-235B-A22B
    p = plan(cfg, 1, 8, 141.0, batch=64, seq=4096, act_ckpt="full")
    assert not p.fits
    assert p.alternatives
    for layout, mode, mem in p.alternatives:
        assert mem.total <= p.budget_bytes
        fewer = layout.nodes - 1
        if fewer >= 1 and 64 % (fewer * 8) == 0:
            smaller = plan(cfg, fewer, 8, 141.0, batch=64, seq=4096, act_ckpt="full",
                           ep=min(layout.ep, fewer * 8), fsdp=fewer * 8 // min(layout.ep,
                                                                             fewer * 8))
            assert not smaller.fits


def test_submit_refuses_a_gpu_launch_that_cannot_fit_before_queueing(tmp_path):
    spec = LaunchSpec.build(preset="qwen3_30b_a3b_like", recipe="mxfp4", ep=1, gpus_per_node=1,
                            gpu_mem_gib=24.0, folder=tmp_path / "run", executor="local")
    with pytest.raises(LaunchSpecError, match="does not fit") as e:
        submit(spec)
    assert "optimizer" in str(e.value) and "GiB" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was queued or written
    # The override lets it through the check; a CPU launch is not checked at all.
    assert check_fits(LaunchSpec.build(preset="qwen3_30b_a3b_like", recipe="mxfp4", ep=1,
                                       gpus_per_node=1, gpu_mem_gib=24.0,
                                       skip_memory_check=True)) is not None
    assert check_fits(LaunchSpec.build(preset="qwen3_30b_a3b_like", ep=1)) is None
    fits = check_fits(LaunchSpec.build(preset="qwen3_30b_a3b_like", recipe="mxfp4", ep=1,
                                       gpus_per_node=1, batch=8, seq=512))
    assert fits.fits


def test_plan_cli(tmp_path):
    cmd = [sys.executable, "-m", "workbench.cli", "plan"]
    ok = subprocess.run([*cmd, "tiny", "--gpus", "1", "--batch", "8", "--seq", "64"], env=env(),
                        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "optimizer (AdamW m, v), fp32" in ok.stdout and "fits" in ok.stdout
    big = subprocess.run([*cmd, "qwen3_30b_a3b_like", "--layers", "48", "--gpus", "8",
                          "--batch", "64", "--seq", "4096"], env=env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert big.returncode == 1 and "does NOT fit" in big.stdout and "ckpt full" in big.stdout
    bad = subprocess.run([*cmd, str(tmp_path / "nothing"), "--gpus", "8"], env=env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "Traceback" not in bad.stderr


def test_fsdp_plan_with_its_reserve_covers_the_peak_measured_on_an_h200():
    """`python3 jobs/gpu/fsdp_world1.py` on an H200 (2026-12-02, torch 2.11): the GPU preset at
    world 1 with --fsdp, MXFP4, full checkpointing, batch 8 x 1024 peaked at 62.63 GiB (CUDA
    allocator). The plan plus the reserve it keeps per GPU must cover that peak; without the
    FSDP2 buffer row it fell 1 GiB short (53.6 + 8 < 62.6)."""
    from workbench.model import preset as model_preset

    mcfg = model_preset("qwen3_30b_a3b_like").replace(max_seq_len=1024)
    p = plan(mcfg, 1, 1, 141.0, batch=8, seq=1024, act_ckpt="full", device="cuda", qat=True,
             fsdp_on=True)
    assert p.memory.fsdp_buffers > 0
    assert p.memory.total / 2**30 + p.reserve_gib >= 62.63
    # the same layout without FSDP holds whole dense weights and no FSDP buffers
    plain = plan(mcfg, 1, 1, 141.0, batch=8, seq=1024, act_ckpt="full", device="cuda", qat=True)
    assert plain.memory.fsdp_buffers == 0
