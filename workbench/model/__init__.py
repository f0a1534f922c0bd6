"""The reference MoE transformer (Qwen3-MoE compatible), router, grouped experts, dispatchers.

Typical use:
    from workbench.model import MoEForCausalLM, tiny
    model = MoEForCausalLM(tiny(), seed=0)
    out = model(input_ids_BS, labels_BS=input_ids_BS)   # out.loss, out.logits, out.aux_loss
Expert parallelism: `MoEForCausalLM(cfg, ep_group=group)` or `shard_experts_(model, group)`,
then `sync_gradients(model, group)` after backward.
"""

from workbench.arch import (
    SUPPORTED_ARCHITECTURES,
    ModelConfigError,
    MoEConfig,
    from_checkpoint,
    from_hf_config,
    k3_like,
    preset,
    qwen3_30b_a3b_like,
    small,
    tiny,
    to_hf_config,
)
from workbench.model.dispatch import AllToAllDispatcher, LocalDispatcher
from workbench.model.experts import GroupedExperts
from workbench.model.hf import (
    StateDictError,
    hf_to_ours,
    load_hf_state_dict,
    ours_to_hf,
    to_hf_state_dict,
)
from workbench.model.moe import MoEBlock
from workbench.model.parallel import (
    install_expert_parallel,
    is_expert_param,
    shard_experts_,
    sync_gradients,
)
from workbench.model.router import TopKRouter, load_balancing_loss
from workbench.model.transformer import IGNORE_INDEX, MoEForCausalLM, MoEOutput

__all__ = [
    "IGNORE_INDEX", "SUPPORTED_ARCHITECTURES", "AllToAllDispatcher", "GroupedExperts",
    "LocalDispatcher", "MoEBlock", "MoEConfig", "MoEForCausalLM", "MoEOutput", "ModelConfigError",
    "StateDictError", "TopKRouter", "from_checkpoint", "from_hf_config", "hf_to_ours",
    "install_expert_parallel", "is_expert_param", "k3_like", "load_balancing_loss",
    "load_hf_state_dict", "ours_to_hf", "preset", "qwen3_30b_a3b_like", "shard_experts_", "small",
    "sync_gradients", "tiny", "to_hf_config", "to_hf_state_dict",
]
