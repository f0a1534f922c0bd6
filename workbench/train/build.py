"""Everything the loop needs before step 1: model (EP-sharded), QAT prepare, optimizer, schedule."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.model import ModelConfigError, MoEForCausalLM, from_checkpoint, preset
from workbench.model.pretrained import materialize
from workbench.qat import QATState, prepare
from workbench.train.act_ckpt import apply_activation_checkpointing
from workbench.train.config import TrainConfig
from workbench.train.distributed import DistInfo, Layout, make_layout
from workbench.train.fsdp import apply_fsdp
from workbench.train.init import check_init_shapes, load_init
from workbench.train.init_source import init_checkpoint, init_config_folder
from workbench.train.optim import AdamW
from workbench.train.router_bias import sigmoid_routers

# The routed experts are what QAT fake-quantizes and what the packed export packs; attention,
# router, dense FFNs, embeddings and lm_head stay BF16 (the Kimi K3 / gpt-oss recipes).
QAT_SCOPE = "routed-experts"


@dataclass
class Built:
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    qat_report: Any  # workbench.qat's report, None for bf16
    layout: Layout | None = None  # None: built by a caller that predates layouts (EP = world)
    # what the optimizer hands QAT's forward (the NVFP4 per-expert amax); None for bf16
    qat_state: QATState | None = None


def lr_factor(i: int, *, warmup: int, steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for step i+1 (i optimizer steps done): linear warmup, cosine."""
    if i < warmup:
        return (i + 1) / warmup
    progress = min(1.0, (i - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def model_config(cfg: TrainConfig):
    """The model's MoEConfig: the preset's, or (no preset) the --init checkpoint's config.json.
    max_seq_len grows to --seq + 1 when a run trains on longer sequences than the preset lists."""
    mcfg = preset(cfg.preset) if cfg.preset is not None else \
        from_checkpoint(init_config_folder(cfg.init))
    # a batch row holds seq + 1 tokens: the last one is only a label, but the model sees it
    return mcfg.replace(max_seq_len=max(cfg.seq + 1, mcfg.max_seq_len))


def build_model(cfg: TrainConfig, info: DistInfo, *, overwritten: bool = False,
                layout: Layout | None = None,
                before_alloc: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """`overwritten`: every parameter is about to be loaded (--init or a checkpoint), so the
    seeded initialisation (drawn on CPU, seconds per billion parameters) is skipped and the
    parameters are left uninitialised; the loaders fail on any tensor they cannot fill.
    `layout`: the EP group the experts are sliced over (default: EP size = world size).
    `before_alloc(meta_model)`: runs on the meta-device model before an `overwritten` model is
    allocated (build checks the --init shapes there)."""
    mcfg = model_config(cfg)
    ep = layout.ep if layout is not None else info.world
    ep_group = layout.ep_group if layout is not None else info.group
    if mcfg.num_experts % ep:
        what = f"preset {cfg.preset!r}" if cfg.preset else f"--init {cfg.init}"
        how = "TrainConfig.ep" if cfg.ep is not None else "EP size = world size"
        raise ValueError(f"{what} has {mcfg.num_experts} experts, which do not "
                         f"split over EP size {ep} ({how})")
    if not overwritten:
        model = MoEForCausalLM(mcfg, seed=cfg.seed, ep_group=ep_group, device=info.device,
                               dtype=torch.float32)
    else:
        # On the meta device the model skips reset_parameters (see MoEForCausalLM.__init__).
        meta = MoEForCausalLM(mcfg, seed=cfg.seed, ep_group=ep_group, device="meta",
                              dtype=torch.float32)
        if before_alloc is not None:
            before_alloc(meta)
        model = materialize(meta, info.device)
    if layout is not None and layout.dp > 1:
        # The aux loss of the global batch, as at EP1 (MoEForCausalLM.balance_group).
        model.balance_group = info.group
    return model


def prepare_qat(model: nn.Module, cfg: TrainConfig, state: QATState | None = None) -> Any:
    if cfg.qat_recipe.is_bf16:
        return None
    return prepare(model, recipe=cfg.qat_recipe, scope=QAT_SCOPE, state=state)


def compile_layers(model: nn.Module) -> int:
    """Regional compilation, as torchtitan does it: each decoder layer's forward through
    ``torch.compile`` (layers of one kind share a graph), after activation checkpointing (the
    recompute is compiled too) and before FSDP. The embedding, the LM head and its chunked loss
    stay outside. Returns the number of layers."""
    layers = model.model.layers
    for layer in layers:
        layer.compile()
    return len(layers)


def build_optimizer(model: nn.Module, cfg: TrainConfig, qat_state: QATState | None = None):
    # No weight decay on norm gains (1-D); matrices, embeddings and expert stacks decay.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    # torch's AdamW arithmetic and state; its update of NVFP4 expert stacks also produces their
    # per-expert amax, which the sink hands to the next forward's fake quantization
    opt = AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps,
        # One code path on every machine: foreach/fused kernels may round differently.
        foreach=False,
        amax_sink=qat_state.optimizer_sink(model) if qat_state is not None else None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(
        lr_factor, warmup=cfg.warmup, steps=cfg.steps, min_ratio=cfg.min_lr_ratio))
    return opt, sched


def build(cfg: TrainConfig, info: DistInfo, *, resuming: bool = False) -> Built:
    """`resuming`: a checkpoint will overwrite every weight, so --init is not read."""
    cfg.check_world(info.world)
    layout = make_layout(info, cfg.ep, cfg.fsdp)
    init: dict[str, Any] = {}

    def open_init(meta: nn.Module) -> None:
        # a remote --init: this rank's shards are downloaded first (train.init_source); every
        # shape is checked on the meta model, so a config.json larger than its tensors fails
        # before a rank allocates its slice
        init["ck"] = init_checkpoint(cfg.init, meta, progress=info.is_main)
        check_init_shapes(init["ck"], meta)

    reading = bool(cfg.init) and not resuming
    model = build_model(cfg, info, overwritten=resuming or bool(cfg.init), layout=layout,
                        before_alloc=open_init if reading else None)
    if cfg.router_bias_update and not sigmoid_routers(model):
        raise ModelConfigError(f"--router-bias-update moves the e_score_correction_bias of "
                               f"sigmoid routers (DeepSeek-V3, Kimi K2, GLM-4.5); this "
                               f"{model.config.family} model routes with "
                               f"{model.config.router.kind!r}")
    if reading:
        load_init(init["ck"], model, info)  # before FSDP, into the plain EP-local tensors
    qat_state = None if cfg.qat_recipe.is_bf16 else QATState()
    report = prepare_qat(model, cfg, qat_state)
    apply_activation_checkpointing(model, cfg.activation_checkpointing)
    if cfg.compile:
        compile_layers(model)
    if layout.fsdp:
        apply_fsdp(model, layout, info.device)  # replaces the parameters by DTensor shards
    model.layout = layout  # read by the loop (gradient reduction) and checkpointing (resharding)
    opt, sched = build_optimizer(model, cfg, qat_state)  # after FSDP: the parameters it holds
    return Built(model, opt, sched, report, layout, qat_state)
