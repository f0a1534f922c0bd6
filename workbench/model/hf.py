"""Key maps between each family's transformers (5.24) state dicts and ours, both ways.

Dense tensors keep transformers' names except two renames (ours are the same in every family):

| family | transformers | ours |
|---|---|---|
| gpt_oss | `mlp.router.{weight,bias}` | `mlp.gate.{weight,bias}` |
| deepseek_v3, glm4_moe | `mlp.shared_experts.{gate,up,down}_proj` | `mlp.shared_expert.*` |

Routed experts of MoE layer i, with P = `model.layers.{i}.mlp.experts`, E experts, F expert FFN,
D hidden:

| ours | qwen3_moe, deepseek_v3, glm4_moe (fused, in memory) | per expert (their checkpoints on disk) | gpt_oss (fused, in memory and on disk) |
|---|---|---|---|
| `P.w1` [E, F, D] | `P.gate_up_proj` [E, 2F, D] rows :F | `P.{e}.gate_proj.weight` [F, D] | `P.gate_up_proj` [E, D, 2F] even columns, transposed |
| `P.w3` [E, F, D] | `P.gate_up_proj` rows F: | `P.{e}.up_proj.weight` [F, D] | `P.gate_up_proj` odd columns, transposed |
| `P.w2` [E, D, F] | `P.down_proj` [E, D, F] | `P.{e}.down_proj.weight` [D, F] | `P.down_proj` [E, F, D], transposed |
| `P.b1`, `P.b3` [E, F] | | | `P.gate_up_proj_bias` [E, 2F] even / odd |
| `P.b2` [E, D] | | | `P.down_proj_bias` [E, D] |

gate comes first in the fused `gate_up_proj` of the first group because transformers splits it
with `.chunk(2, dim=-1)`; gpt-oss interleaves gate and up (`gate_up[..., ::2]`,
`gate_up[..., 1::2]`) and multiplies `x @ W` with W stored [in, out]. With tied embeddings
`lm_head.weight` is not stored (as in transformers' saved checkpoints); when present in an input
it must equal the embedding. Layers past the model's (DeepSeek / GLM multi-token-prediction
layers, `model.layers.61.*` in DeepSeek-V3) are skipped with one log line, as transformers does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch
from torch import nn

from workbench.model.experts import GroupedExperts

log = logging.getLogger(__name__)

PER_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\."
                       r"(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$")
_OURS_RE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<w>w1|w2|w3|b1|b2|b3)$")
_LAYER_RE = re.compile(r"^model\.layers\.(?P<i>\d+)\.")
# (ours, transformers) name fragments per family
RENAMES = {"gpt_oss": ((".mlp.gate.", ".mlp.router."),),
           "deepseek_v3": ((".mlp.shared_expert.", ".mlp.shared_experts."),),
           "glm4_moe": ((".mlp.shared_expert.", ".mlp.shared_experts."),),
           "qwen3_moe": ()}
INTERLEAVED = ("gpt_oss",)  # families whose fused experts interleave gate/up, stored [in, out]


class StateDictError(KeyError, ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape; the message names it.

    Both a KeyError (missing/unexpected names) and a ValueError (wrong shapes), so callers can
    catch it either way."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def _family(family: str) -> str:
    if family not in RENAMES:
        raise ValueError(f"unknown family {family!r}; one of {sorted(RENAMES)}")
    return family


def hf_name(name: str, family: str = "qwen3_moe") -> str:
    """transformers' name of our dense tensor `name`."""
    for ours, theirs in RENAMES[_family(family)]:
        name = name.replace(ours, theirs)
    return name


def ours_name(name: str, family: str = "qwen3_moe") -> str:
    """Our name of transformers' dense tensor `name`."""
    for ours, theirs in RENAMES[_family(family)]:
        name = name.replace(theirs, ours)
    return name


def fused_to_ours(key: str, value: torch.Tensor, family: str) -> dict[str, str | torch.Tensor]:
    """Our stacks from one fused transformers expert tensor (`gate_up_proj`, `down_proj` or,
    gpt-oss, their `_bias`): {our name: tensor}."""
    m = _FUSED_RE.match(key)
    if m is None:
        raise StateDictError(f"{key}: not a fused expert tensor")
    p, proj, bias = m["prefix"], m["proj"], bool(m["bias"])
    if family in INTERLEAVED:
        if bias:
            if proj == "down_proj":
                return {f"{p}.b2": value}
            return {f"{p}.b1": value[:, 0::2], f"{p}.b3": value[:, 1::2]}
        if value.dim() != 3:
            raise StateDictError(f"{key}: expected a 3-D [E, in, out] tensor, got "
                                 f"{tuple(value.shape)}")
        if proj == "down_proj":
            return {f"{p}.w2": value.transpose(1, 2)}
        if value.shape[2] % 2:
            raise StateDictError(f"{key}: expected [E, D, 2F], got {tuple(value.shape)}")
        return {f"{p}.w1": value[:, :, 0::2].transpose(1, 2),
                f"{p}.w3": value[:, :, 1::2].transpose(1, 2)}
    if bias:
        raise StateDictError(f"{key}: family {family} has no expert biases")
    if proj == "down_proj":
        return {f"{p}.w2": value}
    if value.dim() != 3 or value.shape[1] % 2:
        raise StateDictError(f"{key}: expected [E, 2F, D], got {tuple(value.shape)}")
    ffn = value.shape[1] // 2
    return {f"{p}.w1": value[:, :ffn], f"{p}.w3": value[:, ffn:]}


# ---------------------------------------------------------------------------------------------
# Plain dict conversion (all experts present).


def hf_to_ours(sd: Mapping[str, torch.Tensor], *, family: str = "qwen3_moe"
               ) -> dict[str, torch.Tensor]:
    """Rename/restack a transformers state dict (fused or per-expert experts) into our names."""
    _family(family)
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, value in sd.items():
        if m := _PER_EXPERT_RE.match(key):
            per_expert.setdefault((m["prefix"], m["proj"]), {})[int(m["e"])] = value
        elif _FUSED_RE.match(key):
            out.update(fused_to_ours(key, value, family))
        else:
            out[ours_name(key, family)] = value
    ours_of = {v: k for k, v in PER_EXPERT.items()}
    for (prefix, proj), by_e in per_expert.items():
        missing = sorted(set(range(max(by_e) + 1)) - set(by_e))
        if missing:
            raise StateDictError(f"{prefix}.{{e}}.{proj}.weight: experts {missing} are missing")
        out[f"{prefix}.{ours_of[proj]}"] = torch.stack([by_e[e] for e in range(len(by_e))])
    return out


def ours_to_hf(sd: Mapping[str, torch.Tensor], *, layout: str = "fused",
               expert_offset: int = 0, family: str = "qwen3_moe") -> dict[str, torch.Tensor]:
    """Our names -> transformers names. layout "fused" (transformers 5 in memory; gpt-oss on
    disk too) or "per_expert" (the other families on disk); with per_expert, local expert k is
    written as global expert expert_offset + k."""
    _family(family)
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    interleaved = family in INTERLEAVED
    if layout == "per_expert" and interleaved:
        raise ValueError(f"{family} checkpoints store fused experts only; use layout='fused'")
    if layout == "fused" and expert_offset:
        raise ValueError("the fused layout holds all experts; use layout='per_expert' for an "
                         "expert-parallel shard")
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        m = _OURS_RE.match(key)
        if m is None:
            out[hf_name(key, family)] = value
            continue
        p, w = m["prefix"], m["w"]
        if layout == "per_expert":
            if w.startswith("b"):
                raise ValueError(f"{key}: expert biases have no per-expert transformers name")
            for k in range(value.shape[0]):
                out[f"{p}.{expert_offset + k}.{PER_EXPERT[w]}.weight"] = value[k]
        elif interleaved:
            if w == "w1":
                gate, up = value.transpose(1, 2), sd[f"{p}.w3"].transpose(1, 2)
                out[f"{p}.gate_up_proj"] = torch.stack([gate, up], dim=-1).flatten(-2)
            elif w == "w2":
                out[f"{p}.down_proj"] = value.transpose(1, 2)
            elif w == "b1":
                out[f"{p}.gate_up_proj_bias"] = torch.stack([value, sd[f"{p}.b3"]], -1).flatten(-2)
            elif w == "b2":
                out[f"{p}.down_proj_bias"] = value
        elif w == "w2":
            out[f"{p}.down_proj"] = value
        elif w == "w1":
            out[f"{p}.gate_up_proj"] = torch.cat([value, sd[f"{p}.w3"]], dim=1)
        elif w.startswith("b"):
            raise ValueError(f"{key}: family {family} has no expert biases")
    return out


# ---------------------------------------------------------------------------------------------
# Model-level load/export; expert-parallel aware (each rank reads only its experts).


def _expert_slice(sd: Mapping[str, torch.Tensor], prefix: str, w: str, start: int, count: int,
                  family: str, used: set[str]) -> torch.Tensor:
    bias = w.startswith("b")
    fused = f"{prefix}.{'gate_up_proj' if w in ('w1', 'w3', 'b1', 'b3') else 'down_proj'}" \
        + ("_bias" if bias else "")
    if fused in sd:
        used.add(fused)
        full = sd[fused]
        if full.shape[0] < start + count:
            raise StateDictError(f"{fused}: has {full.shape[0]} experts, need {start + count}")
        return fused_to_ours(fused, full[start:start + count], family)[f"{prefix}.{w}"]
    if bias:
        raise StateDictError(f"missing expert biases {fused!r}")
    keys = [f"{prefix}.{e}.{PER_EXPERT[w]}.weight" for e in range(start, start + count)]
    absent = [k for k in keys if k not in sd]
    if absent:
        raise StateDictError(f"missing expert tensors (neither {fused} nor per-expert keys): "
                             f"{absent[:4]}{' ...' if len(absent) > 4 else ''}")
    used.update(keys)
    return torch.stack([sd[k] for k in keys])


def extra_layer(key: str, cfg) -> bool:
    """A tensor of the layers a checkpoint stores after the model's (multi-token prediction)."""
    m = _LAYER_RE.match(key)
    return bool(m) and cfg.num_layers <= int(m["i"]) < cfg.num_layers + cfg.mtp_layers


def log_skipped_layers(keys, cfg, source: str = "the checkpoint") -> None:
    skipped = sorted({int(_LAYER_RE.match(k)["i"]) for k in keys if extra_layer(k, cfg)})
    if skipped:
        log.info("%s: skipping the multi-token-prediction layer(s) %s (%d tensors), which the "
                 "workbench model does not build", source,
                 ", ".join(f"model.layers.{i}.*" for i in skipped),
                 sum(1 for k in keys if extra_layer(k, cfg)))


@torch.no_grad()
def load_hf_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], *,
                       strict: bool = True) -> None:
    """Copy a transformers state dict of the model's family (fused or per-expert experts) into
    `model` in place.

    Parameters stay the same objects (optimizer-safe). Under EP only the rank's expert slice is
    read. strict: unexpected keys are an error, except experts that belong to other ranks and
    the checkpoint's multi-token-prediction layers (skipped with one log line)."""
    cfg = model.config
    family = cfg.family
    used: set[str] = set()
    expert_modules: dict[str, int] = {}  # prefix -> global expert count
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            expert_modules[module_name] = module.num_global_experts
            value = _expert_slice(sd, module_name, leaf, module.expert_offset, module.num_experts,
                                  family, used)
        elif (theirs := hf_name(name, family)) in sd:
            value = sd[theirs]
            used.add(theirs)
        else:
            raise StateDictError(f"missing tensor {hf_name(name, family)!r} in the state dict")
        if tuple(value.shape) != tuple(param.shape):
            raise StateDictError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                                 f"{tuple(param.shape)}")
        param.copy_(value)
    if cfg.tie_embeddings and "lm_head.weight" in sd:
        used.add("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"].to(model.lm_head.weight.dtype),
                           model.lm_head.weight):
            raise StateDictError("lm_head.weight differs from model.embed_tokens.weight but the "
                                 "config ties them (tie_embeddings=True)")
    log_skipped_layers(sd, cfg)
    if strict:
        def other_ranks_expert(key: str) -> bool:
            m = _PER_EXPERT_RE.match(key)
            return bool(m) and int(m["e"]) < expert_modules.get(m["prefix"], 0)

        unexpected = [k for k in sd if k not in used and not other_ranks_expert(k)
                      and not extra_layer(k, cfg)]
        if unexpected:
            raise StateDictError(f"unexpected tensors in the state dict: {unexpected[:8]}")


def to_hf_state_dict(model: nn.Module, *, layout: str = "fused") -> dict[str, torch.Tensor]:
    """transformers names for this model's tensors (detached, shared storage where the layout
    allows). Under EP use layout="per_expert": each rank then returns its own experts under
    their global indices (not for gpt-oss, whose checkpoints hold whole fused stacks)."""
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
    return ours_to_hf(ours, layout=layout, expert_offset=offset or 0, family=model.config.family)
