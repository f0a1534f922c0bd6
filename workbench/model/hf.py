"""Key map between transformers' `Qwen3MoeForCausalLM` (5.24) state dicts and ours.

Dense tensors have the same names on both sides (identity). Routed experts of MoE layer i,
with P = `model.layers.{i}.mlp.experts`, E experts, F expert FFN, D hidden:

| ours                 | transformers 5 (fused, in memory)      | per expert (checkpoints on disk)    |
|----------------------|----------------------------------------|-------------------------------------|
| `P.w1` [E, F, D]     | `P.gate_up_proj` [E, 2F, D] rows :F    | `P.{e}.gate_proj.weight` [F, D]     |
| `P.w3` [E, F, D]     | `P.gate_up_proj` [E, 2F, D] rows F:    | `P.{e}.up_proj.weight` [F, D]       |
| `P.w2` [E, D, F]     | `P.down_proj` [E, D, F]                | `P.{e}.down_proj.weight` [D, F]     |

gate comes first in `gate_up_proj` because transformers splits the projection with
`.chunk(2, dim=-1)` into (gate, up). With tied embeddings `lm_head.weight` is not stored (as in
transformers' saved checkpoints); when present in an input it must equal the embedding.
Our optional shared expert keeps Qwen2-MoE's names (`mlp.shared_expert.*`, `mlp.shared_expert_gate`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from workbench.model.experts import GroupedExperts

PER_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_OURS_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<w>w1|w2|w3)$")


class StateDictError(KeyError, ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape; the message names it.

    Both a KeyError (missing/unexpected names) and a ValueError (wrong shapes), so callers can
    catch it either way."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


# ---------------------------------------------------------------------------------------------
# Plain dict conversion (all experts present).


def hf_to_ours(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename/restack an HF state dict (fused or per-expert experts) into our names."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, value in sd.items():
        if m := _PER_EXPERT_RE.match(key):
            per_expert.setdefault((m["prefix"], m["proj"]), {})[int(m["e"])] = value
        elif m := _FUSED_RE.match(key):
            if m["proj"] == "down_proj":
                out[f"{m['prefix']}.w2"] = value
            else:
                if value.dim() != 3 or value.shape[1] % 2:
                    raise StateDictError(f"{key}: expected [E, 2F, D], got {tuple(value.shape)}")
                ffn = value.shape[1] // 2
                out[f"{m['prefix']}.w1"], out[f"{m['prefix']}.w3"] = value[:, :ffn], value[:, ffn:]
        else:
            out[key] = value
    ours_name = {v: k for k, v in PER_EXPERT.items()}
    for (prefix, proj), by_e in per_expert.items():
        missing = sorted(set(range(max(by_e) + 1)) - set(by_e))
        if missing:
            raise StateDictError(f"{prefix}.{{e}}.{proj}.weight: experts {missing} are missing")
        out[f"{prefix}.{ours_name[proj]}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    return out


def ours_to_hf(sd: Mapping[str, torch.Tensor], *, layout: str = "fused",
               expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """Our names -> HF names. layout "fused" (transformers 5 in memory) or "per_expert" (disk);
    with per_expert, local expert k is written as global expert expert_offset + k."""
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _OURS_RE.match(key)
        if m is None:
            out[key] = value
        elif layout == "per_expert":
            for k in range(value.shape[0]):
                out[f"{m['prefix']}.{expert_offset + k}.{PER_EXPERT[m['w']]}.weight"] = value[k]
        elif m["w"] == "w2":
            out[f"{m['prefix']}.down_proj"] = value
        elif m["w"] == "w1":
            if expert_offset:
                raise ValueError("the fused layout holds all experts; use layout='per_expert' "
                                 "for an expert-parallel shard")
            out[f"{m['prefix']}.gate_up_proj"] = torch.cat([value, sd[f"{m['prefix']}.w3"]], dim=1)
    return out


# ---------------------------------------------------------------------------------------------
# Model-level load/export; expert-parallel aware (each rank reads only its experts).


def _expert_slice(sd: Mapping[str, torch.Tensor], prefix: str, w: str, start: int, count: int,
                  used: set[str]) -> torch.Tensor:
    fused = f"{prefix}.gate_up_proj" if w in ("w1", "w3") else f"{prefix}.down_proj"
    if fused in sd:
        used.add(fused)
        full = sd[fused]
        if w != "w2":
            ffn = full.shape[1] // 2
            full = full[:, :ffn] if w == "w1" else full[:, ffn:]
        if full.shape[0] < start + count:
            raise StateDictError(f"{fused}: has {full.shape[0]} experts, need {start + count}")
        return full[start:start + count]
    keys = [f"{prefix}.{e}.{PER_EXPERT[w]}.weight" for e in range(start, start + count)]
    absent = [k for k in keys if k not in sd]
    if absent:
        raise StateDictError(f"missing expert tensors (neither {fused} nor per-expert keys): "
                             f"{absent[:4]}{' ...' if len(absent) > 4 else ''}")
    used.update(keys)
    return torch.stack([sd[k] for k in keys])


@torch.no_grad()
def load_hf_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], *,
                       strict: bool = True) -> None:
    """Copy an HF Qwen3-MoE state dict (fused or per-expert experts) into `model` in place.

    Parameters stay the same objects (optimizer-safe). Under EP only the rank's expert slice is
    read. strict: unexpected keys are an error, except experts that belong to other ranks."""
    used: set[str] = set()
    expert_modules: dict[str, int] = {}  # prefix -> global expert count
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            expert_modules[module_name] = module.num_global_experts
            value = _expert_slice(sd, module_name, leaf, module.expert_offset, module.num_experts,
                                  used)
        elif name in sd:
            value = sd[name]
            used.add(name)
        else:
            raise StateDictError(f"missing tensor {name!r} in the HF state dict")
        if tuple(value.shape) != tuple(param.shape):
            raise StateDictError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                                 f"{tuple(param.shape)}")
        param.copy_(value)
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if tied and "lm_head.weight" in sd:
        used.add("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"].to(model.lm_head.weight.dtype),
                           model.lm_head.weight):
            raise StateDictError("lm_head.weight differs from model.embed_tokens.weight but the "
                                 "config ties them (tie_embeddings=True)")
    if strict:
        def other_ranks_expert(key: str) -> bool:
            m = _PER_EXPERT_RE.match(key)
            return bool(m) and int(m["e"]) < expert_modules.get(m["prefix"], 0)

        unexpected = [k for k in sd if k not in used and not other_ranks_expert(k)]
        if unexpected:
            raise StateDictError(f"unexpected tensors in the HF state dict: {unexpected[:8]}")


def to_hf_state_dict(model: nn.Module, *, layout: str = "fused") -> dict[str, torch.Tensor]:
    """HF names for this model's tensors (detached, shared storage). Under EP use
    layout="per_expert": each rank then returns its own experts under their global indices."""
    ours: dict[str, torch.Tensor] = {}
    offset = None
    for name, param in model.named_parameters():  # deduplicates a tied lm_head
        module_name, _, _ = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            if module.num_experts != module.num_global_experts and layout == "fused":
                raise ValueError("to_hf_state_dict: experts are sharded (expert parallel); the "
                                 "fused layout needs all experts, use layout='per_expert'")
            offset = module.expert_offset
        ours[name] = param.detach()
    return ours_to_hf(ours, layout=layout, expert_offset=offset or 0)
