"""Our model against transformers' Qwen3MoeForCausalLM: logits, losses, aux loss, gradients."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the oracle (pip install 'workbench[dev]')")

from model_hf_oracle import random_hf_model

from workbench.model import MoEForCausalLM, hf_to_ours, load_hf_state_dict, tiny

CASES = {
    "tiny": tiny(),
    "no_renorm": tiny(norm_topk_prob=False, top_k=3),
    "mlp_only_layer": tiny(num_layers=3, mlp_only_layers=(1,)),
    "sparse_step_2": tiny(num_layers=2, decoder_sparse_step=2),
    "tied_mha": tiny(tie_embeddings=True, num_kv_heads=4),
}


def _ours_from_hf(cfg, hf):
    ours = MoEForCausalLM(cfg, seed=123)
    load_hf_state_dict(ours, hf.state_dict())
    return ours.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_losses_and_grads_match_transformers(case):
    cfg = CASES[case]
    hf = random_hf_model(cfg, seed=7)
    ours = _ours_from_hf(cfg, hf)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 5:9] = -100  # ignored positions must be ignored the same way

    ref = hf(input_ids=ids, labels=labels, output_router_logits=True)
    out = ours(ids, labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    assert len(out.router_logits) == len(ref.router_logits)

    ref.loss.backward()
    out.loss.backward()
    ref_grads = hf_to_ours({n: p.grad for n, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_routing_actually_differs_between_experts():
    # Guards the parity test above: with identical experts a routing bug could not show.
    cfg = tiny()
    hf = random_hf_model(cfg, seed=7)
    ours = _ours_from_hf(cfg, hf)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    base = ours(ids).logits
    with torch.no_grad():
        experts = ours.model.layers[0].mlp.experts
        experts.w2.copy_(experts.w2.roll(1, dims=0))
    assert (ours(ids).logits - base).abs().max() > 1e-3


def test_loads_per_expert_checkpoint_written_by_transformers(tmp_path):
    from safetensors.torch import load_file

    cfg = tiny()
    hf = random_hf_model(cfg, seed=11)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk  # the unfused disk layout
    ours = MoEForCausalLM(cfg, seed=0)
    load_hf_state_dict(ours, on_disk)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(ids).logits, hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_transformers_loads_our_export(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from workbench.model import to_hf_config, to_hf_state_dict

    cfg = tiny(tie_embeddings=True)
    ours = MoEForCausalLM(cfg, seed=5).eval()
    with torch.no_grad():  # non-trivial norms and router, so the export is fully exercised
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif "mlp.gate." in name:
                p.mul_(20)
    sd = {k: v.contiguous() for k, v in to_hf_state_dict(ours, layout="per_expert").items()}
    assert "lm_head.weight" not in sd
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    to_hf_config(cfg).save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf(input_ids=ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def test_bf16_logits_bit_identical_to_transformers_sdpa():
    # Same op order and casts as transformers (RMSNorm cast before the weight, fp32 RoPE tables
    # cast to the activation dtype, fp32 router softmax), so bf16 results agree bit for bit
    # when both use SDPA attention.
    cfg = tiny()
    hf = random_hf_model(cfg, seed=7)
    ours = _ours_from_hf(cfg, hf).to(torch.bfloat16)
    hf = hf.to(torch.bfloat16)
    hf.config._attn_implementation = "sdpa"
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, hf(input_ids=ids).logits)
