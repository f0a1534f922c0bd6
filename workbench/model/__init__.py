"""The MoE transformer of every supported family, its blocks, key maps and loader.

Typical use:
    from workbench.model import from_pretrained, MoEForCausalLM, tiny
    model = from_pretrained("./gpt-oss-20b")     # any supported checkpoint, BF16 or packed
    model(input_ids_BS).logits
    model = MoEForCausalLM(tiny(), seed=0)        # a random model of a preset
    out = model(input_ids_BS, labels_BS=input_ids_BS)   # out.loss, out.logits, out.aux_loss
Expert parallelism: `MoEForCausalLM(cfg, ep_group=group)` or `shard_experts_(model, group)`,
then `sync_gradients(model, group)` after backward.
"""

from workbench.arch import (
    PRESETS,
    SUPPORTED_ARCHITECTURES,
    AttentionConfig,
    ExpertConfig,
    ModelConfigError,
    MoEConfig,
    RopeConfig,
    RouterConfig,
    deepseek_v3_like,
    from_checkpoint,
    from_hf_config,
    gpt_oss_20b_like,
    k3_like,
    kimi_k2_like,
    preset,
    qwen3_30b_a3b_like,
    small,
    tiny,
    tiny_deepseek,
    tiny_glm,
    tiny_gpt_oss,
    to_hf_config,
)
from workbench.model.attention import Attention, MLAttention
from workbench.model.dispatch import AllToAllDispatcher, LocalDispatcher
from workbench.model.experts import ClampedSwiGLU, GroupedExperts, swiglu
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
from workbench.model.pretrained import (
    PretrainedError,
    check_pretrained,
    from_pretrained,
    load_pretrained_,
)
from workbench.model.rope import RotaryEmbedding
from workbench.model.router import (
    SigmoidRouter,
    TopKRouter,
    TopKSoftmaxRouter,
    load_balancing_loss,
)
from workbench.model.transformer import IGNORE_INDEX, MoEForCausalLM, MoEOutput

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AllToAllDispatcher",
    "Attention",
    "AttentionConfig",
    "ClampedSwiGLU",
    "ExpertConfig",
    "GroupedExperts",
    "LocalDispatcher",
    "MLAttention",
    "MoEBlock",
    "MoEConfig",
    "MoEForCausalLM",
    "MoEOutput",
    "ModelConfigError",
    "PretrainedError",
    "RopeConfig",
    "RotaryEmbedding",
    "RouterConfig",
    "SigmoidRouter",
    "StateDictError",
    "TopKRouter",
    "TopKSoftmaxRouter",
    "check_pretrained",
    "deepseek_v3_like",
    "from_checkpoint",
    "from_hf_config",
    "from_pretrained",
    "gpt_oss_20b_like",
    "hf_to_ours",
    "install_expert_parallel",
    "is_expert_param",
    "k3_like",
    "kimi_k2_like",
    "load_balancing_loss",
    "load_hf_state_dict",
    "load_pretrained_",
    "ours_to_hf",
    "preset",
    "qwen3_30b_a3b_like",
    "shard_experts_",
    "small",
    "swiglu",
    "sync_gradients",
    "tiny",
    "tiny_deepseek",
    "tiny_glm",
    "tiny_gpt_oss",
    "to_hf_config",
    "to_hf_state_dict",
]
