"""Typed configuration of the workbench's MoE transformer: its blocks, presets, and the bridge to
each supported family's config.json.

    from workbench.arch import from_checkpoint, preset
    cfg = from_checkpoint("./gpt-oss-20b")      # MoEConfig(family="gpt_oss", attention=..., ...)
    cfg = preset("deepseek_v3_like", num_layers=2)

- `config.py`: `MoEConfig`, the one description of a model (shape fields + blocks + family);
- `blocks.py`: `AttentionConfig` (GQA / MLA, sinks, windows, biases), `RopeConfig` (default /
  YaRN, partial, interleaved), `RouterConfig` (softmax / top-k-softmax / sigmoid with groups),
  `ExpertConfig` (SwiGLU / gpt-oss's clamped SwiGLU, biases);
- `families.py`: config.json <-> MoEConfig through transformers' config classes;
- `presets.py`: CPU test models and GPU benchmark shapes.

It lives at the top level, not in `workbench.model`, and imports only the standard library at
import time: the launcher (`workbench.launch`) and the trainer's configuration
(`workbench.train.config`) read presets from here without loading torch, which importing anything
under `workbench.model` does. `workbench.model` re-exports the public names.
"""

from workbench.arch.blocks import (
    AttentionConfig,
    ExpertConfig,
    RopeConfig,
    RouterConfig,
    yarn_mscale,
)
from workbench.arch.config import FAMILY_NAMES, MX_BLOCK, MoEConfig
from workbench.arch.families import (
    FAMILIES,
    SUPPORTED_ARCHITECTURES,
    Family,
    ModelConfigError,
    config_from_dict,
    from_checkpoint,
    from_hf_config,
    to_hf_config,
)
from workbench.arch.presets import (
    PRESETS,
    deepseek_v3_like,
    gpt_oss_20b_like,
    k3_like,
    kimi_k2_like,
    preset,
    qwen3_30b_a3b_like,
    register_preset,
    small,
    tiny,
    tiny_deepseek,
    tiny_glm,
    tiny_gpt_oss,
)

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "MX_BLOCK",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionConfig",
    "ExpertConfig",
    "Family",
    "MoEConfig",
    "ModelConfigError",
    "RopeConfig",
    "RouterConfig",
    "config_from_dict",
    "deepseek_v3_like",
    "from_checkpoint",
    "from_hf_config",
    "gpt_oss_20b_like",
    "k3_like",
    "kimi_k2_like",
    "preset",
    "qwen3_30b_a3b_like",
    "register_preset",
    "small",
    "tiny",
    "tiny_deepseek",
    "tiny_glm",
    "tiny_gpt_oss",
    "to_hf_config",
    "yarn_mscale",
]
