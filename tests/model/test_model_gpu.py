"""The same model and EP code path on CUDA (NCCL between GPUs). Skipped without a GPU."""

from __future__ import annotations

import socket

import model_ep_worker as W
import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 against fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _step(model, ids):
    out = model(ids, ids)
    out.loss.backward()
    return out, {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def test_cuda_fp32_matches_cpu():
    ids = W.model_inputs()
    cpu_out, cpu_grads = _step(W.build_model("random"), ids)
    gpu_out, gpu_grads = _step(W.build_model("random", device="cuda"), ids.cuda())
    torch.testing.assert_close(gpu_out.logits.cpu(), cpu_out.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_out.loss.cpu(), cpu_out.loss, rtol=1e-5, atol=1e-5)
    for name, g in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_bf16_autocast_step_is_close_and_finite():
    ids = W.model_inputs().cuda()
    ref, _ = _step(W.build_model("random", device="cuda"), ids)
    model = W.build_model("random", device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, grads = _step(model, ids)
    assert out.logits.dtype == torch.bfloat16
    assert abs(float(out.loss.detach()) - float(ref.loss.detach())) < 0.05
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.distributed
def test_nccl_expert_parallel_matches_cpu_reference(tmp_path):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs 2 or more GPUs for NCCL expert parallelism")
    world = 2 if world < 4 else (4 if world < 8 else 8)
    from safetensors.torch import load_file

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: this process has initialised CUDA.
    mp.start_processes(W.worker, args=(world, port, str(tmp_path), "nccl"), nprocs=world,
                       join=True, start_method="spawn")
    for case in W.MODEL_CASES:
        model = W.build_model(case)
        ids = W.model_inputs()
        out = model(ids, ids)
        out.loss.backward()
        got = [load_file(tmp_path / f"{case}.rank{r}.safetensors") for r in range(world)]
        torch.testing.assert_close(got[0]["mean_loss"], out.loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0]["step_losses"], W.reference_losses(case), rtol=1e-4,
                                   atol=1e-4)
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
                mine = torch.cat([g[f"grad/{name}"] for g in got])
            else:
                mine = got[world - 1][f"grad/{name}"]
            torch.testing.assert_close(mine, p.grad, rtol=1e-3, atol=1e-5, msg=f"{case}: {name}")
    for case in ("sparse", "all_to_expert_0_1"):
        ref = W.run_dispatch(case, rank=0, world=1, ep=False)
        got = [load_file(tmp_path / f"dispatch_{case}.rank{r}.safetensors") for r in range(world)]
        for key, value in ref.items():
            torch.testing.assert_close(torch.cat([g[key] for g in got]), value, rtol=1e-4,
                                       atol=1e-5, msg=f"{case}: {key}")
