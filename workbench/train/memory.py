"""Per-rank memory, planned and measured: what the trainer holds for a model on each rank.

Legend: P parameters on the rank, T tokens on the rank per step (global batch x seq / world),
D hidden, Hq / G query / kv heads, Dh head dim, E experts, K top-k, F expert FFN, V vocab.

What the workbench trainer keeps per parameter (`workbench.train.build`): the parameters ARE the
fp32 masters (4 B); their gradients are fp32 (4 B); AdamW keeps two fp32 moments (8 B). On a GPU
the bf16 autocast region caches one bf16 copy of every weight it casts (2 B) from the first
matmul of the step until the end of the step's forward-backward. Nothing else is per parameter.

Activations are the tensors autograd saves for backward. `activation_floats_per_token` counts
them from the model's code (`workbench.model`: RMSNorm, GQA attention with q/k norms and RoPE,
CPU/flash SDPA, top-k router, the grouped SwiGLU experts and their combine, the loss); it is
checked against `SavedTensorMeter`, which measures the same thing on a real forward (tests:
`tests/train/test_memory_plan.py`). With activation checkpointing, `full` keeps only each
decoder layer's input (its recomputation needs one layer's activations at a time) and
`selective` keeps the outputs of the matrix multiplies and attention and recomputes the
element-wise ops between them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Self

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workbench.arch import MoEConfig
from workbench.train.config import ACT_CKPT_MODES

GIB = 2**30


@dataclass(frozen=True)
class ParamCounts:
    dense: int  # every parameter outside the routed experts (replicated under EP)
    expert: int  # one routed expert of one layer: gate + up + down
    moe_layers: int

    @property
    def experts_total(self) -> int:
        return self.expert * self.moe_layers

    def total(self, num_experts: int) -> int:
        return self.dense + self.experts_total * num_experts


def attention_params(cfg: MoEConfig) -> int:
    """Parameters of one attention block (`workbench.model.attention`): GQA with its optional
    biases, q/k norms and sinks, or MLA with its LoRA projections and their norms."""
    a, D, H = cfg.attention, cfg.hidden_size, cfg.num_heads
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q = D * a.q_lora_rank + a.q_lora_rank * (2 if a.qkv_bias else 1) + a.q_lora_rank * H * qk
        else:
            q = D * H * qk
        kv_a = a.kv_lora_rank + a.qk_rope_head_dim
        kv = D * kv_a + (kv_a if a.qkv_bias else 0) + a.kv_lora_rank \
            + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + H * a.v_head_dim * D + (D if a.o_bias else 0)
    Dh, G = cfg.head_dim, cfg.num_kv_heads
    n = D * Dh * (H + 2 * G) + H * Dh * D
    n += Dh * (H + 2 * G) if a.qkv_bias else 0
    n += D if a.o_bias else 0
    n += 2 * Dh if a.qk_norm else 0
    return n + (H if a.sinks else 0)


def param_counts(cfg: MoEConfig) -> ParamCounts:
    """Parameter counts of `workbench.model.MoEForCausalLM(cfg)`, from the config alone."""
    D, E = cfg.hidden_size, cfg.num_experts
    norms = 2 * D
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    # router weight, gpt-oss's logit bias, DeepSeek's e_score_correction_bias
    moe_dense = E * D + (E if cfg.router.bias else 0) + (E if cfg.router.kind == "sigmoid" else 0)
    if cfg.shared_expert_ffn:
        moe_dense += 3 * D * cfg.shared_expert_ffn + (D if cfg.shared_expert_gate else 0)
    dense = (cfg.num_layers * (attention_params(cfg) + norms) + moe_layers * moe_dense
             + dense_layers * 3 * D * cfg.dense_ffn
             + cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + D)
    expert = 3 * D * cfg.expert_ffn + ((2 * cfg.expert_ffn + D) if cfg.experts.bias else 0)
    return ParamCounts(dense=dense, expert=expert, moe_layers=moe_layers)


def _swiglu_floats(d: int, f: int) -> int:
    # gate out (silu's input), silu out, up out, product (saved by down_proj)
    return 4 * f


def _attention_floats(cfg: MoEConfig) -> float:
    """Words one attention block saves per token, its input included.

    GQA: the input (q/k/v projections) D; with q/k norms, each projection's output, the
    normalised value and the rsqrt: 2 HqDh + Hq and 2 GDh + G; SDPA's q, k, v and output
    (2 Hq + 2 G) P and logsumexp Hq, with P = Dh, or Dh + 8 where sinks widen the heads
    (`workbench.model.attention.attend`); RoPE multiplies by cos/sin, which need no gradient,
    so it saves only them. o_proj's input is a view of the SDPA output, except after sinks or a
    partial rotary (the heads come out in another layout): a copy, Hq Dh.
    MLA: the input D; with a q LoRA, q_a's output, the normalised value, q_a_layernorm's output
    and the rsqrt 3 Lq + 1; kv_a's output (Lkv + R) and likewise 2 Lkv + 1; SDPA's q, k, values
    (padded to the q/k dim) and output 4 H (N + R), logsumexp H; o_proj's input copy H V."""
    a, D, H = cfg.attention, cfg.hidden_size, cfg.num_heads
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = 3 * a.q_lora_rank + 1 if a.q_lora_rank else 0
        kv = 3 * a.kv_lora_rank + a.qk_rope_head_dim + 1
        return D + q + kv + 4 * H * qk + H + H * a.v_head_dim
    Dh, G = cfg.head_dim, cfg.num_kv_heads
    norms = (2 * H * Dh + H + 2 * G * Dh + G) if a.qk_norm else 0
    P = Dh + (8 if a.sinks else 0)
    copy = H * Dh if (a.sinks or cfg.rope.partial_factor != 1.0) else 0
    return D + norms + (2 * H + 2 * G) * P + H + copy


def _router_floats(cfg: MoEConfig) -> float:
    """Words a router saves per token (its input is the MoE block's, counted there).
    softmax: probabilities E, top-k ids 2K, renormalisation K + 1. top-k softmax (gpt-oss): ids
    2K, the softmax of the k logits K. sigmoid: scores E, group top-2 and group top-k ids
    2 (2N + topk_group) and the group mask E/4 (bool) when grouped, ids 2K, the renormalisation
    K + 1."""
    r, E, K = cfg.router, cfg.num_experts, cfg.top_k
    if r.kind == "topk_softmax":
        return 3 * K
    if r.kind == "sigmoid":
        grouped = 2 * (2 * r.n_group + r.topk_group) + E / 4 if r.n_group > 1 else 0
        return E + grouped + 2 * K + (K + 1 if cfg.norm_topk_prob else 0)
    return E + 2 * K + (K + 1 if cfg.norm_topk_prob else 0)


def _expert_floats(cfg: MoEConfig) -> float:
    """Words per routed assignment: the gathered row D, the activation's saves, the down
    output D, the weight 1, gather, scatter and slot ids 2 + 2 + 2. SwiGLU: gate/silu/up/
    product 4F. gpt-oss's clamped SwiGLU: gate and up before the clamps, the clamped gate, its
    sigmoid, the gated value, up + 1 and the product 7F."""
    F = cfg.expert_ffn
    act = 7 * F if cfg.experts.activation == "clamped_swiglu" else 4 * F
    return 2 * cfg.hidden_size + act + 7


def mask_floats(cfg: MoEConfig, seq: int) -> float:
    """Words the attention masks of one step hold, whatever the batch: SDPA keeps each masked
    layer's [S, S (+1 with sinks)] mask, as an fp32 additive bias, for backward. Layers with a
    sliding window or sinks take a mask; the others run SDPA's causal kernels, which take none."""
    a = cfg.attention
    if a.kind == "mla" or not (a.sinks or a.layer_types):
        return 0.0
    cols = seq + (1 if a.sinks else 0)
    masked = sum(1 for i in range(cfg.num_layers) if a.sinks or a.window(i))
    return float(masked * seq * cols)


def activation_floats_per_token(cfg: MoEConfig, act_ckpt: str = "off") -> dict[str, float]:
    """4-byte words autograd saves per token on the fp32 (CPU) path: 'layers' and 'head' are kept
    from forward to backward, 'recompute' is the working set of re-running one checkpointed layer.
    (Attention masks, a per-step amount, are `mask_floats`.)

    Index tensors (int64) count as two words. Per decoder layer, in code order: input RMSNorm
    2D+1 (input, normalised, rsqrt; its output is counted by the block that saves it), attention
    (`_attention_floats`), post-attention RMSNorm 2D+1. MoE: the block's input D, the router
    (`_router_floats`), and per assignment (K per token) `_expert_floats`; the balancing loss's
    softmax E and ids 2K (softmax routers). Dense FFN layers: the input D and 4F; a shared
    expert 4F, its sigmoid gate D + 2.
    """
    if act_ckpt not in ACT_CKPT_MODES:
        raise ValueError(f"activation checkpointing {act_ckpt!r} is not one of {ACT_CKPT_MODES}")
    D, Dh, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, K, F = cfg.num_experts, cfg.top_k, cfg.expert_ffn
    attn = (2 * D + 1) + _attention_floats(cfg) + (2 * D + 1)
    moe = D + _router_floats(cfg) + K * _expert_floats(cfg)
    # The balancing loss runs after the layers, on each MoE layer's router logits: its softmax
    # and top-k ids stay saved whatever the checkpointing.
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    balancing = n_moe * (E + 2 * K) if cfg.router.kind != "sigmoid" else 0
    if cfg.shared_expert_ffn:
        # the gate's sigmoid (1 + 1) and the shared output it multiplies (D)
        moe += _swiglu_floats(D, cfg.shared_expert_ffn) + (D + 2 if cfg.shared_expert_gate else 0)
    dense_ffn = D + _swiglu_floats(D, cfg.dense_ffn)
    per_layer = [attn + (moe if cfg.is_moe_layer(i) else dense_ffn) for i in range(cfg.num_layers)]
    recompute = 0.0
    if act_ckpt == "full":
        # Each layer keeps its input; backward recomputes one layer at a time.
        kept = cfg.num_layers * D
        recompute = max(per_layer)
    elif act_ckpt == "selective":
        # Kept: each layer's input and every matmul / attention output (q, k, v, SDPA out + lse,
        # o_proj out, router logits, expert gate/up/down outputs per assignment); backward
        # recomputes the element-wise rest of one layer at a time. An estimate: the measurement
        # (`SavedTensorMeter`) does not see what the selective policy caches.
        kept_attn = D + Hq * Dh + 2 * G * Dh + (Hq * Dh + Hq) + D
        kept_moe = E + K * (2 * F + D)
        kept = sum(kept_attn + (kept_moe if cfg.is_moe_layer(i) else 3 * cfg.dense_ffn)
                   for i in range(cfg.num_layers))
        recompute = max(per_layer) - kept / cfg.num_layers
    else:
        kept = sum(per_layer)
    # RoPE cos/sin (shared by all layers), embedding ids, final norm (input, normalised, rsqrt)
    # and its output (lm_head's input), log-softmax of the logits and the labels.
    head = 2 * cfg.rope_dim + 2 + (3 * D + 1) + cfg.vocab_size + 2 + balancing
    return {"layers": float(kept), "head": float(head), "recompute": float(recompute)}


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds (the fullest rank when experts do not split evenly)."""

    params_compute: int  # bf16 copies the autocast region caches (GPU), 0 on CPU
    masters: int  # fp32 parameters (the trainer's masters)
    grads: int
    optimizer: int
    activations: int  # saved for backward, at the configured per-rank tokens
    activations_per_token: float
    qat_copies: int = 0  # fake-quantized expert weights, saved for backward by the GEMMs
    fsdp_buffers: int = 0  # FSDP2's transient per-unit buffers (GPU): see rank_memory

    @property
    def saved(self) -> int:
        """What `SavedTensorMeter` measures: activations plus the fake-quantized weights."""
        return self.activations + self.qat_copies

    @property
    def states(self) -> int:
        return self.params_compute + self.masters + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.activations + self.qat_copies + self.fsdp_buffers

    def as_dict(self) -> dict[str, float]:
        return {"params_compute": self.params_compute, "masters": self.masters,
                "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "qat_copies": self.qat_copies,
                "fsdp_buffers": self.fsdp_buffers,
                "total": self.total,
                "activations_per_token": self.activations_per_token}


def rank_memory(cfg: MoEConfig, *, world: int, ep: int, fsdp: int = 1, batch: int, seq: int,
                act_ckpt: str = "off", device: str = "cuda", qat: bool = False,
                sharded: bool | None = None) -> RankMemory:
    """Per-rank bytes of the trainer for `cfg` at world size `world` = ep x fsdp.

    `fsdp` is the expert-data-parallel degree (the trainer's dp). Under FSDP (`sharded`; by
    default fsdp > 1, also at fsdp 1 for `--fsdp` with EP = world) the dense parameters are
    sharded over all `world` ranks and the experts over the `fsdp` ranks that hold the same
    experts (states only; the gathered bf16 compute copies stay whole, one layer at a time in
    FSDP2, which this estimate counts as one layer's weights).
    `batch` is the global batch in sequences; each rank trains batch*seq/world tokens.
    `qat`: the routed experts are fake-quantized, and each GEMM keeps its quantized weight
    (compute dtype) for backward, one copy of the local experts (all layers at once, or one
    layer at a time under activation checkpointing).
    """
    if world != ep * fsdp:
        raise ValueError(f"world ({world}) must equal ep x fsdp ({ep} x {fsdp})")
    if cfg.num_experts % ep:
        raise ValueError(f"{cfg.num_experts} experts do not split over EP size {ep}")
    counts = param_counts(cfg)
    local_experts = cfg.num_experts // ep
    sharded = fsdp > 1 if sharded is None else sharded
    if fsdp > 1 and not sharded:
        raise ValueError(f"fsdp={fsdp} > 1 needs sharded=True (experts replicated over the "
                         "data-parallel ranks without FSDP is not a trainer layout)")
    dense = counts.dense / (world if sharded else 1)
    expert = counts.experts_total * local_experts / fsdp
    p_local = dense + expert
    gpu = device == "cuda"
    if sharded:
        per_layer = (counts.dense - cfg.vocab_size * cfg.hidden_size * 2) / max(cfg.num_layers, 1)
        compute = 2 * (per_layer + counts.expert * local_experts) if gpu else 0
    else:
        compute = 2 * (counts.dense + counts.experts_total * local_experts) if gpu else 0
    fsdp_buffers = 0
    if sharded and gpu:
        # FSDP2 units are the decoder layers and the root (embeddings and head). Beside the
        # gathered bf16 weights of the unit computing (in `compute`), it holds the next unit's,
        # prefetched (2 B a parameter), and in backward the unit's unsharded bf16 gradients (2 B)
        # and their fp32 copy, the reduce-scatter's input (reduce_dtype fp32: 4 B). Without this
        # row the plan fell short of the GPU's measured peak (docs/fsdp.md, jobs/gpu/fsdp_world1.py).
        unit = max(per_layer + counts.expert * local_experts, cfg.vocab_size * cfg.hidden_size * 2)
        fsdp_buffers = int((2 + 2 + 4) * unit)
    words = activation_floats_per_token(cfg, act_ckpt)
    # On a GPU most saved activations are bf16 (autocast), the norms' fp32 internals and the
    # softmaxes stay fp32: 2.5 B per word is the estimate there; the CPU path is all fp32.
    bytes_per_word = 2.5 if gpu else 4.0
    per_token = (words["layers"] + words["head"] + words["recompute"]) * bytes_per_word
    tokens = batch * seq / world
    # on a GPU a window or sinks run FlexAttention (model.attention), whose block mask is a
    # few KiB: only the CPU's SDPA path keeps [S, S] masks
    masks = 0.0 if gpu else mask_floats(cfg, seq)
    if act_ckpt == "full" and masks:  # one layer's mask lives at a time
        masks /= sum(1 for i in range(cfg.num_layers)
                     if cfg.attention.sinks or cfg.attention.window(i))
    qat_copies = 0
    if qat:
        local = counts.expert * local_experts * (1 if act_ckpt != "off" else counts.moe_layers)
        qat_copies = int(local * (2 if gpu else 4))
    return RankMemory(params_compute=int(compute), masters=int(4 * p_local),
                      grads=int(4 * p_local), optimizer=int(8 * p_local),
                      activations=int(per_token * tokens + masks * bytes_per_word),
                      activations_per_token=per_token,
                      qat_copies=qat_copies, fsdp_buffers=fsdp_buffers)


# --------------------------------------------------------------------------------------------
# Measured


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer state (tensor storages counted
    once, so tied weights are not counted twice)."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        st = _local(t).untyped_storage()  # a DTensor: the shard this rank stores
        key = st.data_ptr()
        if key in seen or key == 0:
            return 0
        seen.add(key)
        return st.nbytes()

    params = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters() if p.grad is not None)
    optim = 0
    if opt is not None:
        for state in opt.state.values():
            optim += sum(size(v) for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"mem_masters_bytes": params, "mem_grads_bytes": grads, "mem_optimizer_bytes": optim}


class SavedTensorMeter:
    """Bytes autograd saves for backward inside the `with` block (parameters excluded, each
    storage counted once). Installs a pack hook: used on one step only, it costs nothing after."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._ctx: contextlib.AbstractContextManager | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):  # FSDP's gathered parameters: weights, not activations
            return t
        st = _local(t).untyped_storage()
        key = st.data_ptr()
        if key and key not in self._params:
            self._seen[key] = st.nbytes()
        return t

    def __enter__(self) -> Self:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._ctx is not None
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())
