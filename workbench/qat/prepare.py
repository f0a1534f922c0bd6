"""``prepare`` a model for QAT and ``convert`` its masters to packed weights.

Contract (outside checks rely on it):
- ``prepare`` runs before the optimizer is built. Masters stay the same ``nn.Parameter``
  objects; nothing QAT adds is a Parameter, buffer or submodule, so ``state_dict()`` and
  optimizer state are exactly those of the unprepared model.
- It returns a report (converted, skipped with reason) and raises when it converts nothing or
  when a scoped weight's blocked dimension is not a multiple of the block (a TP shard of 48
  columns is never silently left unquantized).
- Our stacked experts get a new seam (``QATExpertGemms``) whose recipes are fixed by role and
  parameter name here; wrappers applied later (FSDP2, activation checkpointing) need not know it.
  With a ``QATState`` (the trainer's), the NVFP4 stacks' names are registered with it, so the
  optimizer can hand their per-expert amax to the forward (``workbench.qat.state``).
- ``convert`` returns ``{param_name: QuantizedTensor}``, bit-identical to
  ``workbench.formats.quantize`` of the master with the same recipe (3-D stacks: one NVFP4
  per-tensor scale per expert; gpt-oss ``[E, in, out]`` weights are packed transposed to the
  checkpoint's ``[E, out, in]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.formats import QuantizedTensor, Recipe, format_spec, quantize
from workbench.model.experts import EXPERT_WEIGHTS
from workbench.scope import QuantScope

from .grouped import QATExpertGemms
from .recipe import QATRecipe, parse_qat_recipe
from .state import QATState
from .ste import fake_quant_ste
from .styles import WeightSite, find_sites

log = logging.getLogger(__name__)
_STATE_ATTR = "_workbench_qat"


@dataclass
class PrepareReport:
    recipe: QATRecipe
    converted: list[WeightSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [(f"QAT prepare {self.recipe}: {len(self.converted)} weights fake-quantized, "
                  f"{len(self.skipped)} kept in BF16")]
        by_style: dict[str, int] = {}
        for s in self.converted:
            by_style[s.style] = by_style.get(s.style, 0) + 1
        lines += [f"  {n:5d} {style}" for style, n in sorted(by_style.items())]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped[:20]]
        if len(self.skipped) > 20:
            lines.append(f"  ... and {len(self.skipped) - 20} more kept")
        return "\n".join(lines)

    def __repr__(self) -> str:
        # The dataclass repr would list every weight; ``str()`` has the details.
        by_style: dict[str, int] = {}
        for s in self.converted:
            by_style[s.style] = by_style.get(s.style, 0) + 1
        styles = ", ".join(f"{k}={v}" for k, v in sorted(by_style.items()))
        return (f"PrepareReport({self.recipe}: {len(self.converted)} fake-quantized"
                f"{f' ({styles})' if styles else ''}, {len(self.skipped)} kept in BF16, "
                f"{len(self.notes)} notes)")


class ParamSwapForward:
    """Instance-level ``forward``: runs the class forward with fake-quantized weights swapped in
    for the masters (restored even when the forward raises), and fake-quantizes the first
    positional input when an activation recipe is set."""

    def __init__(self, module: nn.Module, weights: dict[str, tuple[Recipe, int]], act: Recipe | None):
        self.module = module
        self.weights = weights
        self.act = act

    def __call__(self, *args, **kwargs):
        m = self.module
        saved = {n: m._parameters[n] for n in self.weights}
        try:
            for n, (recipe, dim) in self.weights.items():
                m._parameters[n] = fake_quant_ste(saved[n], recipe, dim=dim,
                                                  per_leading=saved[n].dim() == 3)
            if self.act is not None and args and isinstance(args[0], torch.Tensor):
                args = (fake_quant_ste(args[0], self.act),) + args[1:]
            return type(m).forward(m, *args, **kwargs)
        finally:
            m._parameters.update(saved)


def _resolve_scope(scope, names):
    if isinstance(scope, str):
        return QuantScope.preset(scope, names=names)
    if not hasattr(scope, "is_quantized"):
        raise TypeError(f"scope must be a QuantScope or a preset name, got {type(scope).__name__}")
    return scope


def prepare(model: nn.Module, recipe: str | QATRecipe = "mxfp4", scope="routed-experts", *,
            profile: str | None = None, fuse_swiglu: bool = True,
            state: QATState | None = None) -> PrepareReport:
    """Fake-quantize the scoped weights (and activations) of ``model`` in place; see module doc.

    ``fuse_swiglu=False`` keeps the experts' plain SwiGLU, so the down projection quantizes its
    input itself: the same bits either way (the fused kernels are tested against it), for
    measuring what the fusion buys (``jobs/bench_train_gpu.py --swiglu-ab``).
    ``state``: the trainer's ``QATState``, through which the optimizer hands the forward the
    NVFP4 per-expert amax; without it the forward computes every amax (the same bits)."""
    qr = parse_qat_recipe(recipe, profile)
    if qr.is_bf16:
        raise ValueError("recipe 'bf16' fake-quantizes nothing: skip prepare() for the baseline")
    if getattr(model, _STATE_ATTR, None) is not None:
        raise RuntimeError("model is already prepared for QAT; call unprepare() first")
    sites, uncovered = find_sites(model)
    params = dict(model.named_parameters())
    sc = _resolve_scope(scope, {n: tuple(p.shape) for n, p in params.items()})
    report = PrepareReport(qr)
    chosen: list[WeightSite] = []
    for s in sites:
        if not sc.is_quantized(s.name):
            report.skipped.append((s.name, sc.reason(s.name)))
            continue
        k = params[s.name].shape[s.reduction_dim]
        block = format_spec(qr.weight.fmt).block if qr.weight else 1
        if qr.weight is not None and k % block:
            raise ValueError(f"{s.name}: reduction dim of size {k} is not a multiple of the "
                             f"{qr.weight.fmt} block ({block}); refusing to leave it unquantized "
                             "(is it a tensor-parallel shard?)")
        chosen.append(s)
    for name, why in uncovered.items():
        if sc.is_quantized(name):
            raise ValueError(f"{name} is in scope but cannot be fake-quantized: {why}")
        report.skipped.append((name, why))
    if not chosen:
        raise ValueError(f"prepare({qr}) converted nothing: no supported weight is in scope "
                         f"{getattr(sc, 'label', sc)!r}. Kept: {report.skipped[:5]}")
    if qr.weight is None:
        report.notes.append("activation-only recipe: weights stay BF16")
    by_module: dict[str, list[WeightSite]] = {}
    for s in chosen:
        by_module.setdefault(s.module_name, []).append(s)
    modules = dict(model.named_modules())
    for mname, ss in by_module.items():
        mod = modules[mname]
        if ss[0].style == "grouped-seam":
            scoped = {s.param for s in ss}
            names = {role: f"{mname}.{role}" if mname else role for role in EXPERT_WEIGHTS}
            weights = {role: qr.weight if role in scoped else None for role in EXPERT_WEIGHTS}
            if state is not None and qr.weight is not None and qr.weight.fmt == "nvfp4":
                for role in sorted(scoped):  # one global amax per expert: the optimizer's
                    state.want(names[role])
            mod.gemms = QATExpertGemms(weights, names, qr.act, fuse_act=fuse_swiglu,
                                       state=state, plain=mod.gemms)
        else:
            weights = {s.param: (qr.weight, s.reduction_dim) for s in ss if qr.weight}
            act = qr.act if ss[0].act else None
            if qr.act is not None and not ss[0].act:
                report.notes.append(f"{mname}: {ss[0].style} style keeps activations in BF16 "
                                    "(they are computed inside the module's own forward)")
            mod.forward = ParamSwapForward(mod, weights, act)
        report.converted.extend(ss)
    setattr(model, _STATE_ATTR, report)
    log.info("%s", report)
    return report


def unprepare(model: nn.Module) -> None:
    """Undo ``prepare``: restore the experts' previous seam and the class forwards (and let the
    ``QATState`` forget those weights)."""
    report: PrepareReport | None = getattr(model, _STATE_ATTR, None)
    if report is None:
        return
    modules = dict(model.named_modules())
    for mname in {s.module_name for s in report.converted}:
        mod = modules[mname]
        seam = mod.__dict__.get("gemms")
        if isinstance(seam, QATExpertGemms):
            if seam.state is not None:
                seam.state.forget(seam.names.values())
            mod.gemms = seam.plain
        mod.__dict__.pop("forward", None)
    delattr(model, _STATE_ATTR)


@torch.no_grad()
def convert(model: nn.Module) -> dict[str, QuantizedTensor]:
    """Pack every fake-quantized master with its recipe (see the module docstring)."""
    report: PrepareReport | None = getattr(model, _STATE_ATTR, None)
    if report is None:
        raise RuntimeError("convert() needs a model prepared with workbench.qat.prepare()")
    if report.recipe.weight is None:
        raise ValueError("recipe fake-quantizes no weights; there is nothing to pack")
    params = dict(model.named_parameters())
    return {s.name: pack_master(params[s.name], report.recipe.weight, s.reduction_dim)
            for s in report.converted}


def pack_master(w: torch.Tensor, recipe: Recipe, reduction_dim: int = -1) -> QuantizedTensor:
    """What ``convert`` packs for one master: blocks along ``reduction_dim`` (moved last); a 3-D
    stack gets one NVFP4 per-tensor scale per expert, from that expert's own amax, so ``w`` must
    hold whole experts (under FSDP: the gathered stack, never a shard)."""
    w = w.detach()
    if reduction_dim != -1:
        w = w.transpose(reduction_dim, -1).contiguous()
    kw = {}
    if recipe.fmt == "nvfp4" and w.dim() == 3:
        kw["global_amax"] = w.abs().amax(dim=(-2, -1), keepdim=True).float()
    return quantize(w, recipe, **kw)


def prepared_report(model: nn.Module) -> PrepareReport | None:
    return getattr(model, _STATE_ATTR, None)
