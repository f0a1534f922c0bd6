"""DeepSeek-V3's auxiliary-loss-free balancing during training (`--router-bias-update RATE`).

Sigmoid routers (DeepSeek-V3, Kimi K2, GLM-4.5) pick experts on scores plus
`e_score_correction_bias`. The bias takes no gradient; by default it stays as the checkpoint
has it. With a rate, after every optimizer step each layer's bias moves by -rate for experts
that received more than the layer's mean load in the step and +rate for those that received
less (DeepSeek-V3 technical report, arXiv 2412.19437, section 2.1.2; it used 0.001). Loads are
counted over the global batch: each rank counts its tokens from the step's router logits, one
all-reduce sums them, so every replica of the (replicated or FSDP-sharded) bias moves the same.
The bias is a parameter, so DCP checkpoints, resume and exports carry it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from workbench.model.router import SigmoidRouter


def sigmoid_routers(model: nn.Module) -> list[SigmoidRouter]:
    """The model's MoE routers in layer order, when they are sigmoid routers (else [])."""
    routers = [block.gate for block in model.moe_blocks()]
    return routers if routers and all(isinstance(r, SigmoidRouter) for r in routers) else []


@torch.no_grad()
def update_router_biases_(model: nn.Module, router_logits: Sequence[torch.Tensor], rate: float,
                          group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """Apply the update after an optimizer step; collective over `group` (the ranks whose
    batches form the global batch). `router_logits`: the step's `MoEOutput.router_logits`.
    Returns the [L, E] global loads (None when the model has no sigmoid router)."""
    routers = sigmoid_routers(model)
    if not routers:
        return None
    if len(routers) != len(router_logits):
        raise ValueError(f"{len(router_logits)} router logits for {len(routers)} MoE layers")
    loads_LE = torch.stack([r.loads(logits) for r, logits in zip(routers, router_logits)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads_LE, group=group)
    for router, load_E in zip(routers, loads_LE):
        router.update_correction_bias_(load_E, rate)
    return loads_LE
