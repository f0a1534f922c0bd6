"""How each expert style exposes its weights to fake quantization, found by duck typing.

Four styles, one mechanism each, no forks of the model code:
- ``grouped-seam``: our stacked experts (3-D ``[E, out, in]`` parameters ``w1``, ``w3``, ``w2``
  used only through the module's seam, a ``gemms`` attribute holding an ``ExpertGemms``). QAT
  replaces the seam; weights and activations are fake-quantized.
- ``te-grouped``: TE ``GroupedLinear``-style modules with 2-D parameters ``weight0..weightK``.
- ``fused-3d``: 3-D ``gate_up_proj`` / ``down_proj`` parameters used inside the module's own
  forward: transformers 5 fused experts (``[E, out, in]``) and gpt-oss (``[E, in, out]``).
- ``linear``: any ``nn.Linear`` (HF per-expert lists such as ``experts.{e}.gate_proj``).
The last three run the module's class forward with fake-quantized tensors swapped in for the
masters (``ParamSwapForward``); the Parameter objects themselves never change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from workbench.model.experts import EXPERT_WEIGHTS, ExpertGemms

_TE_WEIGHT = re.compile(r"weight(\d+)")


@dataclass(frozen=True)
class WeightSite:
    """One weight tensor that a style can fake-quantize."""

    name: str  # full parameter name in the model
    module_name: str
    param: str
    style: str
    reduction_dim: int  # dim the blocks run along (-1 Linear convention, -2 for gpt-oss)
    act: bool  # whether this style can also fake-quantize the activation feeding this weight


def _fused_reduction_dims(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int] | None:
    """Reduction dims of (gate_up, down) from their shapes; None when neither layout fits.

    Linear convention: gate_up [E, 2F, D], down [E, D, F]. gpt-oss: gate_up [E, D, 2F],
    down [E, F, D]. Both can hold only for F = 0, so shapes decide.
    """
    (_, a, b), (_, c, d) = gate_up.shape, down.shape
    if b == c and a == 2 * d:
        return -1, -1
    if a == d and b == 2 * c:
        return -2, -2
    return None


def find_sites(model: nn.Module) -> tuple[list[WeightSite], dict[str, str]]:
    """All weight sites by style, and for every other weight matrix why no style covers it."""
    sites: list[WeightSite] = []
    claimed: set[str] = set()
    uncovered: dict[str, str] = {}
    for mname, mod in model.named_modules():
        prefix = f"{mname}." if mname else ""
        direct = dict(mod.named_parameters(recurse=False))
        if isinstance(getattr(mod, "gemms", None), ExpertGemms):
            for p in EXPERT_WEIGHTS:
                if p in direct and direct[p].dim() == 3:
                    sites.append(WeightSite(prefix + p, mname, p, "grouped-seam", -1, True))
                    claimed.add(prefix + p)
            for p, t in direct.items():
                if p not in EXPERT_WEIGHTS and t.dim() >= 2:
                    uncovered[prefix + p] = ("not a weight of the experts' seam (a per-expert "
                                             "bias is added in BF16 after its GEMM)")
            continue
        te = {p: t for p, t in direct.items() if _TE_WEIGHT.fullmatch(p) and t.dim() == 2}
        if te:
            for p in te:
                sites.append(WeightSite(prefix + p, mname, p, "te-grouped", -1, True))
                claimed.add(prefix + p)
            continue
        if "gate_up_proj" in direct and "down_proj" in direct and direct["gate_up_proj"].dim() == 3:
            dims = _fused_reduction_dims(direct["gate_up_proj"], direct["down_proj"])
            if dims is None:
                for p in ("gate_up_proj", "down_proj"):
                    uncovered[prefix + p] = (f"fused expert shapes {tuple(direct['gate_up_proj'].shape)}"
                                             f" / {tuple(direct['down_proj'].shape)} fit no known layout")
                continue
            for p, d in zip(("gate_up_proj", "down_proj"), dims):
                # activations of the down projection live inside the module's forward
                sites.append(WeightSite(prefix + p, mname, p, "fused-3d", d, False))
                claimed.add(prefix + p)
            continue
        if isinstance(mod, nn.Linear):
            sites.append(WeightSite(prefix + "weight", mname, "weight", "linear", -1, True))
            claimed.add(prefix + "weight")
    for name, t in model.named_parameters():
        if t.dim() >= 2 and name not in claimed and name not in uncovered:
            uncovered[name] = "no supported expert or Linear style owns this parameter"
    return sites, uncovered
