"""The sparse MoE block: router -> dispatcher -> grouped experts, plus an optional shared expert.

Legend: B batch, S sequence, T = B*S tokens, D hidden, E global experts, K top-k.
Routed part = transformers' `Qwen3MoeSparseMoeBlock` / `GptOssMLP` / `DeepseekV3MoE` (the
router kind, the experts' activation and biases come from the config); the shared expert follows
`DeepseekV3MoE` (y += shared_experts(x)) or, with `shared_expert_gate`,
`Qwen2MoeSparseMoeBlock` (y += sigmoid(shared_expert_gate(x)) * shared_expert(x)).
Internal names are the same for every family (`gate`, `experts`, `shared_expert`); the key map
(`workbench.model.hf`) renames gpt-oss's `router` and DeepSeek's `shared_experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.arch import MoEConfig
from workbench.model.cast import Linear
from workbench.model.dispatch import LocalDispatcher
from workbench.model.experts import GroupedExperts, activation
from workbench.model.layers import SwiGLU
from workbench.model.router import make_router


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, *, ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        if cfg.num_experts % ep_size:
            raise ValueError(f"num_experts ({cfg.num_experts}) must be divisible by the expert-"
                             f"parallel size ({ep_size}) for contiguous expert sharding")
        local = cfg.num_experts // ep_size
        self.gate = make_router(cfg)
        self.experts = GroupedExperts(local, cfg.hidden_size, cfg.expert_ffn,
                                      num_global_experts=cfg.num_experts,
                                      expert_offset=ep_rank * local, bias=cfg.experts.bias,
                                      act=activation(cfg.experts))
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_ffn) if cfg.shared_expert_ffn else None
        self.shared_expert_gate = (Linear(cfg.hidden_size, 1, bias=False)
                                   if cfg.shared_expert_gate else None)
        # Not a submodule: holds no parameters and, under EP, a process group.
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (y_BSD, router_logits_TE); the logits feed the load-balancing loss."""
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE, weights_TK, experts_TK = self.gate(x_TD)
        y_TD = self.dispatcher(x_TD, experts_TK, weights_TK, self.experts)
        if self.shared_expert is not None:
            shared_TD = self.shared_expert(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        return y_TD.view_as(x_BSD), logits_TE
