"""The causal LM of every supported family (Qwen3-MoE, gpt-oss, DeepSeek-V3 / Kimi K2, GLM-4.5).

Legend: B batch, S sequence, D hidden, V vocab, T = B*S tokens, E experts.

A decoder layer is attention (GQA or MLA, `workbench.model.attention`), then a MoE block or a
dense SwiGLU MLP (`MoEConfig.is_moe_layer`), each behind an RMSNorm and a residual. Module and
parameter names equal transformers' for the family except the routed experts
(`mlp.experts.w1/w3/w2[/b1/b3/b2]`) and the few renames of `workbench.model.hf`. Differences in
behaviour: no KV cache, no padding mask (training model: causal attention over full sequences).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.arch import MoEConfig
from workbench.model.attention import make_attention
from workbench.model.cast import Linear
from workbench.model.experts import GroupedExperts
from workbench.model.layers import RMSNorm, SwiGLU
from workbench.model.loss import linear_cross_entropy
from workbench.model.moe import MoEBlock
from workbench.model.rope import RotaryEmbedding
from workbench.model.router import SigmoidRouter, load_balancing_loss
from workbench.model.parallel import install_expert_parallel

IGNORE_INDEX = -100


@dataclass
class MoEOutput:
    logits: torch.Tensor | None  # [B, S, V]; None when asked not to make them (return_logits)
    loss: torch.Tensor | None  # ce_loss + aux_loss_coef * aux_loss, when labels are given
    ce_loss: torch.Tensor | None
    aux_loss: torch.Tensor | None  # None when the model has no MoE layer
    router_logits: tuple[torch.Tensor, ...]  # one [T, E] per MoE layer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int, *, ep_rank: int, ep_size: int) -> None:
        super().__init__()
        self.self_attn = make_attention(cfg, layer)
        self.mlp: nn.Module = (MoEBlock(cfg, ep_rank=ep_rank, ep_size=ep_size)
                               if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.dense_ffn))
        self.input_layernorm = _norm(cfg)
        self.post_attention_layernorm = _norm(cfg)

    def forward(self, h_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h_BSD = h_BSD + self.self_attn(self.input_layernorm(h_BSD), rope)
        x_BSD = self.post_attention_layernorm(h_BSD)
        if isinstance(self.mlp, MoEBlock):
            y_BSD, logits_TE = self.mlp(x_BSD)
            return h_BSD + y_BSD, logits_TE
        return h_BSD + self.mlp(x_BSD), None


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig, *, ep_rank: int, ep_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, ep_rank=ep_rank, ep_size=ep_size) for i in range(cfg.num_layers))
        self.norm = _norm(cfg)
        self.rotary_emb = RotaryEmbedding(cfg)


def _norm(cfg: MoEConfig) -> RMSNorm:
    # gpt-oss multiplies by the weight before casting back (transformers' GptOssRMSNorm)
    return RMSNorm(cfg.hidden_size, cfg.rms_eps, cast_last=cfg.family == "gpt_oss")


class MoEForCausalLM(nn.Module):
    """`MoEForCausalLM(cfg, seed=0)`; with `ep_group` only this rank's experts are built.

    Initialisation draws every tensor (and every expert separately) from a generator seeded by
    (seed, parameter name, global expert index), so a model built sharded over any EP size holds
    exactly the slices of the model built whole, and the global RNG is left alone.
    """

    def __init__(self, cfg: MoEConfig, *, seed: int = 0, ep_group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        # Build on the meta device, then allocate: no throw-away default init (GBs for the GPU
        # presets) and no draw from the global RNG, so building a model never shifts the data
        # order of a seeded run. reset_parameters below fills every tensor.
        with torch.device("meta"):
            self.model = MoEModel(cfg, ep_rank=ep_rank, ep_size=ep_size)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if dtype is not None:
            self.to(dtype=dtype)
            for m in self.modules():  # transformers keeps sigmoid routers in fp32 at any dtype
                if isinstance(m, SigmoidRouter):
                    m.float()
        self.to_empty(device=device if device is not None else torch.get_default_device())
        if cfg.tie_embeddings:  # after to_empty, which would allocate the two names separately
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary_emb.reset_inv_freq()
        self.ep_group: dist.ProcessGroup | None = None
        # The ranks whose concatenated batch the load-balancing loss describes; None: ep_group.
        # When EP < the data-parallel world (FSDP layouts), the trainer sets the whole world, so
        # the aux loss is the one of the global batch at every layout (what EP1 computes).
        self.balance_group: dist.ProcessGroup | None = None
        if ep_group is not None:
            install_expert_parallel(self, ep_group)
        if self.lm_head.weight.device.type != "meta":
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        std = self.config.init_std
        for mod_name, module in self.named_modules():
            for p_name, param in module.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if isinstance(module, RMSNorm):
                    param.fill_(1.0)
                elif isinstance(module, SigmoidRouter) and p_name == "e_score_correction_bias":
                    param.zero_()  # as transformers initialises it; it moves only by updates
                elif isinstance(module, GroupedExperts):
                    for e in range(module.num_experts):
                        param[e].copy_(_normal(param.shape[1:], std, seed, name,
                                               module.expert_offset + e))
                elif not (module is self.lm_head and self.config.tie_embeddings):
                    param.copy_(_normal(param.shape, std, seed, name, None))

    def moe_blocks(self) -> list[MoEBlock]:
        return [m for m in self.modules() if isinstance(m, MoEBlock)]

    def forward(self, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor | None = None, *,
                positions_BS: torch.Tensor | None = None, return_logits: bool = True,
                logits_at_B: torch.Tensor | None = None) -> MoEOutput:
        """Labels follow transformers: `labels = input_ids` is shifted inside (token t predicts
        t+1); IGNORE_INDEX (-100) entries do not count. ce_loss is the mean over this process's
        counted tokens; under EP the aux loss is the one of the whole group's batch.
        `return_logits=False` (with labels): the head and its loss run in row chunks and the
        [B, S, V] logits are never made (`workbench.model.loss`); `logits` is then None.
        `logits_at_B` (no labels): the head runs at one position per row, logits [B, 1, V]
        (greedy decoding of a right-padded batch needs each row's last token only)."""
        cfg = self.config
        if input_ids_BS.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids_BS.shape)}")
        B, S = input_ids_BS.shape
        if S > cfg.max_seq_len:
            raise ValueError(f"sequence length {S} exceeds max_seq_len {cfg.max_seq_len}")
        h_BSD = self.model.embed_tokens(input_ids_BS)
        if positions_BS is None:
            positions_BS = torch.arange(S, device=h_BSD.device).expand(B, S)
        rope = self.model.rotary_emb(positions_BS, h_BSD.dtype)
        router_logits = []
        for layer in self.model.layers:
            h_BSD, logits_TE = layer(h_BSD, rope)
            if logits_TE is not None:
                router_logits.append(logits_TE)
        h_BSD = self.model.norm(h_BSD)
        if logits_at_B is not None:
            if labels_BS is not None:
                raise ValueError("logits_at_B picks positions for the head; it takes no labels")
            h_BSD = h_BSD[torch.arange(B, device=h_BSD.device), logits_at_B][:, None]
        chunked = labels_BS is not None and not return_logits
        logits_BSV = None if chunked else self.lm_head(h_BSD)

        balance = self.balance_group if self.balance_group is not None else self.ep_group
        # Sigmoid routers balance through their correction bias, not an aux loss (DeepSeek-V3).
        aux = (load_balancing_loss(router_logits, cfg.num_experts, cfg.top_k, balance)
               if router_logits and cfg.router.kind != "sigmoid" else None)
        ce = loss = None
        if chunked:
            ce = linear_cross_entropy(h_BSD[:, :-1].flatten(0, 1), self.lm_head.weight,
                                      labels_BS[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        elif labels_BS is not None:
            ce = F.cross_entropy(logits_BSV[:, :-1].flatten(0, 1).float(),
                                 labels_BS[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
        if ce is not None:
            loss = ce if aux is None else ce + cfg.aux_loss_coef * aux
        return MoEOutput(logits_BSV, loss, ce, aux, tuple(router_logits))


def _normal(shape: torch.Size, std: float, seed: int, name: str, expert: int | None) -> torch.Tensor:
    key = f"{seed}/{name}" if expert is None else f"{seed}/{name}/{expert}"
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen) * std
