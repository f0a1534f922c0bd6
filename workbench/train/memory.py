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


def param_counts(cfg: MoEConfig) -> ParamCounts:
    """Parameter counts of `workbench.model.MoEForCausalLM(cfg)`, from the config alone."""
    D, Dh = cfg.hidden_size, cfg.head_dim
    attn = D * Dh * (cfg.num_heads + 2 * cfg.num_kv_heads) + cfg.num_heads * Dh * D + 2 * Dh
    norms = 2 * D
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    moe_dense = cfg.num_experts * D  # router
    if cfg.shared_expert_ffn:
        moe_dense += 3 * D * cfg.shared_expert_ffn + (D if cfg.shared_expert_gate else 0)
    dense = (cfg.num_layers * (attn + norms) + moe_layers * moe_dense
             + dense_layers * 3 * D * cfg.dense_ffn
             + cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + D)
    return ParamCounts(dense=dense, expert=3 * D * cfg.expert_ffn, moe_layers=moe_layers)


def _swiglu_floats(d: int, f: int) -> int:
    # input (shared with the norm), gate out, silu out, up out, product (saved by down_proj)
    return 4 * f


def activation_floats_per_token(cfg: MoEConfig, act_ckpt: str = "off") -> dict[str, float]:
    """4-byte words autograd saves per token on the fp32 (CPU) path: 'layers' and 'head' are kept
    from forward to backward, 'recompute' is the working set of re-running one checkpointed layer.

    Index tensors (int64) count as two words. Derivation per decoder layer, in code order: input
    RMSNorm 2D+1 (input, normalised, rsqrt); q: proj out, q_norm's normalised output and the
    rotated q: 3 HqDh + Hq (RoPE multiplies by cos/sin, which need no gradient, so it saves only
    them); k likewise 3 GDh + G; v GDh; SDPA output HqDh + logsumexp Hq, and the contiguous
    copies of q, k, v it takes of the transposed heads (HqDh + 2 GDh); o_proj's input is a view
    of the SDPA output (no copy); post-attention RMSNorm 2D+1. MoE: router softmax probs E,
    top-k ids 2K, renormalisation K+1, the balancing loss's softmax E and ids 2K; per assignment
    (K per token): gathered rows D, gate/silu/up/product 4F, down output D (the combine saves
    only indices), the weight 1, gather, scatter and slot ids 2+2+2. Dense FFN layers: 4F; a
    shared expert 4F, its sigmoid gate D + 2.
    """
    if act_ckpt not in ACT_CKPT_MODES:
        raise ValueError(f"activation checkpointing {act_ckpt!r} is not one of {ACT_CKPT_MODES}")
    D, Dh, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    E, K, F = cfg.num_experts, cfg.top_k, cfg.expert_ffn
    attn = (2 * D + 1) + (3 * Hq * Dh + Hq) + (3 * G * Dh + G) + G * Dh + (Hq * Dh + Hq) \
        + (2 * D + 1) + (Hq * Dh + 2 * G * Dh)
    moe = (E + 2 * K + K + 1) + K * (2 * D + 4 * F + 7)
    # The balancing loss runs after the layers, on each MoE layer's router logits: its softmax
    # and top-k ids stay saved whatever the checkpointing.
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    balancing = n_moe * (E + 2 * K)
    if cfg.shared_expert_ffn:
        # the gate's sigmoid (1 + 1) and the shared output it multiplies (D)
        moe += _swiglu_floats(D, cfg.shared_expert_ffn) + (D + 2 if cfg.shared_expert_gate else 0)
    dense_ffn = _swiglu_floats(D, cfg.dense_ffn)
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
    head = 2 * Dh + 2 + (3 * D + 1) + cfg.vocab_size + 2 + balancing
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
        # row the plan was 9.0 GiB under the peak measured on an H200 (jobs/gpu/fsdp_world1.py).
        unit = max(per_layer + counts.expert * local_experts, cfg.vocab_size * cfg.hidden_size * 2)
        fsdp_buffers = int((2 + 2 + 4) * unit)
    words = activation_floats_per_token(cfg, act_ckpt)
    # On a GPU most saved activations are bf16 (autocast), the norms' fp32 internals and the
    # softmaxes stay fp32: 2.5 B per word is the estimate there; the CPU path is all fp32.
    bytes_per_word = 2.5 if gpu else 4.0
    per_token = (words["layers"] + words["head"] + words["recompute"]) * bytes_per_word
    tokens = batch * seq / world
    qat_copies = 0
    if qat:
        local = counts.expert * local_experts * (1 if act_ckpt != "off" else counts.moe_layers)
        qat_copies = int(local * (2 if gpu else 4))
    return RankMemory(params_compute=int(compute), masters=int(4 * p_local),
                      grads=int(4 * p_local), optimizer=int(8 * p_local),
                      activations=int(per_token * tokens), activations_per_token=per_token,
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
