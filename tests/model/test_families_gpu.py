"""Every family on CUDA: the model of each family preset computes the CPU model's logits, loss
and gradients in fp32 (the CPU model is the one proven against transformers in
test_families_parity.py), and a bf16-autocast step (the trainer's GPU precision) stays close
and finite. Sinks and windows run FlexAttention (the CPU: SDPA with a mask and a sink key), MLA
SDPA with padded values: the CUDA kernels those take are exercised here. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from workbench.model import MoEForCausalLM, tiny_deepseek, tiny_glm, tiny_gpt_oss

pytestmark = pytest.mark.gpu
CASES = {"gpt_oss": tiny_gpt_oss(), "deepseek_v3": tiny_deepseek(), "glm4_moe": tiny_glm()}


@pytest.fixture(autouse=True)
def _cuda_fp32():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 against fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _step(model, ids):
    out = model(ids, ids, return_logits=True)
    out.loss.backward()
    return out, {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_fp32_matches_cpu(case):
    cfg = CASES[case]
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    cpu_out, cpu_grads = _step(MoEForCausalLM(cfg, seed=3), ids)
    gpu_out, gpu_grads = _step(MoEForCausalLM(cfg, seed=3, device="cuda"), ids.cuda())
    torch.testing.assert_close(gpu_out.logits.cpu(), cpu_out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_out.loss.cpu(), cpu_out.loss, rtol=1e-5, atol=1e-5)
    assert set(gpu_grads) == set(cpu_grads)
    for name, g in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_autocast_step_is_close_and_finite(case):
    cfg = CASES[case]
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0)).cuda()
    ref, _ = _step(MoEForCausalLM(cfg, seed=3, device="cuda"), ids)
    model = MoEForCausalLM(cfg, seed=3, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, grads = _step(model, ids)
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) < 0.05
    assert all(torch.isfinite(g).all() for g in grads.values())
