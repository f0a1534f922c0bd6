"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over an expert-parallel MoE (`Layout.fsdp`).

Units, innermost first (torchtitan's layout for MoEs):
- each MoE layer's routed experts over the "dp" mesh dimension: the ranks that hold the same EP
  slice of experts. They shard on dim 1 (Shard(1): F of w1/w3, D of w2), so a rank's slice of the
  global [E, O, I] stack is one rectangle: experts by EP index, the second dim by dp index. A
  checkpoint can then name it as a plain 2-D DTensor (checkpointing.state_dict);
- each decoder layer (attention, norms, router, shared expert) over every rank (the 1-D world mesh);
- the root (embeddings, final norm, lm_head) over every rank.

Gradient meaning stays the one of `workbench.model.parallel` (gradient of the mean of the ranks'
losses). FSDP's reduce-scatter divides by the size of the mesh it reduces over. Dense parameters
reduce over the world: the mean, as wanted. Expert gradients already hold the contributions of
the whole EP group's tokens (the backward all-to-all delivered them), and FSDP sums them over dp:
the sum over all W ranks, so they are divided by W, not dp (`set_gradient_divide_factor`). At
EP 1 the two agree (dp = W). `sync_gradients` is skipped: FSDP has reduced everything.

Mixed precision on CUDA: parameters gathered and computed in BF16, gradients reduced in fp32, masters
and AdamW state fp32 (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`). On CPU the
compute stays fp32: CPU BF16 matmuls are slow and round per kernel, and the CPU tests compare
layouts at fp32 accuracy.

Fake quantization (workbench.qat) happens inside GroupedExperts.forward, on the parameters FSDP has
just all-gathered: a rank quantizes the whole of each of its local experts, so per-expert scales
(NVFP4's amax) are those of the unsharded model (test: tests/train/test_fsdp.py). The experts'
seam receives its weights by role, so FSDP swapping the registered parameters needs nothing here.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.model.experts import GroupedExperts
from workbench.train.distributed import Layout

EXPERT_DIM = 1  # the dim FSDP shards expert stacks on (see the module doc)


def apply_fsdp(model: nn.Module, layout: Layout, device: torch.device) -> nn.Module:
    """Shard `model` (a workbench MoEForCausalLM, experts already EP-sliced, QAT prepared,
    activation checkpointing applied) in place; call before building the optimizer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    if not layout.fsdp or layout.mesh is None:
        raise ValueError("apply_fsdp needs a Layout with fsdp=True")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device.type == "cuda" else MixedPrecisionPolicy())
    dp_mesh = layout.mesh["dp"]
    for name, p in model.named_parameters():
        # FSDP2 needs Shard(1) to split evenly (it pads only dim 0).
        if isinstance(model.get_submodule(name.rpartition(".")[0]), GroupedExperts) and \
                p.shape[EXPERT_DIM] % layout.dp:
            raise ValueError(f"apply_fsdp: {name} {tuple(p.shape)}: dim {EXPERT_DIM} does not "
                             f"split over the {layout.dp} data-parallel ranks of an EP group "
                             "(TrainConfig.ep / world size)")
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, GroupedExperts):
                fully_shard(module, mesh=dp_mesh, mp_policy=mp,
                            shard_placement_fn=lambda _p: Shard(EXPERT_DIM))
                module.set_gradient_divide_factor(float(layout.world))
                if device.type != "cuda" and layout.dp > 1:
                    # A factor other than the mesh size is a PREMUL_SUM reduce-scatter on
                    # NCCL; gloo has none, so sum and divide separately there. Not at dp 1:
                    # there torch 2.13 skips the collective, divides the copy by the factor
                    # and then divides again after it (1/W^2; seen as a 0.08% grad-norm error
                    # at EP2 world 2), while without it the copy's one division is all.
                    module.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=layout.world_mesh, mp_policy=mp)
    fully_shard(model, mesh=layout.world_mesh, mp_policy=mp)
    return model


def reshard_(model: nn.Module) -> None:
    """Put every FSDP unit back to its sharded parameters (a no-grad forward, e.g. validation,
    can leave the root's gathered), so named_parameters() holds the shards a checkpoint saves."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
