"""`from_pretrained`: the workbench model of a checkpoint folder, BF16 or packed, any family.

    model = from_pretrained("./gpt-oss-20b")          # MXFP4 experts decoded to fp32 masters
    model = from_pretrained(path, dtype=torch.bfloat16, device="cuda", ep_group=group)

The config comes from the folder's config.json (`workbench.arch.from_checkpoint`: the family's
transformers config class), the weights through `workbench.checkpoint.open_checkpoint`: lazily,
a tensor at a time, packed weights (gpt-oss MXFP4 `*_blocks`/`*_scales`, DeepSeek FP8
block-scaled, compressed-tensors MXFP4 / NVFP4 / MXFP8, ModelOpt) decoded by the checkpoint
reader's reference codecs, which are tested bit for bit against each writer's own decode. A
packed weight decodes to BF16 (the values the format holds, in the dtype the writers decode to),
then widens to `dtype`; an unpacked one keeps its stored values. Under expert parallelism
(`ep_group`) a rank builds and reads only its own experts.

`load_pretrained_(model, path)` fills an already built model in place (the trainer's `--init`:
the model is built on the meta device, materialized, EP-sliced, then loaded before QAT and
FSDP). Every parameter must be found with its shape; every checkpoint tensor must be used,
except other ranks' experts, activation-scale companions of packed formats, and the
multi-token-prediction layers DeepSeek-V3 / GLM-4.5 store after the model (one log line).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from workbench.arch import MoEConfig, config_from_dict
from workbench.checkpoint import Checkpoint, open_checkpoint
from workbench.model.experts import GroupedExperts
from workbench.model.hf import extra_layer, hf_name, log_skipped_layers
from workbench.model.transformer import MoEForCausalLM

log = logging.getLogger(__name__)

_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
# our expert bias -> (transformers' fused bias of the family, columns it takes)
_BIAS = {"b1": ("gate_up_proj_bias", slice(0, None, 2)),
         "b3": ("gate_up_proj_bias", slice(1, None, 2)),
         "b2": ("down_proj_bias", slice(None))}


class PretrainedError(ValueError):
    """The checkpoint does not fit the model built from its config; the message names the
    folder and the tensor."""


def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu",
                    ep_group: dist.ProcessGroup | None = None,
                    config: MoEConfig | None = None, strict: bool = True) -> MoEForCausalLM:
    """The workbench model of the checkpoint at `path` (what `open_checkpoint` accepts: a
    folder, a hub id ``org/name[@revision]``, a URL, or an opened Checkpoint), in
    eval mode, ready for `model(input_ids).logits`. `config` overrides the config.json mapping
    (e.g. a longer max_seq_len); `strict=False` lets checkpoint tensors go unused (a config
    with a block switched off)."""
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    cfg = config if config is not None else config_from_dict(
        ck.config, source=f"{ck.source.label()}/config.json")
    model = MoEForCausalLM(cfg, ep_group=ep_group, device="meta", dtype=dtype)
    check_pretrained(model, ck)  # before allocating: the config must describe these tensors
    model = materialize(model, torch.device(device))
    load_pretrained_(model, ck, strict=strict)
    return model.eval()


def materialize(model: MoEForCausalLM, device: torch.device) -> MoEForCausalLM:
    """Allocate a meta-built MoEForCausalLM on `device`, parameters uninitialised: what its
    constructor does after its own to_empty, minus the seeded draw."""
    model.to_empty(device=device)
    if model.config.tie_embeddings:  # to_empty allocates the two names separately
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb.reset_inv_freq()  # a non-persistent buffer: no loader restores it
    return model


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _sources(model: nn.Module, ck: Checkpoint, used: set[str]
             ) -> list[tuple[str, nn.Parameter, Callable[[], torch.Tensor]]]:
    """(name, parameter, read) for every parameter, its checkpoint shape checked against the
    parameter's: reads nothing but the index, so it runs on a meta-device model too (a config.json
    describing a model larger than its tensors fails here, before anything is allocated)."""
    cfg = model.config
    where = str(ck.path)
    logical = set(ck.logical_names())
    fused_bias: dict[str, torch.Tensor] = {}  # gpt-oss's gate_up bias holds b1 and b3: read once
    out = []
    for name, param in model.named_parameters():  # a tied lm_head appears once, as the embedding
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, GroupedExperts):
            shape, read = _expert_source(ck, module_name, leaf, module, used, logical, fused_bias)
        else:
            theirs = hf_name(name, cfg.family)
            if theirs not in logical:
                raise PretrainedError(f"{where}: no tensor {theirs!r} for the model's {name} "
                                      f"({tuple(param.shape)})")
            view = ck.tensor(theirs, keep_dtype=True)
            shape, read = tuple(view.shape), view.materialize
            used.add(theirs)
        if shape != tuple(param.shape):
            raise PretrainedError(f"{where}: {name} is {shape} in the checkpoint, the model "
                                  f"needs {tuple(param.shape)}")
        out.append((name, param, read))
    return out


def check_pretrained(model: nn.Module, path: str | os.PathLike | Checkpoint) -> None:
    """Raise PretrainedError unless every parameter of `model` (any device, meta included) has
    its tensor, of its shape, in the checkpoint. Reads no tensor data."""
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    _sources(model, ck, set())


@torch.no_grad()
def load_pretrained_(model: nn.Module, path: str | os.PathLike | Checkpoint, *,
                     progress: bool | None = None, strict: bool = True) -> dict:
    """Fill `model` (a MoEForCausalLM, possibly EP-sliced) from the checkpoint at `path`, in
    place; returns {"bytes_read": stored bytes read, "items_read": tensors read}. Not a
    collective: each rank reads what it holds. Every shape is checked before anything is read."""
    ck = path if isinstance(path, Checkpoint) else open_checkpoint(path)
    cfg = model.config
    where = str(ck.path)
    logical = set(ck.logical_names())
    stats = ck.index.stats
    before = stats.bytes_read
    used: set[str] = set()
    sources = _sources(model, ck, used)
    show = _is_main() if progress is None else progress
    # disable=None: tqdm draws only on a terminal
    for _, param, read in tqdm(sources, desc=f"loading {os.path.basename(where)}", unit="tensor",
                               disable=None if show else True, leave=False):
        param.copy_(read().to(param.dtype))
    if cfg.tie_embeddings and "lm_head.weight" in logical:
        head = ck.tensor("lm_head.weight", keep_dtype=True).materialize()
        if not torch.equal(head.to(model.lm_head.weight.dtype), model.lm_head.weight.cpu()):
            raise PretrainedError(f"{where}: lm_head.weight differs from model.embed_tokens."
                                  "weight but the config ties them (tie_word_embeddings)")
        used.add("lm_head.weight")
    # every expert of every layer the model has is its tensors, whichever rank holds them
    routed_layers = {i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)}
    used |= {r.name for r in ck.experts() if r.layer in routed_layers}
    log_skipped_layers(logical, cfg, where)
    unexpected = sorted(n for n in logical - used if not extra_layer(n, cfg))
    if unexpected and strict:
        raise PretrainedError(f"{where}: {len(unexpected)} tensor(s) the model does not use "
                              f"(wrong family or config?): {unexpected[:6]}")
    return {"bytes_read": stats.bytes_read - before, "items_read": len(sources)}


def _expert_source(ck: Checkpoint, module_name: str, leaf: str, module: GroupedExperts,
                   used: set[str], logical: set[str], fused_bias: dict[str, torch.Tensor]
                   ) -> tuple[tuple[int, ...], Callable[[], torch.Tensor]]:
    """(shape, read) of this rank's slice of one expert parameter."""
    where = str(ck.path)
    layer = int(module_name.split(".")[2])  # model.layers.{L}.mlp.experts
    start, count = module.expert_offset, module.num_experts
    if leaf in _PROJ:
        try:
            stack = ck.stacked_experts(layer, _PROJ[leaf], keep_dtype=True)
        except (KeyError, ValueError) as e:
            raise PretrainedError(f"{where}: layer {layer}: {e}") from e
        if stack.shape[0] != module.num_global_experts:
            raise PretrainedError(f"{where}: layer {layer} has {stack.shape[0]} routed experts, "
                                  f"the config {module.num_global_experts}")
        return (count, *stack.shape[1:]), lambda: stack[start:start + count]
    fused, cols = _BIAS[leaf]
    theirs = f"{module_name}.{fused}"
    if theirs not in logical:
        raise PretrainedError(f"{where}: no tensor {theirs!r} for the experts' biases")
    used.add(theirs)
    view = ck.tensor(theirs, keep_dtype=True)
    width = len(range(view.shape[1])[cols]) if len(view.shape) == 2 else -1
    if len(view.shape) != 2 or view.shape[0] != module.num_global_experts:
        raise PretrainedError(f"{where}: {theirs} is {tuple(view.shape)}, expected "
                              f"[{module.num_global_experts}, ...]")

    def read() -> torch.Tensor:
        if theirs not in fused_bias:
            fused_bias.clear()  # one layer's at a time
            fused_bias[theirs] = view[start:start + count]
        return fused_bias[theirs][:, cols]

    return (count, width), read
