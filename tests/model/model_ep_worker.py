"""Expert-parallel worker processes for test_model_expert_parallel (real gloo, one process per rank).

Each rank writes what it computed to `<out>/<case>.rank<r>.safetensors`; the test process
computes the EP1 reference itself and compares.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.model import (
    AllToAllDispatcher,
    GroupedExperts,
    LocalDispatcher,
    MoEForCausalLM,
    shard_experts_,
    sync_gradients,
    tiny,
)

GLOBAL_BATCH, SEQ = 8, 12
MODEL_CASES = ("random", "starved")


def model_config():
    return tiny(num_layers=3, mlp_only_layers=(1,), shared_expert_ffn=32, shared_expert_gate=True)


def starve_router_(model: MoEForCausalLM) -> None:
    """Make experts 4..7 unreachable in every MoE layer (so EP2's rank 1, EP4's ranks 2-3 and
    EP8's ranks 4-7 receive no token at all; expert 4..7 get none either).

    Rows 0..3 are (v, -v, u, -u): for every token two of those logits are positive, while
    experts 4..7 have logit 0, so top-2 never picks them."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for block in model.moe_blocks():
            w_ED = block.gate.weight
            v, u = torch.randn(2, w_ED.shape[1], generator=gen)
            v, u = v.to(w_ED.device), u.to(w_ED.device)
            w_ED.zero_()
            w_ED[0], w_ED[1], w_ED[2], w_ED[3] = v, -v, u, -u


def model_inputs(step: int = 0):
    gen = torch.Generator().manual_seed(1234 + step)
    return torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=gen)


TRAIN_STEPS = 4


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def reference_losses(case: str) -> torch.Tensor:
    """EP1 per-step losses of the same short training run (first step's backward included)."""
    model = build_model(case)
    opt = make_optimizer(model)
    losses = []
    for step in range(TRAIN_STEPS):
        ids = model_inputs(step)
        loss = model(ids, ids).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses)


def build_model(case: str, ep_group=None, device: str | torch.device = "cpu") -> MoEForCausalLM:
    model = MoEForCausalLM(model_config(), seed=0, ep_group=ep_group, device=device)
    if case == "starved":
        starve_router_(model)
    return model


# Dispatcher-level cases: hand-made routing, including ranks with no input tokens at all.
NUM_EXPERTS, HIDDEN, FFN, TOP_K = 8, 32, 32, 2


def dispatch_inputs(case: str, world: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per-rank (x_TD, experts_TK, weights_TK), the same for every world size once concatenated."""
    gen = torch.Generator().manual_seed(5)
    tokens = [3, 0, 5, 1, 0, 4, 2, 6] if case != "all_to_expert_0_1" else [4] * 8
    out = []
    for r in range(8):
        T = tokens[r]
        x = torch.randn(T, HIDDEN, generator=gen)
        if case == "all_to_expert_0_1":
            idx = torch.tensor([[0, 1]] * T, dtype=torch.long).reshape(T, TOP_K)
        else:  # experts 2 and 6 never used
            pool = torch.tensor([0, 1, 3, 4, 5, 7])
            idx = torch.stack([pool[torch.randperm(6, generator=gen)[:TOP_K]] for _ in range(T)]
                              ) if T else torch.empty(0, TOP_K, dtype=torch.long)
        w = torch.rand(T, TOP_K, generator=gen)
        out.append((x, idx, w))
    # Fold the 8 logical ranks onto `world` ranks so the global data do not depend on world.
    per = 8 // world
    return [tuple(torch.cat([out[r * per + i][j] for i in range(per)]) for j in range(3))
            for r in range(world)]


def dispatch_experts() -> GroupedExperts:
    experts = GroupedExperts(NUM_EXPERTS, HIDDEN, FFN)
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return experts


def dispatch_upstream(x_TD: torch.Tensor) -> torch.Tensor:
    """An upstream gradient that depends only on the row, not on which rank holds it."""
    return torch.sin(1.7 * x_TD.detach() + 0.3)


def run_dispatch(case: str, rank: int, world: int, ep: bool,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    x, idx, w = (t.to(device) for t in dispatch_inputs(case, world)[rank])
    x.requires_grad_(True)
    experts = dispatch_experts().to(device)
    if ep:
        local = NUM_EXPERTS // world
        experts.narrow_(rank * local, local)
    dispatcher = AllToAllDispatcher() if ep else LocalDispatcher()
    y = dispatcher(x, idx, w, experts)
    (y * dispatch_upstream(x)).sum().backward()
    out = {"y": y.detach(), "x_grad": x.grad}
    out.update({f"{n}_grad": p.grad for n, p in experts.named_parameters()})
    out = {k: v.cpu() for k, v in out.items()}
    return out


def worker(rank: int, world: int, port: int, out_dir: str, backend: str = "gloo") -> None:
    """backend "gloo": CPU; "nccl": one GPU per rank, the same code path otherwise."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # compare against fp32 CPU math
    dist.init_process_group(backend, rank=rank, world_size=world)
    from safetensors.torch import save_file
    try:
        out = Path(out_dir)
        for case in MODEL_CASES:
            model = build_model(case, ep_group=dist.group.WORLD, device=device)
            # Building sharded must equal building whole and cutting (per-expert seeded init).
            whole = build_model(case, device=device)
            shard_experts_(whole, dist.group.WORLD)
            for (n, a), (_, b) in zip(model.named_parameters(), whole.named_parameters()):
                assert torch.equal(a, b), f"rank {rank}: sharded build differs at {n}"
            per = GLOBAL_BATCH // world
            ids = model_inputs()[rank * per:(rank + 1) * per].to(device)
            result = model(ids, ids)
            result.loss.backward()
            sync_gradients(model)
            loss = result.loss.detach().clone()
            dist.all_reduce(loss)
            tensors = {"mean_loss": loss / world, "aux_loss": result.aux_loss.detach()}
            tensors.update({f"grad/{n}": p.grad for n, p in model.named_parameters()})
            # A few optimizer steps: sharded experts and replicated dense weights must keep
            # following the EP1 trajectory (AdamW is elementwise, so sharding cannot change it).
            losses = [loss / world]
            opt = make_optimizer(model)
            for step in range(1, TRAIN_STEPS):
                opt.step()
                opt.zero_grad(set_to_none=True)
                ids = model_inputs(step)[rank * per:(rank + 1) * per].to(device)
                step_loss = model(ids, ids).loss
                step_loss.backward()
                sync_gradients(model)
                step_loss = step_loss.detach().clone()
                dist.all_reduce(step_loss)
                losses.append(step_loss / world)
            tensors["step_losses"] = torch.stack(losses)
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                      out / f"{case}.rank{rank}.safetensors")
        for case in ("sparse", "all_to_expert_0_1"):
            tensors = run_dispatch(case, rank, world, ep=True, device=device)
            save_file({k: v.contiguous() for k, v in tensors.items()},
                      out / f"dispatch_{case}.rank{rank}.safetensors")
        dist.barrier()
    finally:
        dist.destroy_process_group()
