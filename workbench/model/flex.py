"""Windowed and sink attention on CUDA through FlexAttention: `attend` with one fused kernel.

`workbench.model.attention.attend_sdpa` is the reference (a boolean mask and a sink key through
SDPA); SDPA has no fused kernel for a boolean mask with grouped-query heads, so on CUDA that path
takes the math kernel and holds every [S, S + 1] score of a gpt-oss layer for backward. This
module is imported on the first CUDA call only: torch.compiler and FlexAttention load
torch._dynamo (and Triton).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention


@functools.lru_cache(maxsize=32)
def _flex_mask(S: int, window: int, device: str):
    """FlexAttention's block mask for causal attention within the last `window` positions (the
    rule of `workbench.model.attention.attention_mask`), built once per shape: blocks wholly
    outside it are skipped, so a 128-token window costs O(S x 128), not O(S^2). Building it
    evaluates the rule on all S x S pairs once (S^2 bytes for a moment: 16 MiB at 4096, 1 GiB
    at 32768)."""
    def visible(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx
        return seen & (kv_idx > q_idx - window) if window else seen

    return create_block_mask(visible, B=None, H=None, Q_LEN=S, KV_LEN=S, device=device)


# the mask is built outside a compiled region: a graph break, not a mask rebuilt in every graph
_flex_mask_eager = torch.compiler.disable(_flex_mask)


@functools.cache
def _flex_kernel():
    # eager FlexAttention is a reference that holds every score; compiled, it is one fused kernel
    # (inside a compiled layer this wrapper is traced through). Default dynamism: training's one
    # shape compiles static, an evaluation's changing lengths turn dynamic instead of recompiling
    return torch.compile(flex_attention)


def attend_flex(q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor, *,
                scale: float, window: int, sinks_H: torch.Tensor | None,
                compiled: bool = True) -> torch.Tensor:
    """`attend` as one fused FlexAttention kernel (CUDA; its backward does not run on a CPU).
    `compiled=False` runs FlexAttention's eager reference (tests on a CPU).

    A sink adds exp(sinks[h]) to each query's softmax denominator Z = exp(lse) and nothing to
    its numerator, so the output is the sink-free output times Z / (Z + exp(sinks[h])) =
    sigmoid(lse - sinks[h]); the gradient reaches q and k through lse as well (FlexAttention
    differentiates its logsumexp)."""
    S = q_BHSD.shape[2]
    mask = _flex_mask_eager(S, window, str(q_BHSD.device))
    kernel = _flex_kernel() if compiled else flex_attention
    gqa = q_BHSD.shape[1] != k_BGSD.shape[1]
    if sinks_H is None:
        return kernel(q_BHSD, k_BGSD, v_BGSD, block_mask=mask, scale=scale, enable_gqa=gqa)
    o, aux = kernel(q_BHSD, k_BGSD, v_BGSD, block_mask=mask, scale=scale, enable_gqa=gqa,
                    return_aux=AuxRequest(lse=True))
    keep_BHS = torch.sigmoid(aux.lse - sinks_H.float()[None, :, None])
    return (o * keep_BHS[..., None]).to(q_BHSD.dtype)
