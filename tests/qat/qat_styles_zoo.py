"""Expert modules of every style QAT must handle, built from the libraries that define them."""

from __future__ import annotations

import torch
from torch import nn

from workbench.model.experts import GroupedExperts

E, D, F = 4, 64, 32


class HFExpert(nn.Module):
    """The unfused per-expert layout checkpoints store (``experts.{e}.gate_proj`` ...)."""

    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(D, F, bias=False)
        self.up_proj = nn.Linear(D, F, bias=False)
        self.down_proj = nn.Linear(F, D, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class HFListMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList([HFExpert() for _ in range(E)])

    def forward(self, x_TD, offs):
        out, start = [], 0
        for e, end in enumerate(offs.tolist()):
            out.append(self.experts[e](x_TD[start:end]))
            start = end
        return torch.cat(out)


class TEGroupedLinear(nn.Module):
    """Duck-typed stand-in for TE's ``GroupedLinear``: parameters ``weight0..weightK`` [out, in]
    and ``forward(inp, m_splits)``, as TE defines them (TE itself cannot be imported here)."""

    def __init__(self, num_gemms, in_features, out_features):
        super().__init__()
        self.num_gemms = num_gemms
        for k in range(num_gemms):
            self.register_parameter(f"weight{k}", nn.Parameter(torch.empty(out_features, in_features)))

    def forward(self, inp, m_splits):
        outs = [x @ getattr(self, f"weight{k}").t() for k, x in enumerate(torch.split(inp, m_splits))]
        return torch.cat(outs)


class TEMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.Module()
        self.experts.linear_fc1 = TEGroupedLinear(E, D, 2 * F)
        self.experts.linear_fc2 = TEGroupedLinear(E, F, D)

    def forward(self, x_TD, offs):
        splits = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        h = self.experts.linear_fc1(x_TD, splits)
        g, u = h.chunk(2, dim=-1)
        return self.experts.linear_fc2(nn.functional.silu(g) * u, splits)


class StackedMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = GroupedExperts(E, D, F)

    def forward(self, x_TD, offs):
        return self.experts(x_TD, offs)


def _routing(offs):
    """top-1 routing tensors for transformers' fused experts from our sorted offsets."""
    ends = offs.tolist()
    idx = torch.cat([torch.full((end - start,), e) for e, (start, end)
                     in enumerate(zip([0] + ends[:-1], ends))])
    return idx[:, None], torch.ones(len(idx), 1)


class HFFusedMoE(nn.Module):
    """transformers 5 fused experts (Qwen3-MoE): gate_up_proj [E, 2F, D], down_proj [E, D, F]."""

    def __init__(self):
        super().__init__()
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E)
        self.experts = Qwen3MoeExperts(cfg)

    def forward(self, x_TD, offs):
        idx, w = _routing(offs)
        return self.experts(x_TD, idx, w.to(x_TD.dtype))


class GptOssMoE(nn.Module):
    """gpt-oss experts: gate_up_proj [E, D, 2F] (interleaved), down_proj [E, F, D], biases."""

    def __init__(self):
        super().__init__()
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E)
        self.experts = GptOssExperts(cfg)

    def forward(self, x_TD, offs):
        idx, w = _routing(offs)
        return self.experts(x_TD, router_indices=idx, routing_weights=w.to(x_TD.dtype))


STYLES = {
    "stacked": StackedMoE,
    "hf-linear": HFListMoE,
    "hf-fused": HFFusedMoE,
    "gpt-oss": GptOssMoE,
    "te": TEMoE,
}


def build(style: str, dtype=torch.bfloat16, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = STYLES[style]()
    with torch.no_grad():
        for p in m.parameters():
            # heavy-ish tails so several scale exponents occur per tensor
            p.copy_(torch.randn_like(p) * torch.rand_like(p).clamp_min(0.1).reciprocal().sqrt() * 0.05)
    return m.to(dtype)
